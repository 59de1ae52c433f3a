"""The tuning protocol (experiments/common/tuning.py): equal budgets, selection on tuning seeds,
winners re-run on fresh seeds through generated tuned configs, reports on fresh seeds only."""
import json
import math
import subprocess
import sys
from pathlib import Path

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
    sel = tuning.select(recs, "val", "min", accept_edge="two values per axis in this test")
    gp, dopr = sel["arms"]["adamw"], sel["arms"]["dopr_adamw"]
    # (3 + 1)/2 = 2.0 beats 2.2 and 2.45; the NaN seed makes (1e-3, 0.1) the worst despite its 0.1
    assert gp["winner"] == {"optim.lr": "1e-3", "optim.weight_decay": "0.0"} and gp["value"] == 2.0
    assert gp["trials"][-1]["setting"] == {"optim.lr": "1e-3", "optim.weight_decay": "0.1"}
    assert dopr["winner"] == {"optim.lr": "1e-2", "ap.damping": "1e-3"} and math.isclose(dopr["value"], 0.55)
    assert gp["grid"] == {"optim.lr": ["1e-3", "1e-2"], "optim.weight_decay": ["0.0", "0.1"]}
    assert sel["seeds"] == [0, 1] and sel["pairs"] == [("adamw", "dopr_adamw")]
    assert [e["axis"] for e in gp["at_grid_edge"]] == ["optim.lr", "optim.weight_decay"]  # two values: both edges
    assert gp["base"] == {"+tuned/t": "adamw"}  # launcher and seed are not settings
    chosen = tuning.chosen_settings(sel)
    # DoPr at the GP's whole setting: its rate and its weight decay, DoPr's own damping
    assert chosen["dopr_adamw_at_gp_setting"] == {"+tuned/t": "dopr_adamw", "ap.damping": "1e-3", "optim.lr": "1e-3",
                                                  "optim.weight_decay": "0.0"}
    assert tuning.select(recs, "val", "max", accept_edge="test")["arms"]["adamw"]["winner"]["optim.lr"] == "1e-2"


