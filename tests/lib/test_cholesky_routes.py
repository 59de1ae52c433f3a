"""Issue 61, items 1-2: the Cholesky of a batch by size (a loop above a size, the same factor), and the
routes from a damped covariance to M = G A^-1 (two triangular solves, or an explicit inverse by potri or by
the GEMM-bound blocked Cholesky, applied by one GEMM): the same M, the same trouble flags, the same repair."""
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dopr import DoPr, inverse, solvers

pytestmark = pytest.mark.numerics


def _activations(n: int, d: int, rank: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    """n samples [z; 1] of low-rank-plus-noise activations: `rank` strong directions with scales falling
    as 1/i over a 1e-3 noise floor, a nonzero mean, and the homogeneous coordinate (DoPr's Linear layers)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(d - 1, rank, generator=gen, **f64))
    scale = 1.0 / torch.arange(1, rank + 1, **f64)
    z = (torch.randn(n, rank, generator=gen, **f64) * scale) @ basis.T + 1e-3 * torch.randn(n, d - 1, generator=gen, **f64)
    z = z + 0.3 * torch.randn(d - 1, generator=gen, **f64)
    return torch.cat([z, torch.ones(n, 1, **f64)], 1).to(dtype)


def _problem(n: int, d: int, rows: int, gamma: float, dtype=torch.float32, batch: int = 2):
    """(Sigma (B, d, d), lam (B,), G (B, rows, d)): Sigma = Z^T Z / n, lam = gamma tr(Sigma) (damping_mode
    'trace'), G = D^T Z / n from back-propagated errors D, as a Linear layer's gradient is formed."""
    zs = [_activations(n, d, rank=max(2, min(n, d) // 4), dtype=dtype, seed=s) for s in range(batch)]
    sigma = torch.stack([z.mT @ z / n for z in zs])
    lam = gamma * sigma.diagonal(dim1=-2, dim2=-1).sum(-1)
    gen = torch.Generator().manual_seed(7)
    g = torch.stack([torch.randn(n, rows, generator=gen, dtype=dtype).mT @ z / n for z in zs])
    return sigma, lam, g


def _solve(route: str, sigma, lam, g, counts=None, rcond=1e-6):
    """M of a whole batch through CholeskyBatch by one route, repair path included."""
    counts = defaultdict(int) if counts is None else counts
    ops = solvers.CholeskyBatch(sigma.clone(), lam, rcond, route=route).finish(counts)
    return solvers.apply_stack(ops, g)


def _reference(sigma, lam, g):
    a = sigma.double() + lam.double()[:, None, None] * torch.eye(sigma.shape[-1], dtype=torch.float64)
    return torch.cholesky_solve(g.double().mT, torch.linalg.cholesky(a)).mT


def _err(m, ref):
    return float((m.double() - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------ item 1: Cholesky by size
def test_a_batch_above_the_loop_size_is_factored_one_member_at_a_time_with_the_same_factor(monkeypatch):
    sigma, lam, _ = _problem(64, 48, 8, 1e-4, batch=4)
    a = sigma + lam[:, None, None] * torch.eye(48)
    a[1, 30, 30] = -1.0                       # indefinite: info 31
    a[2, 5, 9] = a[2, 9, 5] = float("nan")    # non-finite
    batched = torch.linalg.cholesky_ex(a)
    calls = []
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda x, **kw: calls.append(x.shape) or real(x, **kw))
    monkeypatch.setitem(solvers.CHOLESKY_LOOP_FROM, "cpu", 48)
    looped = solvers.cholesky_by_size(a)
    assert calls == [torch.Size([48, 48])] * 4
    torch.testing.assert_close(looped[0], batched[0], rtol=0, atol=0, equal_nan=True)   # bit for bit
    assert torch.equal(looped[1], batched[1]) and looped[1].tolist()[1] == 31 and looped[1].tolist()[2] > 0
    calls.clear()
    monkeypatch.setitem(solvers.CHOLESKY_LOOP_FROM, "cpu", 49)                             # below: one call
    assert torch.equal(solvers.cholesky_by_size(a)[1], batched[1]) and calls == [torch.Size([4, 48, 48])]
    calls.clear()
    monkeypatch.setitem(solvers.CHOLESKY_LOOP_FROM, "cpu", 2)
    solvers.CholeskyBatch(sigma.clone(), lam, 1e-6, route="cholesky_solve")
    assert calls == [torch.Size([48, 48])] * 4                                            # the optimizer's path


# ------------------------------------------------------------------------------ item 2: the routes
@pytest.mark.parametrize("d, block", [(300, inverse.BLOCK), (130, 16)])
def test_every_route_gives_the_same_m_in_float64(monkeypatch, d, block):
    monkeypatch.setattr(inverse, "BLOCK", block)   # d = 130 over blocks of 16: four levels of recursion
    sigma, lam, g = _problem(2 * d, d, 40, 1e-4, dtype=torch.float64, batch=3)
    ref = _solve("cholesky_solve", sigma, lam, g)
    for route in ("cholesky_inverse", "blocked_inverse"):
        # float64: ~cond(A) * 2^-53 * d at cond ~1e4 is 1e-10 at most
        assert _err(_solve(route, sigma, lam, g), ref.double()) < 1e-10, route


def test_the_blocked_inverse_is_gemm_work_as_its_docstring_counts():
    """The GEMMs of blocked_inverse at d = 1024 over blocks of 256 (two levels): 4/3 d^3 (1 - 4^-2) to
    form L^-1 (the base cases are trsm, not counted) and 2 d^3 for L^-T L^-1."""
    a = torch.eye(1024).expand(1, 1024, 1024).contiguous()
    with FlopCounterMode(display=False) as counter:
        inverse.blocked_inverse(a, block=256)
    assert counter.get_total_flops() == round((4 / 3 * (1 - 4.0**-2) + 2) * 1024**3)


@pytest.mark.parametrize("gamma", [1e-4, 1e-6])
@pytest.mark.parametrize("n, d", [(64, 257), (1024, 257)])   # fewer samples than dimensions, and more
def test_the_explicit_inverse_routes_keep_m_within_10x_of_the_triangular_solves_error(gamma, n, d):
    sigma, lam, g = _problem(n, d, 96, gamma)
    ref = _reference(sigma, lam, g)
    today = _err(_solve("cholesky_solve", sigma, lam, g), ref)
    for route in ("cholesky_inverse", "blocked_inverse"):
        assert _err(_solve(route, sigma, lam, g), ref) <= 10 * today, (route, today)


def _troubled_batch(d=300):
    """Sigma (6, d, d) float32 and lam: good, indefinite past what lam covers (fails at column 281, in the
    blocked route's second block), NaN, one whose pivot 281 rounds under lam / 2 (Sigma's entry -0.7 lam),
    and at damping 0 a good one and a singular one (a dead input: zero row and column 290)."""
    sigma, lam, _ = _problem(4 * d, d, 8, 1e-4, batch=6)
    for i, v in ((1, -1e4), (3, -0.7)):
        sigma[i, 280, :] = sigma[i, :, 280] = 0
        sigma[i, 280, 280] = v * lam[i]
    sigma[2, 10, 200] = sigma[2, 200, 10] = float("nan")
    sigma[4:] = sigma[0] + 1e-2 * torch.eye(d)      # undamped: well conditioned but for the dead input of 5
    sigma[5, 290, :] = sigma[5, :, 290] = 0
    lam[4:] = 0
    return sigma, lam


def test_every_route_flags_the_same_trouble_and_repairs_it_the_same_way():
    sigma, lam = _troubled_batch()
    finite = sigma.diagonal(dim1=-2, dim2=-1).isfinite().all(-1) & sigma.isfinite().all(-1).all(-1)
    flags, counts, ops = {}, {}, {}
    for route in solvers.CHOLESKY_ROUTES:
        batch = solvers.CholeskyBatch(sigma.clone(), lam, 1e-6, route=route)
        flags[route] = [x.tolist() for x in (batch.bad, batch.weak, batch.singular, batch.trouble)]
        counts[route] = defaultdict(int)
        ops[route] = batch.finish(counts[route], finite)
    expect = [[False, True, True, True, False, False],        # bad: failed (indefinite, NaN) or weak
              [False, False, False, True, False, False],      # weak: the pivot under lam / 2
              [False, False, False, False, False, True],      # singular at damping 0
              [False, True, True, True, False, True]]         # trouble: any of them
    assert all(f == expect for f in flags.values()), flags
    # the repair: the weak one succeeds at 10x lam, the indefinite one never does (eigh), nor the singular one
    assert all(dict(c) == {"unreliable_factors": 1, "cholesky_retries": 4, "eigh_fallbacks": 2}
               for c in counts.values()), counts
    d = sigma.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    g = torch.randn(8, d)
    pinv = solvers.pseudo_inverse(sigma[[1, 5]].double(), lam[[1, 5]].double(), 1e-6)
    for i, want in ((0, None), (1, pinv[0]), (3, None), (4, None), (5, pinv[1])):
        if want is None:                          # a factor: lam as retried (x10 for member 3)
            want = torch.linalg.inv(sigma[i].double() + float(lam[i]) * (10.0 if i == 3 else 1.0) * eye)
        e = torch.linalg.eigvalsh(want)
        cond = float(e[-1] / e[e > 0][0])         # on the span the (pseudo-)inverse acts on
        for route, members in ops.items():        # a float32 solve's normwise bound: cond * d * u
            assert _err(members[i].apply(g), g.double() @ want) < cond * d * 2.0**-24, (route, i, cond)


def test_the_blocked_route_reads_nothing_back_to_the_host(monkeypatch):
    sigma, lam = _troubled_batch()

    def sync(*args, **kwargs):
        raise AssertionError("a host sync")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    batch = solvers.CholeskyBatch(sigma.clone(), lam, 1e-6, route="blocked_inverse")
    solvers.apply_stack(batch.ops(), torch.randn(6, 8, sigma.shape[-1]))
    monkeypatch.undo()
    assert batch.trouble.tolist() == [False, True, True, True, False, True]


def test_explicit_inverses_of_one_batch_are_applied_as_the_batch_is():
    p = torch.randn(3, 5, 5)
    g = torch.randn(3, 4, 5)
    ops = [solvers.ExplicitInverse(batch=p, index=i) for i in range(3)]
    torch.testing.assert_close(solvers.apply_stack(ops, g), g @ p, rtol=0, atol=0)
    reordered = [ops[2], ops[0]]                                   # members out of order: stacked
    torch.testing.assert_close(solvers.apply_stack(reordered, g[:2]), g[:2] @ p[[2, 0]], rtol=0, atol=0)
    assert solvers.operator_state(ops[1])["tensors"]["p"].equal(p[1])


# ------------------------------------------------------------------------------ the rule
def test_the_route_is_the_measured_tables_nearest_point_or_the_flop_default(monkeypatch):
    monkeypatch.setitem(solvers.CHOLESKY_ROUTE_TABLE, "cpu", {(256, 256): "cholesky_inverse",
                                                              (4096, 4096): "blocked_inverse",
                                                              (4096, 64): "cholesky_solve"})
    assert solvers.cholesky_route("cpu", 300) == "cholesky_inverse"
    assert solvers.cholesky_route("cpu", 3000, 2900) == "blocked_inverse"
    assert solvers.cholesky_route("cpu", 3000, 50) == "cholesky_solve"
    # rows / d = 1.7, past the measured 1/64..1 (issue 73: never extrapolated): the CPU's FLOP default
    assert solvers.cholesky_route("cpu", 3000, 5000) == solvers.flop_route("cpu", 3000, 5000) == "cholesky_solve"
    monkeypatch.setitem(solvers.CHOLESKY_ROUTE_TABLE, "cpu", "blocked_inverse")   # forced for every size
    assert solvers.cholesky_route("cpu", 16, 1) == "blocked_inverse"
    monkeypatch.delitem(solvers.CHOLESKY_ROUTE_TABLE, "cuda", raising=False)
    # FLOP default (KERNEL_RATES: trsm at 1/10 of a GEMM's rate, potrf 1/4): square layers go to GEMMs;
    # few rows, where the d^3 work dominates, stay with potrf + trsm. The crossover, from route_cost:
    # 2 d^2 r (10 - 1) = d^3 (10/3 - 4/3), r = d / 9.
    assert solvers.cholesky_route("cuda", 4096) == "blocked_inverse"
    assert solvers.cholesky_route("cuda", 4096, 4096 // 9 + 8) == "blocked_inverse"
    assert solvers.cholesky_route("cuda", 4096, 4096 // 9 - 8) == "cholesky_solve"


def test_dopr_on_a_forced_route_takes_the_same_step(monkeypatch):
    torch.manual_seed(0)
    x = _activations(96, 41, 8, dtype=torch.float64)[:, :40]
    grads = {}
    for route in solvers.CHOLESKY_ROUTES:
        monkeypatch.setitem(solvers.CHOLESKY_ROUTE_TABLE, "cpu", route)
        model = nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3)).double()
        torch.manual_seed(1)
        for p in model.parameters():
            nn.init.normal_(p, std=0.2)
        opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0))
        model(x).pow(2).sum().backward()
        opt.precondition()
        grads[route] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for route in ("cholesky_inverse", "blocked_inverse"):
        assert _err(grads[route], grads["cholesky_solve"]) < 1e-10, route
