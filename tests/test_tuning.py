"""The tuning protocol (experiments/common/tuning.py): equal budgets, selection on tuning seeds,
winners re-run on fresh seeds through generated tuned configs, reports on fresh seeds only."""
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT
from experiments.common import tuning


def _rec(optim, seed, value, **over):
    overrides = [f"+tuned/t={optim}", f"seed={seed}", "launcher=local"] + [f"{k}={v}" for k, v in over.items()]
    return {"summary": {"optim": optim, "seed": seed, "val": value, "overrides": overrides}, "config": None}


def _grid(optim, values, knob):
    """values: {(lr, knob value): [per-seed metric]}"""
    return [_rec(optim, seed, v, **{"optim.lr": lr, knob: k})
            for (lr, k), vs in values.items() for seed, v in enumerate(vs)]


def test_select_takes_the_best_mean_over_tuning_seeds_and_a_nan_is_the_worst():
    recs = _grid("adamw", {("1e-3", "0.0"): [3.0, 1.0], ("1e-2", "0.0"): [2.5, 2.4],
                           ("1e-3", "0.1"): [float("nan"), 0.1], ("1e-2", "0.1"): [2.2, 2.2]}, "optim.weight_decay")
    recs += _grid("dopr_adamw", {("1e-3", "1e-4"): [5.0, 5.0], ("1e-2", "1e-4"): [0.5, 0.7],
                                 ("1e-3", "1e-3"): [1.0, 1.0], ("1e-2", "1e-3"): [0.9, 0.2]}, "ap.damping")
    sel = tuning.select(recs, "val", "min")
    gp, dopr = sel["arms"]["adamw"], sel["arms"]["dopr_adamw"]
    # (3 + 1)/2 = 2.0 beats 2.2 and 2.45; the NaN seed makes (1e-3, 0.1) the worst despite its 0.1
    assert gp["winner"] == {"optim.lr": "1e-3", "optim.weight_decay": "0.0"} and gp["value"] == 2.0
    assert gp["trials"][-1]["setting"] == {"optim.lr": "1e-3", "optim.weight_decay": "0.1"}
    assert dopr["winner"] == {"optim.lr": "1e-2", "ap.damping": "1e-3"} and math.isclose(dopr["value"], 0.55)
    assert gp["grid"] == {"optim.lr": ["1e-3", "1e-2"], "optim.weight_decay": ["0.0", "0.1"]}
    assert sel["seeds"] == [0, 1] and sel["pairs"] == [("adamw", "dopr_adamw")]
    assert gp["at_grid_edge"] == []  # two values per knob: every value is an edge, nothing to flag
    assert gp["base"] == {"+tuned/t": "adamw"}  # launcher and seed are not settings
    chosen = tuning.chosen_settings(sel)
    assert chosen["dopr_adamw_at_gp_lr"] == {"+tuned/t": "dopr_adamw", "ap.damping": "1e-3", "optim.lr": "1e-3"}
    assert tuning.select(recs, "val", "max")["arms"]["adamw"]["winner"]["optim.lr"] == "1e-2"  # 2.45 the largest