def test_select_refuses_unequal_budgets_and_unfinished_settings():
    gp = _grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0], ("1e-1", "0"): [3.0]}, "optim.weight_decay")
    dopr = _grid("dopr_sgd", {("1e-3", "1e-4"): [1.0], ("1e-2", "1e-4"): [2.0]}, "ap.damping")
    with pytest.raises(ValueError, match="unequal tuning budgets: sgd had 3 settings, dopr_sgd 2"):
        tuning.select(gp + dopr, "val")
    assert len(tuning.select(gp + dopr, "val", allow_unequal=True, accept_edge="test")["arms"]["sgd"]["trials"]) == 3
    two_seeds = _grid("sgd", {("1e-3", "0"): [1.0, 1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
    with pytest.raises(ValueError, match=r"ran seeds \[0\], the others \[0, 1\]"):
        tuning.select(two_seeds + _grid("dopr_sgd", {("1e-3", "1e-4"): [1.0, 1.0], ("1e-2", "1e-4"): [1, 1]},
                                        "ap.damping"), "val")
    edge = tuning.select(gp + dopr, "val", allow_unequal=True, accept_edge="test")["arms"]["sgd"]
    assert edge["winner"] == {"optim.lr": "1e-3"} and edge["at_grid_edge"] == [  # smallest of 3 rates
        {"axis": "optim.lr", "value": "1e-3", "side": "smallest", "grid": ["1e-3", "1e-2", "1e-1"]}]
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
                   "--configs", str(conf / "tuned" / "fl"), "--seeds", "1,2", "--accept-edge", "two rates in a test")
    sel = json.loads((out / "selection.json").read_text())
    assert sel["metric"] == "val_loss" and sel["seeds"] == [0]  # the task's tuning.metric
    assert sel["fresh_seeds"] == [1, 2] and sel["accept_edge"]["reason"] == "two rates in a test"
    summaries = {(json.loads(p.read_text())["optim"], json.loads(p.read_text())["lr"]): json.loads(p.read_text())
                 for p in tune.rglob("summary.json")}
    for arm in ("sgd", "dopr_sgd"):
        best_lr = min((lr for o, lr in summaries if o == arm), key=lambda lr: summaries[(arm, lr)]["val_loss"])
        assert float(sel["arms"][arm]["winner"]["optim.lr"]) == best_lr, sel_run.stdout
    gp_lr, dopr_lr = (float(sel["arms"][a]["winner"]["optim.lr"]) for a in ("sgd", "dopr_sgd"))
    # DoPr at the GP's rate is a config of its own only where that rate is not DoPr's winner already
    assert {p.name for p in (conf / "tuned" / "fl").iterdir()} == {"sgd.yaml", "dopr_sgd.yaml"} | (
        {"dopr_sgd_at_gp_setting.yaml"} if gp_lr != dopr_lr else set())
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
    assert set(rows) == {"sgd", "dopr_sgd", "dopr_sgd_at_gp_setting"} and all("| 1 2 |" in r for r in rows.values())
    assert "Verdict, dopr_sgd vs sgd by val_loss (lower is better), seeds 1 2:" in md
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
                        + _grid("dopr_sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay"), "val",
                        accept_edge="test")
    assert tuning.chosen_settings(sel)["dopr_sgd_at_gp_setting"]["optim.lr"] == "1e-3"  # the same rate as its winner
    recs = [fresh("sgd", "sgd", s, 1e-3, v) for s, v in ((5, 1.0), (6, 3.0))]
    recs += [fresh(n, "dopr_sgd", s, 1e-3, v) for n in ("dopr_sgd", "dopr_sgd_at_gp_setting")
             for s, v in ((5, 0.5), (6, 0.7))]
    rows = {r["arm"]: r for r in tuning.report(recs, sel, ["val"])}
    assert rows["dopr_sgd"]["seeds"] == rows["dopr_sgd_at_gp_setting"]["seeds"] == "5 6"
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
    row = {r["arm"]: r for r in tuning.report(recs, tuning.select(grid, "val", "min", accept_edge="test"), ["val"])}["sgd"]
    assert row["diverged"] == 1 and row["val_median"] == 3.0 and row["val_min"] == 1.0
    assert row["val_max"] == math.inf
    assert math.isnan(row["val_se"])   # no standard error with an infinite value
    grid = (_grid("sgd", {("1e-3", "0"): [2.0], ("1e-2", "0"): [1.0]}, "optim.weight_decay")
            + _grid("dopr_sgd", {("1e-3", "0"): [2.0], ("1e-2", "0"): [1.0]}, "optim.weight_decay"))
    high = {r["arm"]: r for r in tuning.report(recs, tuning.select(grid, "val", "max", accept_edge="test"), ["val"])}["sgd"]
    assert high["val_min"] == -math.inf and high["val_median"] == 1.0 and high["val_max"] == 3.0


# ------------------------------------------------------------------ the protocol's gaps (issue 7)
def _job(arm, seed, value, lr, knob=None, **cfg):
    """A tuning job with its resolved config: optim {lr, weight_decay, betas} and ap {damping, EMAs}."""
    from omegaconf import OmegaConf

    over = {"optim.lr": lr, **({knob[0]: knob[1]} if knob else {})}
    rec = _rec(arm, seed, value, **over)
    optim_cfg = {"name": arm, "lr": float(lr), "weight_decay": 0.01, "betas": [0.9, 0.999], **cfg.get("optim", {})}
    ap = {"damping": 1e-4, "damping_mode": "trace", "grad_ema": 0.0, "precond_ema": 0.0, **cfg.get("ap", {})}
    if knob:
        section, key = knob[0].split(".")
        ({"optim": optim_cfg, "ap": ap})[section][key] = parse_value(knob[1])
    rec["config"] = OmegaConf.create({"seed": seed, "sweep_name": f"tune_{arm}", "optim": optim_cfg, "ap": ap,
                                      "task": {"name": "toy", "schedule": cfg.get("schedule", "constant")}})
    return rec


def parse_value(text):
    return tuning.parse_value(text)


def _sft_like():
    """The SFT analogue's shape: AdamW over lr x weight decay {0.01, 0.1}, its tuned file's betas (0.9, 0.98);
    DoPr-AdamW over lr x damping {1e-4, 1e-3} at its own default weight decay 0.01 and betas (0.9, 0.999)."""
    gp = [_job("adamw", 0, v, lr, ("optim.weight_decay", wd), optim={"betas": [0.9, 0.98]}, schedule="cosine")
          for (lr, wd), v in {("1e-3", "0.01"): 3.0, ("3e-3", "0.01"): 2.0, ("1e-2", "0.01"): 4.0,
                              ("1e-3", "0.1"): 2.5, ("3e-3", "0.1"): 1.0, ("1e-2", "0.1"): 5.0}.items()]
    dopr = [_job("dopr_adamw", 0, v, lr, ("ap.damping", d))
            for (lr, d), v in {("1e-3", "1e-4"): 3.0, ("3e-3", "1e-4"): 2.0, ("1e-2", "1e-4"): 1.5,
                               ("1e-3", "1e-3"): 3.5, ("3e-3", "1e-3"): 2.5, ("1e-2", "1e-3"): 4.5}.items()]
    return gp + dopr


def test_a_winner_at_the_edge_of_any_numeric_axis_is_refused_naming_arm_axis_value_and_grid():
    # AdamW chose weight decay 0.1, the largest of two; DoPr chose damping 1e-4, the smallest of two. The
    # middle rate 3e-3 is no edge; DoPr's 1e-2 is the largest rate.
    with pytest.raises(ValueError) as refused:
        tuning.select(_sft_like(), "val", fresh_seeds=[3, 4, 5])
    msg = str(refused.value)
    assert "adamw optim.weight_decay=0.1 (the largest of {0.01, 0.1})" in msg
    assert "dopr_adamw ap.damping=1e-4 (the smallest of {1e-4, 1e-3})" in msg
    assert "dopr_adamw optim.lr=1e-2 (the largest of {1e-3, 3e-3, 1e-2})" in msg
    assert ": adamw optim.lr" not in msg and "; adamw optim.lr" not in msg and "--accept-edge" in msg
    with pytest.raises(ValueError, match="--accept-edge needs the reason"):
        tuning.select(_sft_like(), "val", accept_edge="  ")


def test_an_unordered_axis_has_no_edge_and_is_listed_as_such():
    edges, unordered = tuning.grid_edges({"ap.solver": ["cholesky", "eigh"], "optim.lr": ["1e-3", "1e-2", "1e-1"],
                                          "ap.homogeneous": ["false", "true"]},
                                         {"ap.solver": "eigh", "optim.lr": "1e-2", "ap.homogeneous": "true"})
    assert edges == [] and unordered == ["ap.solver", "ap.homogeneous"]


def test_accept_edge_writes_the_presets_and_records_the_reason_and_the_edges(tmp_path):
    sel = tuning.select(_sft_like(), "val", accept_edge="grid fixed by the paper's two values", fresh_seeds=[3, 4, 5])
    assert sel["accept_edge"]["reason"] == "grid fixed by the paper's two values"
    assert {(e["arm"], e["axis"], e["value"]) for e in sel["accept_edge"]["edges"]} == {
        ("adamw", "optim.weight_decay", "0.1"), ("dopr_adamw", "ap.damping", "1e-4"), ("dopr_adamw", "optim.lr", "1e-2")}
    conf = tmp_path / "conf" / "tuned" / "toy_protocol"
    tuning.write_selection(sel, tmp_path / "out", "stamp", conf, "cmd")
    saved = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert saved["accept_edge"] == json.loads(json.dumps(sel["accept_edge"]))
    md = (tmp_path / "out" / "selection.md").read_text()
    assert ("accepted with --accept-edge: adamw optim.weight_decay=0.1 (the largest of {0.01, 0.1}); "
            "dopr_adamw ap.damping=1e-4 (the smallest of {1e-4, 1e-3})") in md
    assert "Reason: grid fixed by the paper's two values" in md
    assert "| yes (at the grid's edge: optim.weight_decay largest) |" in md
    assert "(--accept-edge): grid fixed by the paper's two values" in (conf / "adamw.yaml").read_text()


def test_select_refuses_a_hand_written_group_naming_both_files(tmp_path):
    """Issue 75 item 7: the tool writes conf/tuned/<group>; a group that conf_handwritten/tuned/ has (the hand-
    written presets) is refused, naming both files, before anything is written."""
    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    tuning.write_selection(sel, tmp_path / "out", "stamp", tmp_path / "conf" / "tuned" / "toy_protocol", "cmd")
    assert sorted(p.name for p in (tmp_path / "conf" / "tuned" / "toy_protocol").iterdir()) == \
        ["adamw.yaml", "dopr_adamw.yaml", "dopr_adamw_at_gp_setting.yaml"]
    from experiments.common.presets import MARK   # the note test_conf_handwritten.py looks for

    assert MARK in (tmp_path / "conf" / "tuned" / "toy_protocol" / "adamw.yaml").read_text()
    with pytest.raises(ValueError) as refused:   # conf_handwritten/tuned/sft/adamw.yaml: the paper's SFT settings
        tuning.write_selection(sel, tmp_path / "out2", "stamp", tmp_path / "conf" / "tuned" / "sft", "cmd")
    assert (f"{tmp_path}/conf/tuned/sft/adamw.yaml would share the config group tuned/sft with the "
            "hand-written conf_handwritten/tuned/sft/adamw.yaml") in str(refused.value)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "conf" / "tuned" / "sft").exists()


