"""The AP health report (dopr/health.py): its numbers against a direct computation on a known spectrum,
a well-conditioned layer healthy, and no report unless asked."""
import math
import warnings

import pytest
import torch
from torch import nn

import dopr
from dopr.health import layer_health


def test_the_report_on_a_known_spectrum():
    v, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    e = torch.tensor([1.0, 1.0, 1e-3, 0.0], dtype=torch.float64)
    sigma, lam = v @ torch.diag(e) @ v.T, 1e-2
    g = torch.ones(3, 4, dtype=torch.float64) @ v.T               # G = 1 in every eigen-direction
    r = layer_health(sigma, lam, g)
    p = e[:3] / e.sum()
    assert r["dim"] == 4 and r["below_damping"] == 2
    assert r["effective_rank"] == pytest.approx(math.exp(-(p * p.log()).sum()), abs=0.01)
    assert r["amplification"] == pytest.approx((e.mean().item() + lam) / lam, abs=0.01)
    weights = 1 / (e + lam) ** 2                                    # |M v_i|^2 per row
    assert r["weak_share"] == pytest.approx((weights[3] / weights.sum()).item(), abs=1e-4)  # only e = 0 is weak


def _health(model, batches, damping):
    opt = dopr.build(model, "adamw", ap={"damping": damping, "health_every": 1}, lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loss in batches(model):
            opt.zero_grad()
            loss.backward()
            opt.step()
    return opt, [str(w.message) for w in caught if "weak directions" in str(w.message)]


def test_a_well_conditioned_layer_is_healthy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(2048, 32)
    opt, warned = _health(model, lambda m: [m(x).square().mean()], 1e-4)
    report = opt.stats()["health"]["0"]
    assert report["effective_rank"] > 25 and report["below_damping"] == 0 and report["weak_share"] == 0.0
    assert report["amplification"] < 5 and not warned


def test_no_report_unless_asked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = dopr.build(model, "adamw", ap={}, lr=1e-3)
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    assert "health" not in opt.stats()
