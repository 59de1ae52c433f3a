"""The damping rules behind one seam (dopr/damping.py, issue 66 item 1): a new rule is one class plus the
option value that chooses it, each rule keeps its state and counters, and the AP state dict keeps the
layout of the checkpoints written before the rules were objects."""
import copy

import pytest
import torch
from torch import nn

from dopr import DoPr, damping
from reference import ap_reference

#: the entries of state_dict()["dopr"], as checkpoints have held them since the weak-share rules
AP_STATE_KEYS = {"step", "warmed", "grad_ema", "precond_ema", "cache", "counts", "damping_scale", "unfactored",
                 "idle", "options"}


def _layer_and_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(32, 5, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 1e-3, 3.0],
                                                                             dtype=torch.float64)
    layer = nn.Linear(5, 3, bias=False).double()
    return layer, z, torch.randn(32, 3, generator=g, dtype=torch.float64)


def _step_grad(layer, opt, z, y):
    """G of one backward, and the M that opt.precondition() put in its place."""
    opt.zero_grad()
    ((layer(z) - y) ** 2).mean().backward()
    g = layer.weight.grad.clone()
    opt.precondition()
    return g, layer.weight.grad.clone()


def test_a_new_rule_is_one_class_and_one_option_value(monkeypatch):
    """A rule registered under a new weak_share_estimate value is accepted by the options and used by
    DoPr (dopr/optimizer.py unchanged): here lambda = 2 x the trace rule's, so M = G (Sigma + 2 gamma
    tr(Sigma) I)^-1; its counter reaches stats() and its held factors the state dict."""
    monkeypatch.setattr(damping, "RULES", dict(damping.RULES))   # the registration is undone after the test

    @damping.register_rule("doubled")
    class Doubled(damping.WeakShareRule):
        COUNTERS = ("doublings",)

        def lam(self, groups):
            self.counts["doublings"] += len(groups.keys)
            self.scale.update({key: 2.0 for key in groups.keys})
            return 2.0 * groups.floor

    assert "doubled" in damping.estimates()
    layer, z, y = _layer_and_data()
    gamma = 1e-3
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=gamma, weak_share_bound=0.5,
               weak_share_estimate="doubled")
    assert isinstance(opt.refresh.damping, Doubled)
    g, m = _step_grad(layer, opt, z, y)
    # float64 Cholesky solve against LU on a 5 x 5 system with cond(A) <= 1e4: rounding far under 1e-10
    torch.testing.assert_close(m, ap_reference(g, z, 2 * gamma), rtol=1e-10, atol=0.0)
    assert opt.stats()["doublings"] == 1
    ap = opt.state_dict()["dopr"]
    assert set(ap) == AP_STATE_KEYS and ap["damping_scale"] == {"": 2.0} and ap["counts"]["doublings"] == 1
    with pytest.raises(ValueError, match=r"Invalid weak_share_estimate: 'tripled' \(choose from \("):
        DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), weak_share_bound=0.5, weak_share_estimate="tripled")
    opt.close()


@pytest.mark.parametrize("options,rule", [({}, damping.TraceRule),
                                          ({"weak_share_bound": 0.25, "health_every": 1}, damping.WeakShareBySpectrum),
                                          ({"weak_share_bound": 0.25, "weak_share_estimate": "filter"},
                                           damping.WeakShareByFilter)])
def test_each_rule_keeps_its_state_and_counters_through_a_checkpoint(options, rule):
    """The options choose the rule; its held factors and counters leave in the state dict's
    damping_scale and counts (the layout of older checkpoints) and come back in a fresh optimizer."""
    layer, z, y = _layer_and_data()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=1e-6, **options)
    assert type(opt.refresh.damping) is rule
    for _ in range(2):
        _step_grad(layer, opt, z, y)
    state = opt.state_dict()
    assert set(state["dopr"]) == AP_STATE_KEYS
    chosen = {k: state["dopr"]["counts"].get(k, 0) for k in ("damping_choices", "damping_raises")}
    # the weak direction (1e-3 of the others' scale) needs a raise at 1e-6 tr(Sigma) on both steps
    assert chosen == ({"damping_choices": 0, "damping_raises": 0} if rule is damping.TraceRule
                      else {"damping_choices": 2, "damping_raises": 2})
    assert (state["dopr"]["damping_scale"] != {}) == (rule is damping.WeakShareBySpectrum)
    layer2 = copy.deepcopy(layer)
    fresh = DoPr(layer2, torch.optim.SGD(layer2.parameters(), lr=0.0), damping=1e-6, **options)
    fresh.load_state_dict(state)
    assert {k: fresh.stats()[k] for k in chosen} == chosen
    assert fresh.state_dict()["dopr"]["damping_scale"] == state["dopr"]["damping_scale"]
    opt.close()
    fresh.close()


def test_a_copy_pickled_before_the_rules_were_objects_keeps_its_factors_and_counters():
    """A DoPr copied before dopr/damping.py held the spectrum rule's factors as ``_damping_scale`` and its
    counters among ``_counts``: unpickled now, its rule holds them."""
    layer, z, y = _layer_and_data()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=1e-6, weak_share_bound=0.25,
               health_every=1)
    _step_grad(layer, opt, z, y)
    state = opt.__getstate__()
    refresh = state.pop("_refresh")   # before dopr/refresh.py too: its state was DoPr's own
    state.update(_cache=refresh.cache, _precond_ema=refresh.precond_ema, _damping_scale={("",): 4.0},
                 _counts={**refresh.counts, "damping_choices": 7, "damping_raises": 5})
    state = copy.deepcopy(state)    # its own model, as a pickled copy has
    old = DoPr.__new__(DoPr)
    old.__setstate__(state)
    assert old.refresh.damping.scale == {("",): 4.0}
    assert (old.stats()["damping_choices"], old.stats()["damping_raises"]) == (7, 5)
    opt.close()
    old.close()