def test_select_refuses_unequal_budgets_and_unfinished_settings():
    gp = _grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0], ("1e-1", "0"): [3.0]}, "optim.weight_decay")
    dopr = _grid("dopr_sgd", {("1e-3", "1e-4"): [1.0], ("1e-2", "1e-4"): [2.0]}, "ap.damping")
    with pytest.raises(ValueError, match="unequal tuning budgets: sgd had 3 settings, dopr_sgd 2"):
        tuning.select(gp + dopr, "val")
    assert len(tuning.select(gp + dopr, "val", allow_unequal=True)["arms"]["sgd"]["trials"]) == 3
    two_seeds = _grid("sgd", {("1e-3", "0"): [1.0, 1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
    with pytest.raises(ValueError, match=r"ran seeds \[0\], the others \[0, 1\]"):
        tuning.select(two_seeds + _grid("dopr_sgd", {("1e-3", "1e-4"): [1.0, 1.0], ("1e-2", "1e-4"): [1, 1]},
                                        "ap.damping"), "val")
    edge = tuning.select(gp + dopr, "val", allow_unequal=True)["arms"]["sgd"]
    assert edge["winner"] == {"optim.lr": "1e-3"} and edge["at_grid_edge"] == ["optim.lr"]  # smallest of 3 rates
    with pytest.raises(ValueError, match="no GP with its DoPr variant"):
        tuning.select(gp, "val")


def test_a_tuned_config_puts_group_choices_in_its_defaults_and_values_as_yaml():
    text = tuning.tuned_config({"+tuned/sft": "dopr_adamw", "optim": "dopr_adamw", "optim.lr": "1e-2",
                                "ap.damping": "1e-3", "ap.skip_layers": "[a,b]", "ap.damping_mode": "trace"}, "why")
    assert text.splitlines()[:5] == ["# @package _global_", "# why", "defaults:",
                                     "  - /tuned/sft@_global_: dopr_adamw", "  - override /optim: dopr_adamw"]
    import yaml

    body = yaml.safe_load(text)
    assert body["optim"] == {"lr": 0.01} and body["ap"] == {"damping": 0.001, "skip_layers": ["a", "b"],
                                                              "damping_mode": "trace"}


def _run(*args, timeout=600):
    res = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.slow
def test_the_protocol_end_to_end_tune_select_rerun_on_fresh_seeds_report(tmp_path):
    tune, fresh, out, conf = tmp_path / "tune", tmp_path / "fresh", tmp_path / "out", tmp_path / "conf"
    _run("run.py", "-m", "task=feature_learning", "debug=default", "+tuned/feature_learning=sgd,dopr_sgd",
         "optim.lr=1e-3,1e-2", "ap.damping_mode=trace", "seed=0", f"hydra.sweep.dir={tune}")
    sel_run = _run("-m", "experiments.common.tuning", "select", str(tune), "--out", str(out),
                   "--configs", str(conf / "tuned" / "fl"))
    sel = json.loads((out / "selection.json").read_text())
    assert sel["metric"] == "val_loss" and sel["seeds"] == [0]  # the task's tuning.metric
    summaries = {(json.loads(p.read_text())["optim"], json.loads(p.read_text())["lr"]): json.loads(p.read_text())
                 for p in tune.rglob("summary.json")}
    for arm in ("sgd", "dopr_sgd"):
        best_lr = min((lr for o, lr in summaries if o == arm), key=lambda lr: summaries[(arm, lr)]["val_loss"])
        assert float(sel["arms"][arm]["winner"]["optim.lr"]) == best_lr, sel_run.stdout
    gp_lr, dopr_lr = (float(sel["arms"][a]["winner"]["optim.lr"]) for a in ("sgd", "dopr_sgd"))
    # DoPr at the GP's rate is a config of its own only where that rate is not DoPr's winner already
    assert {p.name for p in (conf / "tuned" / "fl").iterdir()} == {"sgd.yaml", "dopr_sgd.yaml"} | (
        {"dopr_sgd_at_gp_lr.yaml"} if gp_lr != dopr_lr else set())
    assert "| chosen |" in (out / "selection.md").read_text()

    _run("run.py", "-m", "task=feature_learning", "debug=default", f"hydra.searchpath=[file://{conf}]",
         # what `glob(*)` gives in conf/ (Hydra's glob does not list a group from a command-line searchpath)
         "+tuned/fl=" + ",".join(sorted(p.stem for p in (conf / "tuned" / "fl").iterdir())), "seed=1,2",
         f"hydra.sweep.dir={fresh}")
    rerun = [json.loads(p.read_text()) for p in fresh.rglob("summary.json")]
    assert sorted((s["optim"], s["lr"], s["seed"]) for s in rerun) == sorted(
        {("sgd", gp_lr, 1), ("sgd", gp_lr, 2), ("dopr_sgd", gp_lr, 1), ("dopr_sgd", gp_lr, 2),
         ("dopr_sgd", dopr_lr, 1), ("dopr_sgd", dopr_lr, 2)})
    assert all(s["conventions"]["damping_mode"] == "trace" for s in rerun if s["optim"] == "dopr_sgd")

    _run("-m", "experiments.common.tuning", "report", str(fresh), "--selection", str(out / "selection.json"),
         "--out", str(out))
    md = (out / "protocol.md").read_text()
    rows = {l.split(" | ")[0].strip("| "): l for l in md.splitlines() if l.startswith("| ") and "arm" not in l}
    assert set(rows) == {"sgd", "dopr_sgd", "dopr_sgd_at_gp_lr"} and all("| 1 2 |" in r for r in rows.values())
    vals = sorted(s["val_loss"] for s in rerun if s["optim"] == "sgd")
    assert f"| {vals[0]:.4g} | {(vals[0] + vals[1]) / 2:.4g} | {vals[1]:.4g} |" in rows["sgd"]

    refused = subprocess.run([sys.executable, "-m", "experiments.common.tuning", "report", str(tune), "--selection",
                              str(out / "selection.json"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode != 0 and "seeds [0] were tuning seeds" in refused.stderr


def test_report_counts_each_fresh_seed_once_when_dopr_chose_the_gps_rate():
    from omegaconf import OmegaConf

    def fresh(name, optim, seed, lr, value):
        cfg = OmegaConf.create({"optim": {"name": optim, "lr": lr, "weight_decay": 0.0}})
        return {"summary": {"optim": optim, "seed": seed, "val": value, "overrides": [f"+tuned/p={name}"]},
                "config": cfg}

    sel = tuning.select(_grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
                        + _grid("dopr_sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay"), "val")
    assert tuning.chosen_settings(sel)["dopr_sgd_at_gp_lr"]["optim.lr"] == "1e-3"  # the same rate as its winner
    recs = [fresh("sgd", "sgd", s, 1e-3, v) for s, v in ((5, 1.0), (6, 3.0))]
    recs += [fresh(n, "dopr_sgd", s, 1e-3, v) for n in ("dopr_sgd", "dopr_sgd_at_gp_lr") for s, v in ((5, 0.5), (6, 0.7))]
    rows = {r["arm"]: r for r in tuning.report(recs, sel, ["val"])}
    assert rows["dopr_sgd"]["seeds"] == rows["dopr_sgd_at_gp_lr"]["seeds"] == "5 6"
    assert rows["sgd"]["val_median"] == 2.0 and math.isclose(rows["dopr_sgd"]["val_mean"], 0.6)
    assert math.isclose(rows["sgd"]["val_se"], math.sqrt(2.0) / math.sqrt(2))  # std (ddof 1) of {1, 3} / sqrt 2
    with pytest.raises(ValueError, match=r"seeds \[0\] were tuning seeds"):
        tuning.report(recs + [fresh("sgd", "sgd", 0, 1e-3, 1.0)], sel, ["val"])


def test_report_counts_a_diverged_fresh_seed_as_the_worst_and_says_how_many():
    """A fresh seed that diverged (summary diverged_at, no final metric) is the worst value of the
    selection metric (+inf when lower is better, -inf when higher is), not a crash; the row counts it."""
    from omegaconf import OmegaConf

    def fresh(seed, value, **extra):
        cfg = OmegaConf.create({"optim": {"name": "sgd", "lr": 1e-3, "weight_decay": 0.0}})
        return {"summary": {"optim": "sgd", "seed": seed, "val": value, "overrides": ["+tuned/p=sgd"], **extra},
                "config": cfg}

    grid = (_grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
            + _grid("dopr_sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay"))
    recs = [fresh(5, 1.0), fresh(6, 3.0), fresh(7, None, diverged_at=12)]
    row = {r["arm"]: r for r in tuning.report(recs, tuning.select(grid, "val", "min"), ["val"])}["sgd"]
    assert row["diverged"] == 1 and row["val_median"] == 3.0 and row["val_min"] == 1.0
    assert row["val_max"] == math.inf
    assert math.isnan(row["val_se"])   # no standard error with an infinite value
    grid = (_grid("sgd", {("1e-3", "0"): [2.0], ("1e-2", "0"): [1.0]}, "optim.weight_decay")
            + _grid("dopr_sgd", {("1e-3", "0"): [2.0], ("1e-2", "0"): [1.0]}, "optim.weight_decay"))
    high = {r["arm"]: r for r in tuning.report(recs, tuning.select(grid, "val", "max"), ["val"])}["sgd"]
    assert high["val_min"] == -math.inf and high["val_median"] == 1.0 and high["val_max"] == 3.0
