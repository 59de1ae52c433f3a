"""A damping rule declares its inputs (issue 75 item 2): a rule that needs a new per-layer quantity is the rule
plus one registered quantity (dopr/quantities.py), both written here, in the test module: no library file
changes. The capture computes the quantity into each statistic's ``extras``, micro-batches merge it by its
declared merge (here max), and the rule reads it in ``groups.items``."""
import pytest
import torch
from torch import nn

from dopr import DoPr, damping, quantities

GAMMA, C = 1e-3, 0.25


@pytest.fixture
def max_row_norm_rule(monkeypatch):
    """The quantity "max_row_norm" (the largest squared row norm of the layer's activation rows, merged by
    max) and the rule lam = damping + C * max_row_norm reading it; both registrations undone after the test."""
    monkeypatch.setattr(damping, "RULES", dict(damping.RULES))
    monkeypatch.setattr(quantities, "QUANTITIES", dict(quantities.QUANTITIES))
    quantities.register_quantity(
        "max_row_norm", lambda helper, x, rows: helper.activations(x).square().sum(-1).max(), merge="max")

    @damping.register_rule("max_row_norm")
    class MaxRowNormRule(damping.DampingRule):
        reads = ("max_row_norm",)
        chosen = ()   # each call's lambda, for the test

        def lam(self, groups):
            top = torch.stack([stat.extras["max_row_norm"] for _, stat, _ in groups.items])
            lam = groups.floor.to(top.dtype) + C * top
            self.chosen = [*self.chosen, lam]
            return lam

    return MaxRowNormRule


def test_a_rule_with_a_new_quantity_is_the_rule_and_one_registration(max_row_norm_rule):
    """lambda is the formula from the batch in float64 (the max over two micro-batches: the merge), and M is
    G (Sigma + lambda I)^-1 with it; the default rule's statistics carry no quantity."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 32, 5, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 1e-3, 3.0],
                                                                                dtype=torch.float64)
    z[1, 7] *= 4.0   # the largest row is in the second micro-batch
    y = torch.randn(2, 32, 3, generator=g, dtype=torch.float64)
    layer = nn.Linear(5, 3, bias=False).double()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=GAMMA, damping_mode="absolute",
               damping_rule="max_row_norm", solve_space="features")
    rule = opt.refresh.damping
    assert isinstance(rule, max_row_norm_rule) and opt.capture.reads == ("max_row_norm",)
    opt.zero_grad()
    for k in range(2):
        ((layer(z[k]) - y[k]) ** 2).mean().backward()
    grad = layer.weight.grad.clone()
    opt.precondition()
    x = z.reshape(-1, 5)
    lam = GAMMA + C * float(x.square().sum(-1).max())
    assert len(rule.chosen) == 1 and rule.chosen[0].shape == (1,)
    assert float(rule.chosen[0][0]) == pytest.approx(lam, rel=1e-14)
    sigma = x.T @ x / x.shape[0]
    want = torch.linalg.solve(sigma + lam * torch.eye(5, dtype=torch.float64), grad.T).T
    torch.testing.assert_close(layer.weight.grad, want, rtol=1e-10, atol=0.0)
    opt.close()

    plain = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0))
    assert plain.capture.reads == ()
    plain.zero_grad()
    ((layer(z[0]) - y[0]) ** 2).mean().backward()
    assert plain.capture.layers[0].stat.extras == {}
    plain.close()


def test_training_with_the_new_rule_works(max_row_norm_rule):
    """A token MLP trained by DoPr-AdamW under the rule: every step's lambda is the formula on that step's
    batch (per layer, its own input), and the loss falls (by ~20% in 20 steps at this lambda)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), damping=GAMMA, damping_mode="absolute",
               damping_rule="max_row_norm")
    x = torch.randn(64, 6, dtype=torch.float64)
    target = torch.randn(64, 3, dtype=torch.float64)
    losses, seen = [], {}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__(0, i[0].detach()))
    model[2].register_forward_hook(lambda m, i, o: seen.__setitem__(2, i[0].detach()))
    for _ in range(20):
        opt.refresh.damping.chosen = []
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        lam = torch.tensor(sorted(GAMMA + C * float(seen[i].square().sum(-1).max()) for i in (0, 2)),
                           dtype=torch.float64)
        chosen = torch.cat(opt.refresh.damping.chosen).sort().values
        torch.testing.assert_close(chosen, lam, rtol=1e-13, atol=0.0)
    assert all(v == v for v in losses) and losses[-1] < 0.85 * losses[0]
    opt.close()


def test_an_unknown_quantity_is_named():
    with pytest.raises(KeyError, match="no per-layer quantity 'nope' is registered"):
        quantities.quantity("nope")
    with pytest.raises(ValueError, match="merge must be one of"):
        quantities.register_quantity("nope", lambda helper, x, rows: x.sum(), merge="mean")


def _all_reduce_worker(rank, world, init_file, out):
    """Two statistics per rank: the first carries max_row_norm (3 on rank 0, 5 on rank 1) and samples on rank 1
    only; the second carries max_row_norm on rank 0 only. Saves what all_reduce_statistics gives back."""
    import torch.distributed as dist
    from ranks import leave_process_group
    from dopr.distributed import all_reduce_statistics
    from dopr.statistics import DenseCovariance

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    quantities.register_quantity(
        "max_row_norm", lambda helper, x, rows: helper.activations(x).square().sum(-1).max(), merge="max")
    first = DenseCovariance((torch.full((2, 2), float(rank + 1)),), 4 + rank)
    first.extras = {"max_row_norm": torch.tensor(3.0 + 2 * rank)}
    if rank == 1:
        first.extras["samples"] = torch.tensor(2.0)
    second = DenseCovariance((torch.ones(2, 2),), 6)
    if rank == 0:
        second.extras = {"max_row_norm": torch.tensor(7.0)}
    all_reduce_statistics([first, second], ("samples", "max_row_norm"))
    leave_process_group()
    torch.save([(st.sums[0], st.count, {k: float(v) for k, v in st.extras.items()}) for st in (first, second)],
               f"{out}.{rank}")


@pytest.mark.slow
def test_two_ranks_merge_each_quantity_by_its_declared_merge():
    """all_reduce_statistics on 2 gloo ranks: "samples" summed with the sums (count standing in where a rank has
    none), "max_row_norm" by max (a rank without it adds nothing); every rank gets the same."""
    import os
    import tempfile
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_all_reduce_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        r0, r1 = (torch.load(f"{out}.{r}") for r in (0, 1))
    for a, b in zip(r0, r1):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    (sums1, count1, extras1), (sums2, count2, extras2) = r0
    assert torch.equal(sums1, torch.full((2, 2), 3.0)) and count1 == 9 and count2 == 12
    assert extras1 == {"max_row_norm": 5.0, "samples": 4.0 + 2.0}
    assert extras2 == {"max_row_norm": 7.0, "samples": 12.0}