def test_dopr_at_the_gps_setting_copies_the_gps_whole_winning_setting_and_keeps_dopr_knobs(tmp_path):
    import yaml

    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    at, copied = tuning.gp_setting_for_dopr(sel, "adamw", "dopr_adamw")
    # the rate and weight decay it swept, the betas its tuned file set, the task's schedule; DoPr's damping
    assert copied == {"optim.lr": "3e-3", "optim.weight_decay": "0.1", "optim.betas": "[0.9, 0.98]",
                      "task.schedule": "cosine"}
    assert at["ap.damping"] == "1e-4" and at["+tuned/t"] == "dopr_adamw"
    conf = tmp_path / "tuned" / "toy_protocol"
    (conf).mkdir(parents=True)
    (conf / "dopr_adamw_at_gp_lr.yaml").write_text("# chosen by the tuning protocol\n")  # an old selection's file
    tuning.write_selection(sel, tmp_path / "out", "stamp", conf, "cmd")
    assert sorted(p.name for p in conf.iterdir()) == ["adamw.yaml", "dopr_adamw.yaml", "dopr_adamw_at_gp_setting.yaml"]
    body = yaml.safe_load((conf / "dopr_adamw_at_gp_setting.yaml").read_text())
    assert body == {"defaults": [{"/tuned/t@_global_": "dopr_adamw"}], "ap": {"damping": 0.0001},
                    "optim": {"lr": 0.003, "weight_decay": 0.1, "betas": [0.9, 0.98]}, "task": {"schedule": "cosine"}}
    assert "dopr_adamw_at_gp_setting: DoPr at adamw's whole winning setting, copying optim.lr=3e-3, " \
           "optim.weight_decay=0.1" in (tmp_path / "out" / "selection.md").read_text()


def test_the_old_at_gp_lr_preset_name_is_refused_with_the_new_one():
    from experiments.common.checks import ConfigError, refuse_renamed_at_gp_preset

    with pytest.raises(ConfigError, match=r"tuned/sft_arith_protocol=dopr_adamw_at_gp_lr is gone: it ran DoPr at the "
                                          r"GP's learning rate.*dopr_adamw_at_gp_setting runs DoPr at the GP's whole"):
        refuse_renamed_at_gp_preset(["-m", "+tuned/sft_arith_protocol=adamw,dopr_adamw_at_gp_lr", "seed=3"])
    refuse_renamed_at_gp_preset(["-m", "+tuned/sft_arith_protocol=dopr_adamw_at_gp_setting"])  # the new name runs


def test_select_fixes_the_fresh_seeds_from_the_protocol_sweep_or_seeds(tmp_path):
    (tmp_path / "conf" / "sweep").mkdir(parents=True)
    (tmp_path / "conf" / "sweep" / "toy_protocol.yaml").write_text(
        "hydra:\n  sweeper:\n    params:\n      +tuned/toy_protocol: glob(*)\n      seed: range(1,11)\n")
    seeds, source = tuning.fresh_seeds_of(tmp_path / "conf" / "tuned" / "toy_protocol")
    assert seeds == list(range(1, 11)) and source.endswith("toy_protocol.yaml")
    assert tuning.fresh_seeds_of(tmp_path / "conf" / "tuned" / "other") == (None, None)
    assert tuning.seed_list("3,4,5") == [3, 4, 5] and tuning.seed_list("7") == [7]
    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[5, 3, 4])
    assert sel["fresh_seeds"] == [3, 4, 5]
    with pytest.raises(ValueError, match=r"fresh seeds \[0\] are tuning seeds \[0\]"):
        tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[0, 1])


def _fresh(name, optim, seed, value, **optim_cfg):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"optim": {"name": optim, "lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.98],
                                      **optim_cfg}, "ap": {"damping": 1e-4}, "task": {"schedule": "cosine"}})
    return {"summary": {"optim": optim, "seed": seed, "val": value, "overrides": [f"+tuned/p={name}"]}, "config": cfg}


def test_report_keeps_to_the_fixed_seeds_and_tables_the_extra_ones_apart():
    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    recs = [_fresh("adamw", "adamw", s, v) for s, v in ((3, 1.0), (4, 1.2), (5, 1.1), (6, 9.0), (7, 9.0))]
    recs += [_fresh("dopr_adamw", "dopr_adamw", s, v, lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999])
             for s, v in ((3, 2.0), (4, 2.1), (5, 2.2), (6, 0.1), (7, 0.1))]
    recs += [_fresh("dopr_adamw_at_gp_setting", "dopr_adamw", s, 3.0) for s in (3, 4, 5)]
    fixed, every, extra = tuning.protocol_tables(recs, sel, ["val"])
    assert extra == [6, 7]
    fixed, every = ({r["arm"]: r for r in rows} for rows in (fixed, every))
    assert fixed["adamw"]["seeds"] == "3 4 5" and fixed["adamw"]["val_median"] == 1.1
    assert every["adamw"]["seeds"] == "3 4 5 6 7" and every["adamw"]["val_median"] == 1.2
    assert fixed["dopr_adamw_at_gp_setting"]["seeds"] == "3 4 5"  # the runs at weight decay 0.1, betas (0.9, 0.98)
    verdict = tuning.verdicts(list(fixed.values()), sel)
    assert verdict == ["Verdict, dopr_adamw vs adamw by val (lower is better), seeds 3 4 5: DoPr worse, no seed "
                       "overlap: median 2.1 vs 1.1; DoPr at adamw's setting 3. DoPr's damping mode trace, statistics EMA "
                       "0.0 (none) and gradient EMA 0.0 (none) held fixed, not tuned (damping tuned)."]
    assert tuning.protocol_tables(recs[:3] + recs[5:8] + recs[10:], sel, ["val"])[1] is None  # no extra seed


