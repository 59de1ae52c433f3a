"""SOAP, Shampoo and PSGD-Kron as GPs (dopr/gp/peers.py): each is its package's class with the package's defaults,
plain (`optim=soap`) and under DoPr (`optim=dopr_soap`); DoPr with the AP off is the plain peer, DoPr with the AP on
is the package stepping on the AP's M; state_dict round trip and resume are exact. What the package cannot take is
refused in one line naming the layer: tests/lib/test_peer_refusals.py."""
import copy
import inspect
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import dopr
from dopr.gp import peers
from reference import ap_reference, assert_within, cholesky_ap_error_bound, with_ones
from test_gp import Net   # an embedding, matrices and 1-d parameters

pytest.importorskip("pytorch_optimizer")
import pytorch_optimizer  # noqa: E402

from experiments.common.checkpoint import rng_state, set_rng_state  # noqa: E402
from experiments.common.optim import gp_arguments  # noqa: E402
from experiments.common.run import load_plain, numpy_array_globals  # noqa: E402

PEERS = list(peers.PEERS)
STEPS = 4   # SOAP's first step only sets up its factors; its eigenbasis refreshes on steps 11, 21, ... at f = 10


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 10, (32,), generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _seeded(seed=0):
    """Kron draws its probe vectors from torch's global generator and its balancing coin from numpy's."""
    torch.manual_seed(seed)
    np.random.seed(seed)


def _args(compose, peer):
    """The peer's conf/optim YAML, as the suite passes it to dopr.build."""
    from omegaconf import OmegaConf
    args = gp_arguments(OmegaConf.to_container(compose(f"optim={peer}").optim))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}


def _package(peer):
    return getattr(pytorch_optimizer, peers.PEERS[peer][0])


@pytest.mark.parametrize("peer", PEERS)
def test_the_registered_keywords_and_the_yaml_are_the_package_signature_and_defaults(peer, compose):
    sig = inspect.signature(_package(peer)).parameters
    takes = {n for n, p in sig.items() if p.kind is p.POSITIONAL_OR_KEYWORD} - {"params", "lr", "weight_decay"}
    assert set(peers.PEERS[peer][1]) == takes == dopr.gp.GPS[peer].kwargs
    args = _args(compose, peer)
    assert args, "the YAML holds the package's defaults"
    for key, value in args.items():   # every value the YAML gives is the package's default for it
        assert value == sig[key].default, key


def _assert_same_steps(build, build_twin):
    model = Net()
    twin = copy.deepcopy(model)
    _seeded()
    _train(model, build(model), _batches())
    _seeded()
    _train(twin, build_twin(twin), _batches())
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(model.fc1.weight, Net().fc1.weight)   # it moved


@pytest.mark.parametrize("peer", PEERS)
def test_a_plain_peer_steps_as_the_package_does(peer, compose):
    args = _args(compose, peer)
    _assert_same_steps(lambda m: dopr.build(m, peer, **args), lambda m: _package(peer)(m.parameters(), **args))


@pytest.mark.parametrize("peer", PEERS)
def test_dopr_with_the_ap_off_is_the_plain_peer(peer, compose):
    args = _args(compose, peer)
    _assert_same_steps(lambda m: dopr.build(m, peer, ap={"warmup_steps": STEPS}, **args),
                       lambda m: dopr.build(m, peer, **args))


@pytest.mark.numerics   # against a bound counted from the roundings: run again under other kernels (make test-kernels)
@pytest.mark.parametrize("peer", PEERS)
def test_dopr_over_a_peer_is_the_package_stepping_on_the_ap_gradient(peer, compose):
    """One Linear with a bias: what the package receives is M = G (Sigma + lambda I)^-1 on [z, 1] (against a
    float64 reference), and the package stepping on it directly gives the same weights, bit for bit. (Not the
    package on the float64 M: SOAP's eigenbases of a rank-deficient factor turn rounding into O(1) changes.)"""
    args, damping = _args(compose, peer), 1e-2
    g = torch.Generator().manual_seed(2)
    layer = nn.Linear(6, 3)
    twin = copy.deepcopy(layer)
    data = [(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)) for _ in range(STEPS)]
    _seeded()
    opt = dopr.build(layer, peer, ap={"damping": damping}, **args)
    received = []
    opt.base.register_step_pre_hook(lambda o, *_: received.append([p.grad.clone() for p in layer.parameters()]))
    _train(layer, opt, data)
    assert len(received) == STEPS
    _seeded()
    direct = _package(peer)(twin.parameters(), **args)
    for (z, y), (m_weight, m_bias) in zip(data, received):
        direct.zero_grad()
        nn.functional.mse_loss(twin(z), y).backward()
        grad = torch.cat([twin.weight.grad, twin.bias.grad[:, None]], dim=1)
        m = ap_reference(grad, with_ones(z), damping)
        got = torch.cat([m_weight, m_bias[:, None]], dim=1).double()
        # a float32 Gram of 64 rows and Cholesky solve of a 7 x 7 system: the bound counts their roundings
        assert_within(got, m, cholesky_ap_error_bound(got, m, with_ones(z), damping, torch.float32))
        twin.weight.grad, twin.bias.grad = m_weight.clone(), m_bias.clone()
        direct.step()
    assert torch.equal(layer.weight, twin.weight) and torch.equal(layer.bias, twin.bias)


def _state_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", PEERS + ["dopr_" + p for p in PEERS])
def test_state_dict_round_trip_and_resume_are_exact(name, compose, tmp_path):
    """Run 2 + 2 steps; or 2, save (as the suite's checkpoint does: model, optimizer, every random state; loaded
    as it loads, tensors and plain containers only), load into a fresh model and optimizer, 2 more: the same
    weights and state, bit for bit."""
    gp, wrapped = dopr.split_name(name)
    args = _args(compose, gp)
    batches = _batches()
    model = Net()
    start = copy.deepcopy(model.state_dict())
    _seeded()
    opt = dopr.build(model, gp, ap={} if wrapped else None, **args)
    _train(model, opt, batches[:2])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng_state()}, tmp_path / "checkpoint.pt")
    _train(model, opt, batches[2:])

    saved = load_plain(tmp_path / "checkpoint.pt", allowed=numpy_array_globals())
    resumed = Net()
    resumed.load_state_dict(start)   # another start, overwritten by the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = dopr.build(resumed, gp, ap={} if wrapped else None, **args)
    opt2.load_state_dict(saved["opt"])
    assert _state_equal(opt2.state_dict(), saved["opt"])   # the round trip
    set_rng_state(saved["rng"])
    _train(resumed, opt2, batches[2:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert _state_equal(opt.state_dict(), opt2.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["soap", "dopr_soap"])
def test_the_humanoid_command_runs_with_soap_plain_and_under_dopr(optim, demo_file, tmp_path):
    """`python run.py task=humanoid optim=dopr_soap` (and optim=soap), shrunk by debug=default to 20 steps, on a
    small demonstration file instead of the expert's rollouts."""
    pytest.importorskip("mujoco")
    from conftest import ROOT
    demos = demo_file("Humanoid-v5")
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), "task=humanoid", f"optim={optim}", "debug=default",
                          f"task.demos={demos}", "task.num_trajectories=2", "task.max_trajectories=2",
                          "task.val_trajectories=1", f"hydra.run.dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["optim"] == optim and np.isfinite(summary["return_mean"])
    assert [r["step"] for r in rows] == [10, 20] and rows[-1]["train_loss"] < rows[0]["train_loss"]
