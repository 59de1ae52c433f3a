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
    ns = solvers.factor_newton_schulz(sigma, lam)
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
