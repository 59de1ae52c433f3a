"""The GEMM-only inverse (solver="newton_schulz", issue "dopr at scale"): against the Cholesky solve on
random SPD matrices, ill-conditioned ones included, and as DoPr's solver end to end."""
from collections import defaultdict

import pytest
import torch
from torch import nn

import dopr
from dopr import solvers

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


@pytest.mark.parametrize("damping", [1e-2, 1e-4, 1e-6])
def test_newton_schulz_inverse_matches_the_cholesky_solve(damping):
    torch.manual_seed(0)
    d = 48
    # rank-deficient (n < d) covariances with a spread of scales: condition numbers near 1 / damping
    x = torch.randn(4, 30, d, dtype=torch.float64) * torch.logspace(0, 3, d, dtype=torch.float64)
    sigma = x.transpose(-1, -2) @ x / 30
    lam = damping * sigma.diagonal(dim1=-2, dim2=-1).sum(-1)
    ns = solvers.NewtonSchulzBatch(sigma, lam, 0.0).ops()
    ch = solvers.factor_cholesky(sigma.clone(), lam, 1e-6, defaultdict(int))  # damps its input in place
    g = torch.randn(7, d, dtype=torch.float64)
    for a, b in zip(ns, ch):
        ref = b.apply(g)
        assert float((a.apply(g) - ref).norm() / ref.norm()) < 1e-9
    # and it is the inverse: (Sigma + lam I) X = I
    a = sigma[0] + lam[0] * torch.eye(d, dtype=torch.float64)
    torch.testing.assert_close(a @ ns[0].apply(torch.eye(d, dtype=torch.float64)),
                               torch.eye(d, dtype=torch.float64), atol=1e-8, rtol=0)


def test_dopr_with_the_newton_schulz_solver_steps_like_cholesky():
    out = {}
    for solver in ("cholesky", "newton_schulz"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()
        opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1), solver=solver)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(32, 6, generator=g, dtype=torch.float64) * torch.tensor([5.0, 1, 1, 0.1, 0.01, 2],
                                                                                 dtype=torch.float64)
            nn.functional.mse_loss(m(x), torch.randn(32, 2, generator=g, dtype=torch.float64)).backward()
            opt.step()
            opt.zero_grad()
        out[solver] = [p.detach().clone() for p in m.parameters()]
    for a, b in zip(out["cholesky"], out["newton_schulz"]):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_newton_schulz_error_grows_like_u_cond_not_u_cond_squared():
    """Issue 73, N4: M = G X with X = A^-1 (I - R), so |dM| / |M| <= |R| ~ d u cond (the last step's GEMMs,
    each within d u |A| |X|). Symmetrising X put the rounding on the right, where a G along A's top direction
    sees it amplified by cond once more (cond 1e4, d = 2, float32: 0.5 off)."""
    torch.manual_seed(0)
    u, d, cond = 2.0**-24, 2, 1e4
    worst = 0.0
    for _ in range(50):
        q, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))
        sigma = ((q * torch.tensor([1.0, 1 / cond], dtype=torch.float64)) @ q.T).float()
        lam = torch.tensor([1e-12])
        g = (q[:, 0] + 1e-3 * torch.randn(d, dtype=torch.float64))[None]        # along the top eigenvector
        ref = g @ torch.linalg.inv(sigma.double() + 1e-12 * torch.eye(d, dtype=torch.float64))
        m = solvers.NewtonSchulzBatch(sigma[None], lam, 0.0).ops()[0].apply(g.float()).double()
        worst = max(worst, float((m - ref).norm() / ref.norm()))
    assert worst <= 2 * 2 * d * u * cond, worst       # two GEMMs per step, each d u cond; a factor 2 of slack


def test_a_diverged_newton_schulz_is_counted_and_solved_by_cholesky():
    """Issue 73, N4: absolute damping 1e-3 on float32 inputs spanning 1e+-4 (u cond >> 1): the iteration diverged
    to a NaN M with nothing counted. Its residual |I - A X| now flags it: counted in unreliable_factors, solved
    by the Cholesky path (M as solver="cholesky" gives it)."""
    out = {}
    for solver in ("cholesky", "newton_schulz"):
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.0), solver=solver, damping=1e-3,
                        damping_mode="absolute")
        x = torch.randn(5, 3, dtype=torch.float64) * torch.logspace(-4, 4, 3, dtype=torch.float64)
        (m(x.float()) - 1).square().mean().backward()
        opt.step()
        out[solver] = (m.weight.grad.clone(), opt.stats())
    (m_ch, st_ch), (m_ns, st_ns) = out["cholesky"], out["newton_schulz"]
    assert st_ns["unreliable_factors"] == st_ch["unreliable_factors"] + 1
    assert bool(m_ns.isfinite().all())
    torch.testing.assert_close(m_ns, m_ch, rtol=1e-6, atol=0)
