"""experiments/studies/layer_cadence.py: the per-layer refresh cadence of issue 76 item 4's diagnosis refreshes the
layers it names every k-th step and every other layer on every step, and its report refuses a folder it cannot read."""
import json
import re

import pytest
import torch
from test_refresh_policy import _grads   # tests/lib: the M of each layer over 4 steps at lr 0, and stats()

from experiments.studies import layer_cadence


def test_the_stale_layer_keeps_its_factor_for_k_steps_and_the_others_refresh_every_step(monkeypatch):
    monkeypatch.setattr(layer_cadence, "STALE", re.compile("^0$"))
    monkeypatch.setattr(layer_cadence, "POLICIES", [])
    cadence, _ = _grads(refresh_policy="layers", precond_every=3)
    once, _ = _grads(precond_every=100)     # every factor from step 0's statistics, kept
    every, _ = _grads(precond_every=1)      # every factor from its step's statistics
    for step in range(4):
        for name in ("2.weight", "2.bias"):
            assert torch.equal(cadence[step][name], every[step][name])
    for step in range(3):                # layer 0: step 0's factor until step 3 refreshes it
        assert torch.equal(cadence[step]["0.weight"], once[step]["0.weight"])
    assert torch.equal(cadence[3]["0.weight"], every[3]["0.weight"])
    assert not torch.equal(once[2]["0.weight"], every[2]["0.weight"])   # the two factors differ: the check can fail
    assert layer_cadence.POLICIES[0].refresh_fractions() == {"0": 0.5, "2": 1.0}


def test_the_report_tabulates_runs_and_refuses_a_folder_without_them(tmp_path):
    run = tmp_path / "inp_k10"
    run.mkdir()
    (run / "layer_cadence.json").write_text(json.dumps({"stale": "^inp$", "k": 10,
                                                        "refreshes_over_steps": {"inp": [100, 1000], "out": [1000, 1000]}}))
    (run / "summary.json").write_text(json.dumps({"seed": 0, "return_mean": 2140.4, "val_loss": 0.0075}))
    text = layer_cadence.report([run], tmp_path / "out.md")
    assert "| `^inp$` | 10 | 0 | inp 0.10, out 1.00 | return_mean 2140, val_loss 0.0075 |" in text
    assert (tmp_path / "out.md").read_text() == text
    (run / "layer_cadence.json").write_text(json.dumps({"stale": "^(blocks|out)", "k": 10, "refreshes_over_steps": {}}))
    assert "| `^(blocks\\|out)` | 10 |" in layer_cadence.report([run], tmp_path / "out.md")   # a bare | splits the cell
    with pytest.raises(SystemExit, match="holds no finished layer_cadence run"):
        layer_cadence.report([tmp_path / "missing"], tmp_path / "out2.md")
