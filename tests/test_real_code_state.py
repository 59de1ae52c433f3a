"""DoPr's state in real training code (issue 62, items 2, 3, 4 and 8): the cached factors of
precond_every > 1 across refreshes, layers of the same width in two dtypes, checkpoint state cast on
load to the layer's dtype and device, and a step that raises under on_nonfinite="raise" leaving no
trace. Each test failed on a7af4b7."""
import pytest
import torch
from torch import nn

import dopr
from dopr.solvers import SOLVERS
from reference import ap_reference


# 3. a float32 and a float64 layer of the same input width
class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(4, 3, bias=False).double()

    def forward(self, x):
        return self.a(x).square().sum() + self.b(x.double()).square().sum()


@pytest.mark.parametrize("options", [dict(solver=s) for s in SOLVERS] + [
    dict(precond_every=2), dict(weak_share_bound=0.5, weak_share_estimate="filter"),
    dict(weak_share_bound=0.5, health_every=1)], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_float32_and_a_float64_layer_of_one_width_each_get_their_own_ap(options):
    torch.manual_seed(0)
    model = _TwoDtypes()
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.1, **options)
    for _ in range(3):   # a refresh, a cached step (precond_every=2), a refresh
        x = torch.randn(16, 4)
        model(x).backward()
        g = {n: getattr(model, n).weight.grad.clone() for n in "ab"}
        refresh = opt.collecting                 # this step's Sigma, not a cached one
        opt.step()
        assert opt.stats()["no_forward"] == [] and model.a.weight.grad.dtype == torch.float32
        assert model.b.weight.grad.dtype == torch.float64
        if refresh and options.get("solver", "cholesky") in ("cholesky", "eigh") and "weak_share_bound" not in options:
            for n, dtype in (("a", torch.float32), ("b", torch.float64)):
                # A = Sigma + 0.1 tr(Sigma) I has condition <= 11: error ~ 11 * d * eps of the layer's dtype
                tol = 10 * 11 * 4 * torch.finfo(dtype).eps
                want = ap_reference(g[n], x, 0.1)
                torch.testing.assert_close(getattr(model, n).weight.grad.double(), want, rtol=tol,
                                           atol=tol * float(want.abs().max()))
        opt.zero_grad()
    assert opt.stats()["preconditioned"] == 6