def test_versus_judges_any_two_arms_by_the_spread_rule_and_refuses_an_unknown_arm():
    """Issue 64: DoPr-AdamW against SOAP is not a GP / DoPr pair; --versus gives it the same verdict rule."""
    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    rows = [{"arm": "adamw", "seeds": "3 4 5", "val_min": 1.0, "val_median": 1.1, "val_max": 1.2},
            {"arm": "dopr_adamw", "seeds": "3 4 5", "val_min": 1.15, "val_median": 1.3, "val_max": 1.4}]
    assert tuning.versus(rows, sel, [("dopr_adamw", "adamw")]) == [
        "Verdict, adamw vs dopr_adamw by val (lower is better), seeds 3 4 5: inconclusive, the seeds overlap "
        "(adamw ahead on the median): median 1.1 vs 1.3."]
    rows[1].update(val_min=1.25)
    assert "adamw better, no seed overlap" in tuning.versus(rows, sel, [("dopr_adamw", "adamw")])[0]
    assert "dopr_adamw worse, no seed overlap" in tuning.versus(rows, sel, [("adamw", "dopr_adamw")])[0]
    with pytest.raises(ValueError, match="no arm soap in the selection"):
        tuning.versus(rows, sel, [("soap", "dopr_adamw")])


def test_a_missing_fixed_seed_flags_the_row_and_withholds_the_verdict():
    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    recs = [_fresh("adamw", "adamw", s, 1.0) for s in (3, 4, 5)]
    recs += [_fresh("dopr_adamw", "dopr_adamw", s, 2.0, lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999]) for s in (3, 5)]
    rows, every, _ = tuning.protocol_tables(recs, sel, ["val"])
    rows = {r["arm"]: r for r in rows}
    assert rows["dopr_adamw"]["missing"] == "4" and rows["dopr_adamw_at_gp_setting"]["missing"] == "3 4 5"
    assert "missing" not in rows["adamw"] and every is None
    assert tuning.verdicts(list(rows.values()), sel)[0].startswith(
        "Verdict, dopr_adamw vs adamw by val (lower is better): no verdict, the table is partial (dopr_adamw lacks "
        "seeds 4; dopr_adamw_at_gp_setting lacks seeds 3 4 5)")
    old = {k: v for k, v in sel.items() if k != "fresh_seeds"}
    with pytest.raises(ValueError, match="the selection fixes no fresh seeds"):
        tuning.protocol_tables(recs, old, ["val"])


