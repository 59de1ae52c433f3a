"""The conventions and the counters every job's summary.json carries (the paper's conventions on the
library: tests/lib/test_paper_conventions.py; DoPr as a torch optimizer: tests/lib/test_dopr_optimizer.py)."""
import json

import pytest

import dopr
from dopr import DoPr
from test_dopr_optimizer import _mlp


def test_the_counters_of_stats_are_the_declared_ones_and_the_summary_carries_them():
    """DoPr.COUNTERS lists every counter the library counts (each `counts["<name>"]` in dopr/, and each repair
    path's `COUNTER = "<name>"`, which solvers.Deferred.finish counts), stats() has each of them from the start,
    and a job's summary.json sums the same list."""
    import re
    from pathlib import Path

    counted = {m for path in (Path(dopr.__file__).parent).rglob("*.py")
               for m in re.findall(r"counts\[\"(\w+)\"\]|COUNTER(?:, \w+)* = \"(\w+)\"", path.read_text())
               for m in m if m}
    assert counted and counted | {"steps"} == set(DoPr.COUNTERS)
    opt = dopr.build(_mlp(), "sgd", ap={}, lr=1e-2)
    assert {k: opt.stats()[k] for k in DoPr.COUNTERS} == dict.fromkeys(DoPr.COUNTERS, 0)
    pytest.importorskip("omegaconf")
    from experiments.common.run import DOPR_COUNTERS
    assert DOPR_COUNTERS == DoPr.COUNTERS


def test_summary_carries_conventions_and_dopr_counters(tmp_path, compose):
    from experiments.common.launch import run_job

    cfg = compose("task=feature_learning", "optim=dopr_muon", "debug=default", "ap.damping=1e-3",
                  "optim.adjust_lr_fn=original")
    s = run_job(cfg, tmp_path / "ok")
    assert s["conventions"] == {"adjust_lr_fn": "original", "input_layer": "adamw", "damping_mode": "trace"}
    assert s["dopr"]["steps"] == 2 and s["dopr"]["cholesky_retries"] == 0
    # zero damping and a batch of 8 < d = 32: Sigma is singular, it gets the pseudo-inverse (no damped
    # retries: the damping asked for is 0), and the summary says so
    cfg = compose("task=feature_learning", "optim=dopr_sgd", "debug=default", "ap.damping=0.0",
                  "ap.damping_mode=absolute", "task.batch_size=8")
    run_job(cfg, tmp_path / "singular")
    s = json.loads((tmp_path / "singular" / "summary.json").read_text())
    assert s["conventions"] == {"damping_mode": "absolute"}
    assert s["dopr"]["eigh_fallbacks"] >= 1 and s["dopr"]["cholesky_retries"] == 0 and s["dopr"]["refreshes"] == 2
    plain = run_job(compose("task=feature_learning", "optim=adamw", "debug=default"), tmp_path / "plain")
    assert plain["conventions"] == {} and "dopr" not in plain and "dopr_options" not in plain


def test_summary_records_every_dopr_option_the_damping_rule_included(tmp_path, compose):
    # issue 74: summary.json held four hand-picked AP values, never the rule, so a sample-count run read as
    # "damping 0.0 (trace)"; it now holds every field of DoPrOptions as the optimizer has it
    from dopr.options import DoPrOptions
    from experiments.common.launch import run_job

    cfg = compose("task=feature_learning", "optim=dopr_adamw", "debug=default", "ap.damping=0.0",
                  "ap.damping_rule=sample_count")
    run_job(cfg, tmp_path / "rule")
    s = json.loads((tmp_path / "rule" / "summary.json").read_text())
    assert list(s["dopr_options"]) == list(DoPrOptions.names())
    assert s["dopr_options"]["damping_rule"] == "sample_count" and s["dopr_options"]["damping"] == 0.0
    assert s["dopr_options"]["solver"] == "cholesky" and s["dopr_options"]["skip_layers"] == []
