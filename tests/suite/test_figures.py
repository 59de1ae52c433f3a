"""The report figures as a reader sees them (issue 47 section 6): the figure objects the report functions
return are read back (titles, legends, axis limits, ticks, where the bars sit). A DoPr-only BC run is
titled by its own name with one tick at its trajectory count and its bar beside its point; a single
evaluation point is drawn; a diverged run is marked; a rehearsal sweep gets its table, not a crash."""
import json
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.common import report
from experiments.common.report import seed_band, split_diverged


def _legend(ax) -> list:
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg else []


def _bc_record(optim: str, n: int, seed: int, **over) -> dict:
    rets = list(np.random.default_rng(seed).normal(1800 + n, 50, 100))
    s = {"task": "humanoid", "env": "Humanoid-v5", "optim": optim, "num_trajectories": n, "seed": seed,
         "returns": {"1000": rets}, "train_loss": 1e-3, "val_loss": 1.6e-2, "lr": 1e-3, "weight_decay": 0.0,
         "damping": 1e-4 if optim.startswith("dopr_") else None, "expert_return": 3772.0, "train_time_s": 1.0,
         "eval_time_s": 2.0, "wall_time_s": 3.5}
    s.update(over)
    return {"summary": s}


def test_a_dopr_only_bc_run_is_titled_by_its_optimizer_with_its_bar_at_its_point(tmp_path):
    """The mission command (`python run.py -m task=humanoid optim=dopr_adamw`): one DoPr-AdamW run at 10
    trajectories used to be titled "adamw", on an x axis of 10.0-10.6 with its bar at 10.6."""
    from experiments.bc import report as bc_report

    fig = bc_report.bc([_bc_record("dopr_adamw", 10, 0)], tmp_path, "stamp")
    assert (tmp_path / "humanoid.png").exists()
    ax = fig.axes[0]
    assert ax.get_title() == "dopr_adamw"
    assert list(ax.get_xticks()) == [10] and ax.get_xlim() == (9.0, 11.0)
    assert _legend(ax) == ["dopr_adamw (1 seed)"]
    # the bootstrap bar: at x = 10 in data (shifted a few points on the page), not at 10.6
    from matplotlib.collections import LineCollection

    bars = [seg for c in ax.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert bars and all(np.allclose(seg[:, 0], 10.0) for seg in bars)
    assert all(a.get_xlim() == (9.0, 11.0) for a in fig.axes)


def test_a_bc_pair_is_titled_gp_vs_dopr_with_a_tick_per_trajectory_count(tmp_path):
    from experiments.bc import report as bc_report

    records = [_bc_record(o, n, s) for o in ("adamw", "dopr_adamw") for n in (10, 20, 30) for s in (0, 1)]
    fig = bc_report.bc(records, tmp_path, "stamp")
    ax = fig.axes[0]
    assert ax.get_title() == "adamw vs dopr_adamw"
    assert list(ax.get_xticks()) == [10, 20, 30] and ax.get_xlim() == (5.0, 35.0)
    assert _legend(ax) == ["adamw (2 seeds)", "dopr_adamw (2 seeds)"]


def test_a_diverged_bc_cell_is_marked(tmp_path):
    from experiments.bc import report as bc_report

    records = [_bc_record("adamw", n, 0) for n in (10, 20)]
    records.append(_bc_record("adamw", 30, 0, train_loss=math.nan, val_loss=math.nan))
    fig = bc_report.bc(records, tmp_path, "stamp")
    train, val = fig.axes[1], fig.axes[2]
    for ax in (train, val):
        assert any("diverged" in t for t in _legend(ax))
        marks = [l for l in ax.get_lines() if l.get_marker() == "x"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [30]
    csv = (tmp_path / "humanoid.csv").read_text()
    assert "nan" in csv   # the table keeps its numbers


def test_seed_band_draws_a_single_point_and_marks_a_diverged_seed():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert split_diverged({1: 1.0, 2: 0.5, 3: math.nan, 4: 0.1}) == ({1: 1.0, 2: 0.5}, True)
    assert split_diverged({1: 1.0, 2: None}) == ({1: 1.0}, True)
    fig, (a, b) = plt.subplots(1, 2)
    seed_band(a, [{4000: 3.0}, {4000: 3.4}], "adamw (2 seeds)", "C0")
    assert _finite_points(a) == [(4000, 3.2)]
    assert a.get_xlim()[0] <= 0 and a.get_xlim()[1] > 4000
    a.legend()
    assert _legend(a) == ["adamw (2 seeds; one evaluation point)"]
    seed_band(b, [{1: 2.0, 2: 1.0, 3: 0.5}, {1: 2.0, 2: 5.0, 3: math.inf}], "sgd", "C1")
    b.legend()
    assert _legend(b)[0] == "sgd, 1 of 2 diverged" and "diverged" in _legend(b)[-1]
    x = [l for l in b.get_lines() if l.get_marker() == "x"][0]
    assert (list(x.get_xdata()), list(x.get_ydata())) == ([2], [5.0])   # its last finite value
    plt.close(fig)


def _finite_points(ax) -> list:
    """The (x, y) of the round markers (rounded to 6 digits)."""
    return [(float(x), round(float(y), 6)) for l in ax.get_lines() if l.get_marker() == "o"
            for x, y in zip(l.get_xdata(), l.get_ydata()) if math.isfinite(y)]


def _sit_record(tmp_path, optim, seed, curve, losses, diverged_at=None, lr=1e-3) -> dict:
    d = tmp_path / f"{optim}_{seed}_{lr}"
    d.mkdir()
    q = None if diverged_at is not None or not curve else list(curve.values())[-1]
    s = {"task": "sit_digits", "optim": optim, "seed": seed, "lr": lr, "damping": 1e-3 if "dopr" in optim else None,
         "warmup_steps": 0, "quality_metric": "fd_digits", "quality": q,
         "best_quality": min(curve.values()) if curve else None, "quality_curve": {str(k): v for k, v in curve.items()},
         "label_accuracy": None, "train_loss": list(losses.values())[-1], "steps": 4, "batch_size": 4,
         "step_time_s": 0.1, "diverged_at": diverged_at}
    return {"dir": d, "summary": s, "metrics": [{"step": k, "train_loss": v} for k, v in losses.items()]}


def test_a_sit_report_with_one_evaluation_point_draws_it(tmp_path):
    """debug=default evaluates once, at the last step: the quality panel used to be empty."""
    from experiments.sit import report as sit_report

    records = [_sit_record(tmp_path, o, 0, {4: q}, {2: 1.67, 4: 1.6}) for o, q in (("adamw", 381.79),
                                                                                  ("dopr_adamw", 381.75))]
    fig = sit_report.quality(records, tmp_path, "stamp")
    ax = fig.axes[0]
    assert ax.get_title() == "adamw vs dopr_adamw: sample quality"
    assert sorted(_finite_points(ax)) == [(4, 381.75), (4, 381.79)]
    assert _legend(ax) == ["adamw (1 seed; one evaluation point)", "dopr_adamw (1 seed; one evaluation point)"]
    assert ax.get_xlim()[0] <= 0 < 4 < ax.get_xlim()[1]
    # a log axis of less than a decade reads in plain numbers
    assert [t.get_text() for t in ax.get_yticklabels() if t.get_text()][0].replace(".", "").isdigit()


def test_a_diverged_sit_run_is_marked_in_both_panels(tmp_path):
    from experiments.sit import report as sit_report

    records = [_sit_record(tmp_path, "adamw", 0, {10: 9.0, 20: 5.0, 30: 4.0}, {10: 1.0, 20: 0.8, 30: 0.7}),
               _sit_record(tmp_path, "adamw", 1, {10: 9.5}, {10: 1.1, 15: math.nan}, diverged_at=15)]
    fig = sit_report.quality(records, tmp_path, "stamp")
    quality, loss = fig.axes[0], fig.axes[1]
    assert _legend(quality)[0] == "adamw (2 seeds), 1 of 2 diverged"
    for ax, last in ((quality, (10, 9.5)), (loss, (10, 1.1))):
        assert any(t.startswith("diverged") for t in _legend(ax))
        x = [l for l in ax.get_lines() if l.get_marker() == "x"]
        assert len(x) == 1 and (x[0].get_xdata()[0], x[0].get_ydata()[0]) == last
    row = sit_report.rows(records)[0]
    assert row["diverged"] == 1 and row["final_max"] == math.inf   # the table as before


def _rehearsal_summary(optim: str) -> dict:
    return {"task": "sit_imagenet", "optim": optim, "seed": 0, "rehearsal": True, "model": "SiT-S/2", "batch": 4,
            "params_M": 33.0, "trainable_M": 33.0, "losses": [1.0, 0.9, 0.8, 0.7], "loss_first": 1.0,
            "loss_last": 0.7, "finite": True, "falls": True, "step_s": 0.5, "param_MB": 126.0,
            "opt_state_MB": 252.0, "dopr_state_MB": 0.0, "device": "cpu", "peak_rss_MB": 900.0,
            "peak_since": "this job's steps", "verdict": "ok"}


def test_the_report_of_a_rehearsal_sweep_is_the_rehearsal_table(tmp_path, compose):
    """`python -m experiments.report` on `sweep=paper_sit rehearse=true` raised KeyError: 'quality_curve'."""
    sweep = tmp_path / "sweep"
    for i, optim in enumerate(("adamw", "dopr_adamw")):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        OmegaConf.save(compose("sweep=paper_sit", f"+tuned/sit_imagenet={optim}", "rehearse=true"),
                       job / ".hydra" / "config.yaml")
        (job / "summary.json").write_text(json.dumps(_rehearsal_summary(optim)))
    report.main([str(sweep), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "sit_imagenet" / "paper_sit" / "rehearsal.md").read_text()
    assert "| sweep | sit_imagenet | adamw | SiT-S/2 | 4 |" in md and "dopr_adamw" in md
    assert "The AP health is measured on the rehearsal batch" in md and ".." not in md
    assert not list((tmp_path / "out").rglob("sit_quality*"))
    # handed to the SiT report directly: the same table, and no quality figure
    from experiments.common.launch import run_job  # noqa: F401  (the suite's imports, as the driver has them)
    from experiments.common.report import load_records
    from experiments.sit import report as sit_report

    assert sit_report.quality(load_records([sweep]), tmp_path, "stamp") is None
    assert (tmp_path / "rehearsal.md").exists()


def test_sit_runs_without_sample_quality_get_a_table_not_a_crash(tmp_path):
    from experiments.sit import report as sit_report

    r = _sit_record(tmp_path, "adamw", 0, {}, {2: 1.7, 4: 1.6})
    del r["summary"]["quality_curve"]   # a summary without the key at all
    assert sit_report.quality([r], tmp_path, "stamp") is None
    assert "| sit_digits | adamw | 1 | 0.001 | 4 | 1.6 |" in (tmp_path / "sit_unevaluated.md").read_text()


def test_a_rehearsal_sweep_goes_to_multirun_rehearsal_not_the_paper_folder(compose):
    rehearsal = compose("sweep=paper_sit", "rehearse=true", hydra_config=True).hydra.sweep.dir
    real = compose("sweep=paper_sit", hydra_config=True).hydra.sweep.dir
    assert rehearsal.startswith("multirun/rehearsal/paper_sit/") and real.startswith("multirun/paper_sit/")
    assert compose("task=sit_imagenet", "rehearse=true", hydra_config=True).hydra.sweep.dir.startswith(
        "multirun/rehearsal/sit_imagenet/")


def _fl_record(optim, seed, lr, values) -> dict:
    metrics = [{"step": 10 * (i + 1), "val_loss": v, "subspace_distance": 0.5 if math.isfinite(v) else math.nan}
               for i, v in enumerate(values)]
    finite = [v for v in values if math.isfinite(v)]
    return {"summary": {"optim": optim, "seed": seed, "lr": lr, "val_loss": values[-1] if finite == values else math.nan,
                        "subspace_distance": 0.5}, "metrics": metrics}


def test_feature_learning_draws_each_of_two_rates_and_marks_a_diverged_seed(tmp_path):
    """A protocol sweep runs DoPr at its own and at its GP's rate: both are drawn (the figure used to keep
    the lower validation loss only, hiding the selected arm); a tuning sweep's many rates: the best."""
    from experiments.theory import report as theory_report

    records = [_fl_record("sgd", 0, 0.1, [1.0, 0.5, 0.2]), _fl_record("sgd", 1, 0.1, [1.0, 0.6, 0.3]),
               _fl_record("sgd", 2, 0.1, [1.0, math.nan, math.nan]), _fl_record("sgd", 0, 0.01, [1.0, 0.9, 0.8]),
               _fl_record("dopr_sgd", 0, 0.01, [1.0, 0.1, 0.01])]
    fig = theory_report.feature_learning(records, tmp_path, "stamp")
    assert _legend(fig.axes[1]) == ["sgd (lr 0.01, 1 seed)", "sgd (lr 0.1, 3 seeds), 1 of 3 diverged",
                                    "dopr_sgd (lr 0.01, 1 seed)", "diverged (x: last finite value)"]
    x = [l for l in fig.axes[0].get_lines() if l.get_marker() == "x"][0]
    assert (x.get_xdata()[0], x.get_ydata()[0]) == (10, 1.0)
    dashed = {l.get_label(): l.get_linestyle() for l in fig.axes[0].get_lines() if not l.get_label().startswith("_")}
    assert dashed["sgd (lr 0.01, 1 seed)"] == "--" and dashed["dopr_sgd (lr 0.01, 1 seed)"] == "-"
    records += [_fl_record("sgd", 0, lr, [1.0, 0.9, 0.85]) for lr in (1e-3, 1e-4)]
    fig = theory_report.feature_learning(records, tmp_path, "stamp")
    assert _legend(fig.axes[1])[0] == "sgd (lr 0.01, best of 4 rates, 1 seed)"   # lr 0.1 has a diverged seed: inf


def test_a_diverged_sft_rate_is_marked_on_the_right_edge(tmp_path):
    from experiments.llm import report as llm_report

    records = [{"summary": {"task": "sft_arith", "optim": "adamw", "lr": lr, "seed": 0, "val_nll": nll,
                            "train_loss": nll, "accuracy": acc, "accuracy_stderr": 0.01}}
               for lr, nll, acc in ((1e-3, 0.1, 0.5), (3e-3, 0.05, 0.8), (3e-2, math.inf, 0.0))]
    fig = llm_report.sft(records, tmp_path, "stamp")
    ax = fig.axes[0]
    assert _legend(ax) == ["adamw", "diverged (NLL not finite; x on the right edge)"]
    x = [l for l in ax.get_lines() if l.get_marker() == "x"][0]
    assert list(x.get_ydata()) == [0.0]