def test_a_span_arm_is_named_by_its_solver_and_cap_not_by_a_damping_it_does_not_read():
    """solver=span ignores the damping (issue 48): its verdict said "damping 0.0001 (trace) held fixed"."""
    gp = [_job("adamw", 0, v, lr) for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    dopr = [_job("dopr_adamw", 0, v, lr, ap={"solver": "span", "span_cap": 3.0})
            for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    arm = tuning.select(gp + dopr, "val", fresh_seeds=[3, 4, 5])["arms"]["dopr_adamw"]
    assert arm["dopr_knobs_fixed"]["ap.solver"] == "span" and arm["dopr_knobs_fixed"]["ap.span_cap"] == 3.0
    assert tuning.describe_knobs(arm) == ("DoPr's solver span (no damping), span cap 3.0, statistics EMA 0.0 (none) "
                                          "and gradient EMA 0.0 (none) held fixed, not tuned")
    chol = [_job("dopr_adamw", 0, v, lr, ap={"solver": "eigh", "span_cap": 100.0})
            for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    arm = tuning.select(gp + chol, "val", fresh_seeds=[3, 4, 5])["arms"]["dopr_adamw"]
    assert tuning.describe_knobs(arm).startswith("DoPr's solver eigh, damping 0.0001 (trace), statistics EMA")


def test_the_dopr_knobs_the_grid_held_fixed_are_recorded_and_named_in_the_verdict():
    gp = [_job("adamw", 0, v, lr) for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    dopr = [_job("dopr_adamw", 0, v, lr, ap={"damping": 1e-3}) for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    sel = tuning.select(gp + dopr, "val", fresh_seeds=[3, 4, 5])  # middle rates: no edge, nothing to accept
    assert sel["accept_edge"] is None
    arm = sel["arms"]["dopr_adamw"]
    assert arm["dopr_knobs_fixed"] == {"ap.damping": 1e-3, "ap.damping_mode": "trace", "ap.precond_ema": 0.0,
                                       "ap.grad_ema": 0.0} and arm["dopr_knobs_tuned"] == []
    assert tuning.describe_knobs(arm) == ("DoPr's damping 0.001 (trace), statistics EMA 0.0 (none) and gradient EMA "
                                          "0.0 (none) held fixed, not tuned")
    recs = [_fresh(a, a, s, v, lr=3e-3, weight_decay=0.01, betas=[0.9, 0.999]) for a, v in (("adamw", 1.0),
                                                                                      ("dopr_adamw", 1.5)) for s in (3, 4, 5)]
    line = tuning.verdicts(tuning.protocol_tables(recs, sel, ["val"])[0], sel)[0]
    assert line.endswith("DoPr's damping 0.001 (trace), statistics EMA 0.0 (none) and gradient EMA 0.0 (none) held "
                         "fixed, not tuned.")


def test_a_later_dopr_rule_is_selected_against_the_gp_arm_of_an_earlier_selection(tmp_path):
    # The earlier selection tuned AdamW (6 settings) beside a damped DoPr; a damping-free DoPr rule is tuned
    # later over the GP's own axes (lr x weight decay), 6 settings on the same seed, and takes AdamW from it.
    earlier = tuning.select(_sft_like(), "val", accept_edge="two-value axes", fresh_seeds=[3, 4, 5])
    tuning.write_selection(earlier, tmp_path / "earlier", "stamp")
    path = tmp_path / "earlier" / "selection.json"
    saved = json.loads(path.read_text())
    rule = [_job("dopr_adamw", 0, v, lr, ("optim.weight_decay", wd), ap={"damping": 1e-6, "weak_share_bound": 0.5})
            for (lr, wd), v in {("1e-3", "0.01"): 3.0, ("3e-3", "0.01"): 0.5, ("1e-2", "0.01"): 4.0,
                                ("1e-3", "0.1"): 2.5, ("3e-3", "0.1"): 0.7, ("1e-2", "0.1"): 5.0}.items()]
    with pytest.raises(ValueError, match="no GP with its DoPr variant"):
        tuning.select(rule, "val", accept_edge="two-value axes")
    sel = tuning.select(rule, "val", accept_edge="two-value axes", fresh_seeds=[3, 4, 5], gp_from=(str(path), saved))
    assert sel["pairs"] == [("adamw", "dopr_adamw")]
    gp = sel["arms"]["adamw"]
    assert gp["winner"] == {"optim.lr": "3e-3", "optim.weight_decay": "0.1"} and gp["value"] == 1.0
    assert gp["from_selection"] == str(path) and len(gp["trials"]) == 6
    assert sel["arms"]["dopr_adamw"]["winner"] == {"optim.lr": "3e-3", "optim.weight_decay": "0.01"}
    tuning.write_selection(sel, tmp_path / "out", "stamp", tmp_path / "conf", "cmd")
    assert f"adamw: its tuning trials and winner taken from {path} (not re-run here)." in (
        tmp_path / "out" / "selection.md").read_text()
    assert "weak_share_bound" not in (tmp_path / "conf" / "adamw.yaml").read_text()
    assert tuning.describe_knobs(sel["arms"]["dopr_adamw"]).startswith(
        "DoPr's damping set by the health report (weak share <= 0.5, every (value not recorded) steps, floor 1e-06 "
        "(trace)), statistics EMA 0.0 (none) and gradient EMA 0.0 (none) held fixed")
    assert "weak-share" not in tuning.describe_knobs(earlier["arms"]["dopr_adamw"])   # a damped arm: no such knob
    filtered = {"dopr_knobs_fixed": [["ap.damping", 1e-06], ["ap.damping_mode", "trace"], ["ap.weak_share_bound", 0.25],
                                     ["ap.health_every", 0], ["ap.weak_share_estimate", "filter"]]}
    assert tuning.describe_knobs(filtered).startswith(
        "DoPr's damping set by the weak share's Cholesky filter (weak share <= 0.25, every refresh, floor 1e-06 (trace))")
    # refused: the GP tuned on other seeds, by another measure, or given twice
    other_seed = [_job("dopr_adamw", 1, 1.0, lr, ("optim.weight_decay", wd)) for lr in ("1e-3", "3e-3")
                  for wd in ("0.01", "0.1")]
    with pytest.raises(ValueError, match=r"adamw in .* was tuned on seeds \[0\], dopr_adamw here on \[1\]"):
        tuning.select(other_seed, "val", accept_edge="x", gp_from=(str(path), saved))
    with pytest.raises(ValueError, match="selected by 'val' \\(min\\), this selection by 'val' \\(max\\)"):
        tuning.select(rule, "val", "max", accept_edge="x", gp_from=(str(path), saved))
    with pytest.raises(ValueError, match="adamw is both in the tuning sweeps and taken from"):
        tuning.select(_sft_like(), "val", accept_edge="x", gp_from=(str(path), saved))


# ------------------------------------------------------------------ arms as records (issue 66 item 3)
def test_an_arm_is_a_record_of_gp_ap_and_variant_read_back_from_its_names():
    from experiments.common.arms import Arm

    assert Arm.read("adamw") == Arm("adamw", False) and Arm.read("dopr_adamw") == Arm("adamw", True)
    assert Arm.read("dopr_muon_at_gp_setting") == Arm("muon", True, "at_gp_setting")
    for name in ("adamw", "dopr_adamw", "dopr_muon_at_gp_setting"):   # the committed selections' names round trip
        assert Arm.read(name).name == name
    assert Arm("muon", True, "at_gp_setting").optim == "dopr_muon" == tuning.arm_of("dopr_muon_at_gp_setting")
    assert Arm("muon", True).but(ap=False).name == "muon"


def test_report_finds_the_fresh_runs_of_configs_that_carry_no_name():
    """A run's optim config says gp and ap (no name): the report matches it to its arm by the derived name."""
    from omegaconf import OmegaConf

    def fresh(name, ap, seed, value):
        cfg = OmegaConf.create({"optim": {"gp": "sgd", "ap": ap, "lr": 1e-3, "weight_decay": 0.0}})
        optim = "dopr_sgd" if ap else "sgd"
        return {"summary": {"optim": optim, "seed": seed, "val": value, "overrides": [f"+tuned/p={name}", f"optim={optim}"]},
                "config": cfg}

    grid = (_grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
            + _grid("dopr_sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay"))
    for r in grid:
        r["summary"]["overrides"].append(f"optim={r['summary']['optim']}")
    sel = tuning.select(grid, "val", accept_edge="test")
    recs = [fresh(n, ap, s, v) for n, ap in (("sgd", False), ("dopr_sgd", True)) for s, v in ((5, 1.0), (6, 3.0))]
    rows = {r["arm"]: r for r in tuning.report(recs, sel, ["val"])}
    assert rows["sgd"]["seeds"] == rows["dopr_sgd"]["seeds"] == "5 6" and rows["dopr_sgd"]["val_median"] == 2.0


def test_the_knobs_are_the_library_options_and_a_sample_count_run_is_named_by_its_rule():
    # issue 74: the tool kept its own list of DoPr's knobs, without the damping rule, and named the winners of a
    # sample-count tuning "DoPr's damping 0.0 (trace)"; the knobs are now DoPrOptions' fields
    from dopr.options import DoPrOptions

    assert tuning.DOPR_KNOBS == tuple(f"ap.{n}" for n in DoPrOptions.names()) and "ap.damping_rule" in tuning.DOPR_KNOBS
    gp = [_job("adamw", 0, v, lr) for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    rule = [_job("dopr_adamw", 0, v, lr, ap={"damping": 0.0, "damping_rule": "sample_count"})
            for lr, v in (("1e-3", 2.0), ("3e-3", 1.0), ("1e-2", 3.0))]
    arm = tuning.select(gp + rule, "val", fresh_seeds=[3, 4, 5])["arms"]["dopr_adamw"]
    assert arm["dopr_knobs_fixed"]["ap.damping_rule"] == "sample_count"
    assert tuning.describe_knobs(arm) == ("DoPr's damping rule sample_count (floor 0.0 (trace)), statistics EMA 0.0 "
                                          "(none) and gradient EMA 0.0 (none) held fixed, not tuned")
    # a selection recorded before the rule was a knob: read again from the winner's resolved config
    old = {**arm, "dopr_knobs_fixed": {k: v for k, v in arm["dopr_knobs_fixed"].items() if k != "ap.damping_rule"}}
    assert tuning.describe_knobs(old).startswith("DoPr's damping rule sample_count (floor 0.0 (trace))")


def test_the_committed_selections_name_each_winners_damping_rule():
    # the 14 lines under results/damping_free/sample_count/ that called sample-count runs "damping 0.0 (trace)",
    # rewritten by experiments/common/relabel_knobs.py from each selection.json
    root = Path(__file__).resolve().parents[2] / "results"
    named = 0
    for path in sorted(root.rglob("selection.json")):
        sel = json.loads(path.read_text())
        text = (path.parent / "selection.md").read_text() + (path.parent / "protocol.md").read_text()
        for _, dopr in sel["pairs"]:
            rule = (sel["arms"][dopr].get("resolved") or {}).get("ap.damping_rule", "trace")
            if rule != "trace":
                lines = [l for l in text.splitlines() if l.startswith((f"{dopr}: DoPr's", f"Verdict, {dopr} vs"))
                         and "DoPr's" in l]
                assert lines and all(f"damping rule {rule} (floor" in l for l in lines), (path, lines)
                named += len(lines)
    assert named == 14


def test_relabel_rewrites_a_mislabelled_selection_from_its_json(tmp_path, monkeypatch):
    import shutil

    from experiments.common import relabel_knobs

    src = Path(__file__).resolve().parents[2] / "results" / "damping_free" / "sample_count" / "humanoid"
    folder = tmp_path / "results" / "humanoid"
    shutil.copytree(src, folder)
    for name in ("selection.md", "protocol.md"):
        f = folder / name
        f.write_text(f.read_text().replace("DoPr's damping rule sample_count (floor 0.0 (trace))",
                                           "DoPr's damping 0.0 (trace)"))
    monkeypatch.setattr(relabel_knobs, "ROOT", tmp_path)
    changed = relabel_knobs.relabel(folder)
    assert len(changed) == 2 and all("damping rule sample_count (floor 0.0 (trace))" in c for c in changed)
    for name in ("selection.md", "protocol.md"):
        assert (folder / name).read_text() == (src / name).read_text()
    assert relabel_knobs.relabel(folder) == []


# ------------------------------------------------------------------ per-seed runs and the refinement rule (issue 74)
def _write_run(folder: Path, name, optim, seed, val, acc, **optim_cfg):
    """A fresh run as run.py leaves it: summary.json and .hydra/config.yaml (the task's tuning metrics)."""
    from omegaconf import OmegaConf

    run = _fresh(name, optim, seed, val, **optim_cfg)
    folder.mkdir(parents=True)
    summary = {**run["summary"], "task": "toy", "acc": acc, "wall_time_s": 10.0 + seed, "git_revision": "abc123"}
    if val is None:
        summary["diverged_at"] = 40
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / ".hydra").mkdir()
    cfg = OmegaConf.merge(run["config"], {"task": {"tuning": {"metric": "val", "mode": "min", "report": ["val", "acc"]}}})
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))


def test_report_writes_each_fresh_run_and_its_rows_give_back_the_aggregates(tmp_path):
    """protocol_runs.csv: one row a fresh run (arm, setting, seed, fixed, every reported metric, wall time,
    revision), sorted by arm and seed; its fixed rows are the runs protocol.csv aggregates, all of them those of
    protocol_all_seeds.csv: min / median / max recomputed from it are the tables' (to their 7 digits)."""
    import csv
    import statistics

    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    tuning.write_selection(sel, tmp_path / "sel", "stamp")
    fresh = tmp_path / "fresh"
    dopr = dict(lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999])
    for seed, val in ((5, 1.1), (3, 1.0), (4, 1.2345678912), (6, 9.0)):   # seed 6: beyond the fixed list
        _write_run(fresh / f"adamw_{seed}", "adamw", "adamw", seed, val, 0.5 + seed / 100)
    for seed, val in ((3, 2.0), (4, None), (5, 2.2), (6, 0.1)):           # seed 4 diverged: the worst
        _write_run(fresh / f"dopr_{seed}", "dopr_adamw", "dopr_adamw", seed, val, 0.4, **dopr)
    for seed in (3, 4, 5):
        _write_run(fresh / f"at_gp_{seed}", "dopr_adamw_at_gp_setting", "dopr_adamw", seed, 3.0 + seed / 7, 0.3)
    out = tmp_path / "out"
    tuning.main(["report", str(fresh), "--selection", str(tmp_path / "sel" / "selection.json"), "--out", str(out)])
    read = lambda name: list(csv.DictReader(open(out / name)))
    runs, fixed, every = read("protocol_runs.csv"), read("protocol.csv"), read("protocol_all_seeds.csv")
    assert list(runs[0]) == ["arm", "setting", "seed", "fixed", "val", "acc", "diverged_at", "wall_time_s",
                             "git_revision"]
    assert [(r["arm"], int(r["seed"]), r["fixed"]) for r in runs] == [
        ("adamw", 3, "true"), ("adamw", 4, "true"), ("adamw", 5, "true"), ("adamw", 6, "false"),
        ("dopr_adamw", 3, "true"), ("dopr_adamw", 4, "true"), ("dopr_adamw", 5, "true"), ("dopr_adamw", 6, "false"),
        ("dopr_adamw_at_gp_setting", 3, "true"), ("dopr_adamw_at_gp_setting", 4, "true"),
        ("dopr_adamw_at_gp_setting", 5, "true")]
    diverged = next(r for r in runs if r["arm"] == "dopr_adamw" and r["seed"] == "4")
    assert diverged["val"] == "inf" and diverged["diverged_at"] == "40"
    assert runs[0]["wall_time_s"] == "13.0" and runs[0]["git_revision"] == "abc123"
    for table, rows in ((fixed, [r for r in runs if r["fixed"] == "true"]), (every, runs)):
        assert [t["arm"] for t in table] == ["adamw", "dopr_adamw", "dopr_adamw_at_gp_setting"]
        for t in table:
            mine = [r for r in rows if r["arm"] == t["arm"]]
            assert {r["setting"] for r in mine} == {t["setting"]}
            assert t["seeds"] == " ".join(r["seed"] for r in mine)
            for m in ("val", "acc"):
                v = [float(r[m]) for r in mine]
                assert float(t[f"{m}_min"]) == min(v) and float(t[f"{m}_max"]) == max(v), (t["arm"], m)
                assert math.isclose(float(t[f"{m}_median"]), statistics.median(v), rel_tol=1e-6), (t["arm"], m)
    assert "protocol_runs.csv (11 runs" in (out / "protocol.md").read_text()


def test_report_counts_the_runs_an_arm_at_the_gps_setting_shares_with_dopr_once(tmp_path):
    """DoPr's winner at the GP's whole setting: the at-GP arm's rows are DoPr's runs again, and protocol.md says
    how many rows and how many runs (it said "9 runs" for sit_digits' 6)."""
    import csv

    sel = tuning.select(_grid("sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay")
                        + _grid("dopr_sgd", {("1e-3", "0"): [1.0], ("1e-2", "0"): [2.0]}, "optim.weight_decay"), "val",
                        accept_edge="test", fresh_seeds=[5, 6])
    tuning.write_selection(sel, tmp_path / "sel", "stamp")
    for optim in ("sgd", "dopr_sgd"):
        for seed in (5, 6):
            _write_run(tmp_path / "fresh" / f"{optim}_{seed}", optim, optim, seed, 1.0 + seed, 0.5, lr=1e-3,
                       weight_decay=0.0)
    tuning.main(["report", str(tmp_path / "fresh"), "--selection", str(tmp_path / "sel" / "selection.json"),
                 "--out", str(tmp_path / "out")])
    runs = list(csv.DictReader(open(tmp_path / "out" / "protocol_runs.csv")))
    assert [(r["arm"], r["seed"]) for r in runs] == [("dopr_sgd", "5"), ("dopr_sgd", "6"),
                                                     ("dopr_sgd_at_gp_setting", "5"), ("dopr_sgd_at_gp_setting", "6"),
                                                     ("sgd", "5"), ("sgd", "6")]
    assert "protocol_runs.csv (6 rows over 4 runs: DoPr at the GP's setting" in (tmp_path / "out" / "protocol.md").read_text()


def test_report_names_each_runs_base_and_refuses_runs_from_different_bases(tmp_path):
    """Fine-tunes record their base (summary.json base.weights_sha256): protocol_runs.csv gets a base column, and
    a report over runs from two bases is refused before it writes anything, naming both hashes."""
    import csv

    sel = tuning.select(_sft_like(), "val", accept_edge="test", fresh_seeds=[3, 4, 5])
    tuning.write_selection(sel, tmp_path / "sel", "stamp")
    dopr = dict(lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999])
    for seed in (3, 4, 5):
        _write_run(tmp_path / "one" / f"adamw_{seed}", "adamw", "adamw", seed, 1.0 + seed, 0.5)
        _write_run(tmp_path / "one" / f"dopr_{seed}", "dopr_adamw", "dopr_adamw", seed, 2.0 + seed, 0.4, **dopr)
    for f in (tmp_path / "one").rglob("summary.json"):
        s = json.loads(f.read_text())
        f.write_text(json.dumps({**s, "base": {"weights_sha256": "aaaa1111", "files": 1}}))
    args = ["--selection", str(tmp_path / "sel" / "selection.json")]
    tuning.main(["report", str(tmp_path / "one"), *args, "--out", str(tmp_path / "out")])
    runs = list(csv.DictReader(open(tmp_path / "out" / "protocol_runs.csv")))
    assert list(runs[0])[-1] == "base" and {r["base"] for r in runs} == {"aaaa1111"} and len(runs) == 6
    moved = tmp_path / "one" / "dopr_4" / "summary.json"
    moved.write_text(json.dumps({**json.loads(moved.read_text()), "base": {"weights_sha256": "bbbb2222"}}))
    with pytest.raises(SystemExit, match=r"refused: .*different bases.*aaaa1111: 5 runs.*bbbb2222: 1 run, e\.g\. .*dopr_4"):
        tuning.main(["report", str(tmp_path / "one"), *args, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def _arm(grid: dict, winner: dict) -> dict:
    return {"grid": grid, "winner": winner}


def test_the_refinement_rule_halves_a_coarse_gap_geometrically_once_and_leaves_fine_ones_and_edges():
    lr = ["1e-4", "1e-3", "1e-2", "3e-2", "0.1"]
    due = tuning.refinement({"a": _arm({"optim.lr": lr}, {"optim.lr": "1e-2"})})["a"]
    # 10x below, 3x above: one point, below, at the geometric midpoint
    assert [(s["neighbour"], s["gap"]) for s in due["steps"]] == [("1e-3", pytest.approx(10.0))]
    assert len(due["points"]) == 1 and math.isclose(float(due["points"][0]["optim.lr"]), math.sqrt(1e-3 * 1e-2))
    assert due["coarse_winner"] == {"optim.lr": "1e-2"}
    both = tuning.refinement({"a": _arm({"optim.lr": lr}, {"optim.lr": "1e-3"})})["a"]["points"]
    assert [float(p["optim.lr"]) for p in both] == pytest.approx([math.sqrt(1e-7), math.sqrt(1e-5)])
    # one round: the midpoints of a 10x gap are 3.16x from its ends, within 3.5x
    assert float(due["points"][0]["optim.lr"]) / 1e-3 < tuning.REFINE_ABOVE
    # a half-decade grid (steps of 3x and 3.33x) is fine
    fine = tuning.refinement({"a": _arm({"optim.lr": ["1e-3", "3e-3", "1e-2", "3e-2"]}, {"optim.lr": "3e-3"})})["a"]
    assert fine["points"] == [] and fine["note"] == "optim.lr=3e-3: nearest neighbours within 3.5x (1e-3 3x, 1e-2 3.33x)"
    # a winner at the grid's edge is the edge rule's
    edge = tuning.refinement({"a": _arm({"optim.lr": lr}, {"optim.lr": "1e-4"})})["a"]
    assert edge["points"] == [] and "at the grid's edge" in edge["note"]
    # the other winning values fixed; weight decay 0 (no geometric midpoint) skipped, on a refined axis or as a neighbour
    grid = {"optim.lr": lr, "optim.weight_decay": ["0.0", "1e-4", "1e-2"]}
    axes = ("optim.lr", "optim.weight_decay")
    zero = tuning.refinement({"a": _arm(grid, {"optim.lr": "1e-2", "optim.weight_decay": "0.0"})}, axes)["a"]
    assert zero["points"] == [{"optim.lr": due["points"][0]["optim.lr"], "optim.weight_decay": "0.0"}]
    wd = tuning.refinement({"a": _arm(grid, {"optim.lr": "3e-2", "optim.weight_decay": "1e-4"})}, axes)["a"]
    assert wd["points"] == [{"optim.lr": "3e-2", "optim.weight_decay": tuning.override_text(math.sqrt(1e-6))}]
    assert tuning.refine_steps("optim.weight_decay", ["0.0", "1e-4", "1e-2"], "0.0")[0] == []
    assert "not a positive number" in tuning.refine_steps("w", ["-1", "0", "1"], "0")[1]
    # an axis the rule does not refine is not refined, whatever its gaps
    assert tuning.refinement({"a": _arm({"ap.damping": ["1e-6", "1e-4", "1e-2"]}, {"ap.damping": "1e-4"})})["a"][
        "points"] == []


def _coarse():
    """AdamW and DoPr-AdamW on one seed over a coarse grid: AdamW wins at 1e-2 (1e-3 10x below, 3e-2 3x above),
    DoPr-AdamW at 3e-2 (neighbours within 3.5x)."""
    lrs = ["1e-4", "1e-3", "1e-2", "3e-2", "0.1"]
    gp = [_rec("adamw", 0, v, **{"optim.lr": lr}) for lr, v in zip(lrs, (5.0, 3.0, 1.0, 2.0, 4.0))]
    dopr = [_rec("dopr_adamw", 0, v, **{"optim.lr": lr}) for lr, v in zip(lrs, (5.0, 3.0, 2.0, 1.0, 4.0))]
    return gp + dopr


def test_select_refuses_a_due_refinement_not_run_and_takes_its_runs_in(tmp_path):
    point = tuning.override_text(math.sqrt(1e-3 * 1e-2))
    cmd = "python -m experiments.common.protocol refine toy --variant v"
    with pytest.raises(ValueError) as refused:
        tuning.select(_coarse(), "val", fresh_seeds=[3], refine_command=cmd)
    msg = str(refused.value)
    assert "a refinement is due and has not run: adamw optim.lr=1e-2 (its neighbour 1e-3 10x away) -> 0.00316 on " \
           "seeds [0]" in msg and f"Run it: {cmd}, then select again" in msg and "--skip-refine" in msg
    assert "dopr_adamw" not in msg
    # with the refine runs: the point is a trial of AdamW's, counted apart from the grid's budget
    refined = [_rec("adamw", 0, 0.5, **{"optim.lr": point})]
    sel = tuning.select(_coarse(), "val", fresh_seeds=[3], refined=refined)
    gp, dopr = sel["arms"]["adamw"], sel["arms"]["dopr_adamw"]
    assert gp["winner"] == {"optim.lr": point} and gp["value"] == 0.5
    assert gp["grid"] == {"optim.lr": ["1e-4", "1e-3", "1e-2", "3e-2", "0.1"]} and gp["at_grid_edge"] == []
    assert tuning.budget(gp) == tuning.budget(dopr) == 5 and len(gp["trials"]) == 6
    assert gp["refinement"]["coarse_winner"] == {"optim.lr": "1e-2"} and gp["refinement"]["points"] == [
        {"optim.lr": point}] and gp["refinement"]["winner"] == {"optim.lr": point}
    assert dopr["refinement"]["points"] == [] and dopr["winner"] == {"optim.lr": "3e-2"}
    assert tuning.chosen_settings(sel)["adamw"]["optim.lr"] == point
    tuning.write_selection(sel, tmp_path / "out", "stamp", tmp_path / "conf", "cmd")
    md = (tmp_path / "out" / "selection.md").read_text()
    assert ("adamw: refined around the coarse winner optim.lr=1e-2 (val 1), a gap beyond 3.5x: optim.lr=1e-2 (its "
            "neighbour 1e-3 10x away) -> 0.00316, run on seeds [0]; final winner optim.lr=" + point) in md
    assert "dopr_adamw: no refinement: optim.lr=3e-2: nearest neighbours within 3.5x (1e-2 3x, 0.1 3.33x)." in md
    assert f"| adamw | optim.lr={point} | 0.5 | 0.5 | yes | refinement |" in md
    assert "adamw: optim.lr in {1e-4, 1e-3, 1e-2, 3e-2, 0.1} (5 settings + 1 refinement)" in md
    saved = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert saved["refine"] == {"axes": ["optim.lr"], "above": 3.5, "skipped": None}
    # a coarse winner that wins again stays the winner; the refinement is recorded all the same
    worse = tuning.select(_coarse(), "val", fresh_seeds=[3], refined=[_rec("adamw", 0, 7.0, **{"optim.lr": point})])
    assert worse["arms"]["adamw"]["winner"] == {"optim.lr": "1e-2"}
    # --skip-refine records its reason instead
    skipped = tuning.select(_coarse(), "val", fresh_seeds=[3], skip_refine="a rehearsal")
    assert skipped["arms"]["adamw"]["refinement"]["skipped"] == "a rehearsal"
    assert skipped["arms"]["adamw"]["winner"] == {"optim.lr": "1e-2"} and skipped["refine"]["skipped"] == "a rehearsal"
    assert "adamw: refinement skipped with --skip-refine" in "\n".join(tuning.selection_notes(skipped))
    # refused: a refine run the rule does not ask for (a stale one), and an empty reason
    with pytest.raises(ValueError, match="adamw: a refine run at optim.lr=0.005, seed=0, which the refinement of its "
                                         "coarse winner optim.lr=1e-2 does not ask for"):
        tuning.select(_coarse(), "val", refined=refined + [_rec("adamw", 0, 0.1, **{"optim.lr": "0.005"})])
    with pytest.raises(ValueError, match="--skip-refine needs the reason"):
        tuning.select(_coarse(), "val", skip_refine=" ")
