"""The refresh-policy seam (dopr/refresh_policy.py, issue 75 item 3): a policy is one registered class, and DoPr
refreshes exactly the groups it says, every other layer keeping its last factor."""
import pytest
import torch
from torch import nn

import dopr
from dopr import refresh_policy
from dopr.options import DoPrOptions


@pytest.fixture
def second_layer_only():
    @refresh_policy.register_policy("second_layer_only")
    class SecondLayerOnly(refresh_policy.RefreshPolicy):
        """Every step gathers; step 0 refreshes every group, later steps only the group of layer "2"."""

        def gathers(self, step):
            return True

        def due(self, step, keys):
            return set(keys) if step == 0 else {k for k in keys if "2" in k}

    yield
    del refresh_policy.POLICIES["second_layer_only"]


def _grads(**ap):
    """The M each layer gets over 4 steps at lr 0 (the model does not move: the steps see the same layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), **ap)
    gen, out = torch.Generator().manual_seed(1), []
    for _ in range(4):
        model(torch.randn(32, 5, generator=gen)).square().mean().backward()
        opt.step()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.zero_grad()
    return out, opt.stats()


def test_a_registered_policy_refreshes_the_groups_it_names_and_the_others_keep_their_factor(second_layer_only):
    policy, stats = _grads(refresh_policy="second_layer_only")
    once, _ = _grads(precond_every=100)       # layer 0's factor from step 0's statistics, kept
    every, _ = _grads(precond_every=1)        # layer 2's factor from each step's statistics
    for step in range(4):
        for name in ("0.weight", "0.bias"):
            assert torch.equal(policy[step][name], once[step][name])
        for name in ("2.weight", "2.bias"):
            assert torch.equal(policy[step][name], every[step][name])
    assert not torch.equal(once[3]["2.weight"], every[3]["2.weight"])   # the two factors differ: the check can fail
    assert stats["factorizations"] == 2 + 3


def test_the_default_policy_is_every_k_and_an_unknown_one_is_refused():
    assert DoPrOptions().refresh_policy == "every"
    with pytest.raises(ValueError, match="Invalid refresh_policy: 'never' .*choose from \\('every', 'drift'"):
        DoPrOptions(refresh_policy="never")


@pytest.mark.parametrize("k", [1, 3])
def test_every_k_gathers_and_refreshes_on_every_kth_step(k):
    policy = refresh_policy.build(DoPrOptions(precond_every=k))
    assert [policy.gathers(s) for s in range(6)] == [s % k == 0 for s in range(6)]
    assert policy.due(3, [("a",), ("b", "c")]) == ({("a",), ("b", "c")} if k in (1, 3) else set())
    assert policy.due(1, [("a",)]) == ({("a",)} if k == 1 else set())
    assert policy.caches == (k > 1)
