"""Loading a file never runs code from it: the training-state checkpoint and the SAC experts are read
with torch.load(weights_only=True); a file carrying a pickled callable is refused, naming the file."""
import os
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import dopr
from experiments.common.checkpoint import TrainingState
from experiments.common.run import Run, load_plain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERTS = os.path.join(ROOT, "experiments", "bc", "experts", "v1")


class _Payload:
    """Unpickling this would create `marker` (what a malicious file would do instead)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(tmp_path):
    return Run(OmegaConf.create({"device": "cpu", "logger": {"name": "none"}}), tmp_path)


def _draws(gen, npgen):
    return random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item(), npgen.random()


def test_a_checkpoint_file_round_trips_with_dopr_and_every_random_state(tmp_path):
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    opt = dopr.build(model, "adamw", ap={"grad_ema": 0.5}, lr=1e-2)
    gen, npgen = torch.Generator().manual_seed(1), np.random.default_rng(2)
    state = TrainingState(model=model, optimizer=opt, generators={"data": gen, "numpy": npgen})
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    run = _run(tmp_path)
    state.save(run, 3, best=-np.inf, returns={1: [2.0]})
    after = _draws(gen, npgen)
    weights = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    run.close(failed=False)

    again = _run(tmp_path)  # a requeued job: a new Run in the same directory reads checkpoint.pt
    assert state.resume(again) == (3, {"best": -np.inf, "returns": {1: [2.0]}})
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert _draws(gen, npgen) == after  # numpy's global state (an array) came back too
    again.close(failed=False)


@pytest.mark.parametrize("payload", ["callable", "reduce"])
def test_a_checkpoint_carrying_code_is_refused_and_nothing_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    obj = os.system if payload == "callable" else _Payload(marker)
    torch.save({"state": {"step": 1, "x": obj}, "metric_rows": 0}, tmp_path / "checkpoint.pt")
    run = _run(tmp_path)
    with pytest.raises(ValueError, match=r"refusing to load .*checkpoint\.pt: it contains objects that are not "
                                         r"plain tensors or containers \((posix|nt|io)\.(system|open)\)"):
        run.load_checkpoint()
    assert not marker.exists()
    if payload == "reduce":  # the marker does work: an unrestricted unpickler would have created it
        torch.load(tmp_path / "checkpoint.pt", weights_only=False)
        assert marker.exists()
    run.close(failed=False)


def test_load_plain_names_the_file_for_a_pickled_callable(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"x": os.system}, path)
    with pytest.raises(ValueError, match=f"refusing to load {path}: it contains objects that are not plain"):
        load_plain(path)
    torch.save({"w": torch.ones(2), "n": [1, 2.0, "a", None]}, path)
    assert load_plain(path)["n"] == [1, 2.0, "a", None]


def test_the_shipped_experts_load_and_an_expert_carrying_code_is_refused(tmp_path):
    pytest.importorskip("gymnasium")
    from experiments.bc.expert import load_expert, publish

    for env in ("HalfCheetah-v5", "Humanoid-v5"):
        blob, actor = load_expert(os.path.join(EXPERTS, f"{env}.pt"))
        assert blob["env"] == env
        assert torch.equal(actor.net[0].weight, blob["actor"]["net.0.weight"])

    marker = tmp_path / "ran"
    blob = torch.load(os.path.join(EXPERTS, "HalfCheetah-v5.pt"), weights_only=True)
    blob["source"] = _Payload(marker)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save(blob, run_dir / "expert.pt")
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=r"refusing to load .*expert\.pt: it contains objects that are not plain"):
        load_expert(run_dir / "expert.pt")
    with pytest.raises(ValueError, match=r"refusing to load .*expert\.pt"):
        publish(run_dir, "vtest", root=tmp_path / "experts")
    assert not marker.exists() and not (tmp_path / "experts").exists()
