"""dopr in the loops real code writes (issue "Reliability", section 2): statistics follow the gradient
they belong to, only forwards whose weight gradient the step receives count, data parallel with
ranks that use different layers, damping 0 with a rank-deficient Sigma, compiled and eager sharing.
Each test fails on the code before the fix and asserts the behaviour."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dopr
from dopr import DoPr
from ranks import leave_process_group
from reference import ap_reference, with_ones

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)

GAMMA = 1e-3


def _net(seed=0, width=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2)).double()


def _batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _one_step_on(x, y, seed=0):
    """Parameters after one DoPr-SGD step on (x, y) alone: what a leak-free loop must give."""
    model = _net(seed)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    _loss(model, x, y).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------- 2. statistics follow the gradient
@pytest.mark.parametrize("clear", ["module.zero_grad", "grad_none", "zero_in_place"])
def test_clearing_the_gradient_by_any_means_clears_its_statistics(clear):
    """transformers.Trainer calls model.zero_grad(); a step GradScaler skipped leaves its batch behind."""
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    xa, ya = _batch(16, 1)
    xb, yb = _batch(16, 2)
    _loss(model, xa, ya).backward()          # a step that is then skipped (inf found by GradScaler)
    assert opt.pending_samples() == {"0": 16, "2": 16}
    if clear == "module.zero_grad":
        model.zero_grad()
    elif clear == "grad_none":
        for p in model.parameters():
            p.grad = None
    else:
        model.zero_grad(set_to_none=False)
    _loss(model, xb, yb).backward()
    assert opt.pending_samples() == {"0": 16, "2": 16}        # batch b only (32 before the fix)
    opt.step()
    for p, q in zip(model.parameters(), _one_step_on(xb, yb)):
        torch.testing.assert_close(p.detach(), q, rtol=1e-12, atol=1e-14)


def test_micro_batches_still_accumulate_and_an_in_place_change_that_is_not_a_clear_keeps_them():
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    _loss(model, *_batch(8, 1)).backward()
    for p in model.parameters():             # e.g. a gradient all-reduce or unscale between micro-batches
        p.grad.mul_(1.0)
    _loss(model, *_batch(8, 2)).backward()
    assert opt.pending_samples() == {"0": 16, "2": 16}


def test_a_dcgan_generator_step_does_not_leak_into_the_discriminators_sigma():
    """PyTorch's DCGAN tutorial: netD.zero_grad(), D on real and fake, then G's step runs D on the fake
    batch (D's weights receive gradients there too), then netD.zero_grad() again."""
    torch.manual_seed(0)
    netD = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    netG = nn.Sequential(nn.Linear(3, 4)).double()
    optD = DoPr(netD, torch.optim.SGD(netD.parameters(), lr=0.01), damping=GAMMA)
    optG = DoPr(netG, torch.optim.SGD(netG.parameters(), lr=0.01), damping=GAMMA)
    real = torch.randn(16, 4, dtype=torch.float64)
    for it in range(2):
        netD.zero_grad()
        fake = netG(torch.randn(16, 3, dtype=torch.float64))
        (netD(real).mean() - netD(fake.detach()).mean()).backward()
        assert optD.pending_samples() == {"0": 32, "2": 32}   # real + fake (48 on the second pass before)
        optD.step()
        netG.zero_grad()
        netD(fake).mean().backward()
        optG.step()


# ------------------------------------------- 3. only forwards whose weight gradient the step gets
def test_input_gradients_of_an_adversarial_attack_add_no_statistics():
    """PGD: three torch.autograd.grad calls w.r.t. the input, then the training forward on the result."""
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=1.0), damping=GAMMA)
    x, y = _batch(24, 1)
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(3):
        g, = torch.autograd.grad(_loss(model, x + delta, y), delta)
        delta = (delta + 0.1 * g.sign()).detach().requires_grad_(True)
    x_adv = (x + delta).detach()
    _loss(model, x_adv, y).backward()
    assert opt.pending_samples() == {"0": 24, "2": 24}        # 96 before the fix
    g0 = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    want = ap_reference(g0, with_ones(x_adv), GAMMA)
    opt.precondition()
    got = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_forward_run_again_by_double_backward_counts_once():
    """A physics-informed loss: du/dx with create_graph=True, then a loss on u and du/dx."""
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=1.0), damping=GAMMA)
    x = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    xb, yb = _batch(8, 3)
    u = model(x)
    du, = torch.autograd.grad(u.sum(), x, create_graph=True)
    (du.square().mean() + u.square().mean() + _loss(model, xb, yb)).backward()
    assert opt.pending_samples() == {"0": 28, "2": 28}        # 48 before the fix
    g0 = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    want = ap_reference(g0, with_ones(torch.cat([x.detach(), xb])), GAMMA)
    opt.precondition()
    got = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)



