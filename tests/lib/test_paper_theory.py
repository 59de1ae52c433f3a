"""The paper's theory, through the library: affine invariance and the feature-learning worked example's one step."""
import math

import pytest
import torch
from torch import nn

from dopr import DoPr
from dopr.gp import SGD

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _mlp(width=64):
    return nn.Sequential(nn.Linear(32, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 10)).double()


def _trajectories(use_dopr: bool, steps=50, lr=0.05):
    """Validation-loss trajectories on x and on Qx + d, first layer (W Q^-1, b - W Q^-1 d)."""
    g = torch.Generator().manual_seed(1)
    d_in = 32
    o, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
    cov_sqrt = o @ torch.diag(torch.logspace(0, 1, d_in, dtype=torch.float64)) @ o.T  # eigenvalues 1..100
    x = torch.randn(1280, d_in, generator=g, dtype=torch.float64) @ cov_sqrt
    teacher = nn.Sequential(nn.Linear(d_in, 64), nn.GELU(), nn.Linear(64, 10)).double()
    with torch.no_grad():
        y = teacher(x)
    u, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
    q = u @ torch.diag(torch.linspace(1, 100, d_in, dtype=torch.float64)) @ u.T  # symmetric, eigenvalues 1..100
    shift = torch.randn(d_in, generator=g, dtype=torch.float64)
    xt = x @ q.T + shift
    a = _mlp()
    b = _mlp()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        w, bias = a[0].weight, a[0].bias
        qinv = torch.linalg.inv(q)
        b[0].weight.copy_(w @ qinv)
        b[0].bias.copy_(bias - w @ qinv @ shift)
    train, val = slice(0, 1024), slice(1024, None)
    curves = []
    for model, inputs in ((a, x), (b, xt)):
        base = SGD(model.parameters(), lr=lr, momentum=0.0)
        opt = DoPr(model, base, damping=0.0) if use_dopr else base
        losses = []
        for step in range(steps):
            batch = slice((step % 4) * 256, (step % 4 + 1) * 256)
            xb, yb = inputs[train][batch], y[train][batch]
            loss = ((model(xb) - yb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append(((model(inputs[val]) - y[val]) ** 2).mean().item())
        curves.append(torch.tensor(losses, dtype=torch.float64))
    return curves


def test_dopr_sgd_is_invariant_to_affine_input_transforms_and_sgd_is_not():
    a, b = _trajectories(use_dopr=True)
    assert torch.isfinite(a).all() and a[-1] < a[0]
    assert (a - b).abs().max() / a.abs().max() < 1e-9
    s, t = _trajectories(use_dopr=False, lr=1e-4)
    assert (s - t).abs().max() / s.abs().max() > 1e-2


def _subspace_distance(g_theta, p_perp):
    """The paper's worked example evaluates ||G_theta P_perp||_op (G_theta row-orthonormal at start)."""
    return torch.linalg.matrix_norm(g_theta @ p_perp, ord=2).item()


def _one_step(use_dopr):
    """G_theta = [1/2, sqrt(3)/2], G_* = [1, 0], Sigma_s = [[5, 2], [2, 1]], F = F_* = 1, eta = 1."""
    sigma = torch.tensor([[5.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
    x = torch.linalg.cholesky(sigma).T * math.sqrt(2)  # 2 samples with X^T X / 2 = Sigma_s exactly
    g_star = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    layer = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, math.sqrt(3) / 2]], dtype=torch.float64))
    base = SGD(layer.parameters(), lr=1.0, momentum=0.0)
    opt = DoPr(layer, base, damping=0.0) if use_dopr else base
    # L = 1/2 E ||(G - G_*) s||^2, so grad = (G - G_*) Sigma_s, the paper's GD step
    loss = 0.5 * ((layer(x) - x @ g_star.T) ** 2).mean(0).sum()
    loss.backward()
    opt.step()
    return layer.weight.detach()


def test_worked_example_gd_raises_the_subspace_distance_and_ap_contracts_it():
    p_perp = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    g0 = torch.tensor([[0.5, math.sqrt(3) / 2]], dtype=torch.float64)
    assert math.isclose(_subspace_distance(g0, p_perp), math.sqrt(3) / 2)
    assert math.isclose(_subspace_distance(_one_step(False), p_perp), 1.0, rel_tol=1e-12)
    g_ap = _one_step(True)
    assert _subspace_distance(g_ap, p_perp) < 1e-12  # eta = 1, F^T F = 1: one AP step lands on G_*
    torch.testing.assert_close(g_ap, torch.tensor([[1.0, 0.0]], dtype=torch.float64))