def test_gradients_taken_with_autograd_grad_and_assigned_by_hand_count():
    """Functional style: torch.autograd.grad(loss, params), then p.grad = g. The step receives the
    gradient, so the forward counts, as with loss.backward()."""
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    x, y = _batch(16, 4)
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(_loss(model, x, y), params)):
        p.grad = g
    assert opt.pending_samples() == {"0": 16, "2": 16}
    opt.step()
    for p, q in zip(model.parameters(), _one_step_on(x, y)):
        torch.testing.assert_close(p.detach(), q, rtol=1e-9, atol=1e-12)

@pytest.mark.slow
def test_a_compiled_forward_follows_the_same_rules():
    model = _net()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    forward = torch.compile(model, backend="aot_eager", fullgraph=True)
    xa, ya = _batch(16, 1)
    xb, yb = _batch(16, 2)
    ((forward(xa) - ya) ** 2).mean().backward()
    model.zero_grad()                                            # a skipped step, Trainer-style
    delta = torch.zeros_like(xb, requires_grad=True)
    torch.autograd.grad(((forward(xb + delta) - yb) ** 2).mean(), delta)   # input gradient only
    ((forward(xb) - yb) ** 2).mean().backward()
    assert opt.pending_samples() == {"0": 16, "2": 16}
    opt.step()
    for p, q in zip(model.parameters(), _one_step_on(xb, yb)):
        torch.testing.assert_close(p.detach(), q, rtol=1e-9, atol=1e-12)


# -------------------------------------------------- 1. data parallel, ranks that use other layers
class _Heads(nn.Module):
    """A shared trunk and one head per task; the batch of rank r belongs to task r."""

    def __init__(self, only_rank0_layer: bool):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 2), nn.Linear(6, 2)])
        self.extra = nn.Linear(6, 6) if only_rank0_layer else None   # run on task 0 only, another shape

    def forward(self, x, task):
        h = torch.tanh(self.trunk(x))
        if self.extra is not None and task == 0:
            h = torch.tanh(self.extra(h))
        return self.heads[task](h)


def _heads_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 12, 4, generator=g, dtype=torch.float64), torch.randn(2, 12, 2, generator=g, dtype=torch.float64)


def _heads_worker(rank, world, init_file, out, only_rank0_layer):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_Heads(only_rank0_layer).double(), find_unused_parameters=True)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    x, y = _heads_data()
    for _ in range(2):
        opt.zero_grad()
        ((model(x[rank], rank) - y[rank]) ** 2).mean().backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.module.parameters()], out.format(rank))
    del model, opt
    leave_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("only_rank0_layer", [False, True])
def test_ddp_ranks_that_run_different_layers_stay_identical_and_equal_one_process(only_rank0_layer):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{}.pt")
        mp.spawn(_heads_worker, args=(2, os.path.join(tmp, "init"), out, only_rank0_layer), nprocs=2, join=True)
        ranks = [torch.load(out.format(r)) for r in range(2)]
    for p, q in zip(*ranks):
        assert torch.equal(p, q)                                  # the replicas stay identical
    model = _Heads(only_rank0_layer).double()                     # one process: both tasks' batches
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    x, y = _heads_data()
    for _ in range(2):
        opt.zero_grad()
        sum(((model(x[r], r) - y[r]) ** 2).mean() for r in range(2)).div(2).backward()
        opt.step()
    for p, q in zip(model.parameters(), ranks[0]):
        torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)


# ------------------------------------------------ 9. compiled and eager: one rule for sharing Sigma
class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x1, x2):
        return self.a(x1) * self.b(x2)


@pytest.mark.parametrize("coincide", [0, 2])
def test_compiled_equals_eager_when_two_layers_inputs_coincide_on_one_step(coincide):
    """Eager shares Sigma between layers reading the same tensor, the compiled path between layers whose
    statistics are equal; with a statistics EMA both must give one result (weights 0.034 apart before)."""
    g = torch.Generator().manual_seed(2)
    xs = [(torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64))
          for _ in range(4)]
    xs[coincide] = (xs[coincide][0], xs[coincide][0].clone())      # equal values, distinct tensors
    out = {}
    for mode in ("eager", "compiled"):
        model = _TwoInputs().double()
        opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA, precond_ema=0.9)
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if mode == "compiled" else model
        for x1, x2 in xs:
            opt.zero_grad()
            forward(x1, x2).square().sum().backward()
            opt.step()
        out[mode] = ([p.detach().clone() for p in model.parameters()], sorted(opt.refresh.precond_ema.buffers))
    assert out["eager"][1] == out["compiled"][1] == ["a", "b"]
    for p, q in zip(out["eager"][0], out["compiled"][0]):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)


def test_layers_that_always_share_keep_one_ema_and_a_layer_that_leaves_takes_its_history():
    """q, k, v read one input on every step: one buffer. When k stops running, its EMA is the group's."""
    torch.manual_seed(0)
    q, k = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    model = nn.ModuleDict({"q": q, "k": k})
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=GAMMA, precond_ema=0.5)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        (q(x) * k(x)).sum().backward()
        opt.step()
    assert sorted(opt.refresh.precond_ema.buffers) == ["q|k"]
    shared = [b.clone() for b in next(iter(opt.refresh.precond_ema.buffers.values()))["sums"]]
    opt.zero_grad()
    q(x).sum().backward()                         # k does not run
    opt.step()
    assert sorted(opt.refresh.precond_ema.buffers) == ["k", "q"]
    assert opt.refresh.precond_ema.buffers["k"]["t"] == 2 and opt.refresh.precond_ema.buffers["q"]["t"] == 3
    torch.testing.assert_close(opt.refresh.precond_ema.buffers["k"]["sums"][0], shared[0], rtol=0, atol=0)


# ------------------------------------------------------------ 4. damping 0, rank-deficient Sigma
@pytest.mark.parametrize("seed", range(12))
def test_damping_zero_with_a_rank_deficient_sigma_stays_in_the_inputs_span(seed):
    """Batch 11, width 12 (13 with the homogeneous 1): Sigma has rank 11. The update is G Sigma^+, whose
    rows lie in the span of the inputs (up to 95% of it lay outside before)."""
    torch.manual_seed(seed)
    layer = nn.Linear(12, 3).double()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=1.0), damping=0.0)
    x = torch.randn(11, 12, dtype=torch.float64)
    (layer(x) - torch.randn(11, 3, dtype=torch.float64)).square().sum().backward()
    z = with_ones(x)
    g = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    opt.precondition()
    m = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    span = torch.linalg.qr(z.T).Q                                  # (13, 11): the inputs' span
    outside = m - (m @ span) @ span.T
    assert float(outside.norm() / m.norm()) < 1e-9
    sigma = z.T @ z / 11
    torch.testing.assert_close(m, g @ torch.linalg.pinv(sigma, hermitian=True), rtol=1e-7, atol=1e-10)
    assert opt.stats()["eigh_fallbacks"] == 1
