"""Layer types and transforms real code uses (issue "Safe on a cluster and in real code", section 2):
parametrized weights, layers that see no sample in a step, torch.func transforms, a bias frozen or
thawed mid-run under the EMAs, and an infinite damping. Each test failed on 705145b (but the NaN and
negative dampings, refused there already)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import dopr


def _step(model, opt, x, loss=lambda out: out.square().mean()):
    loss(model(x)).backward()
    opt.step()
    opt.zero_grad()


# 1. weight_norm / spectral_norm: the weight is computed from other parameters
@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm", "legacy_weight_norm"])
def test_a_parametrized_weight_is_skipped_with_its_reason_and_the_rest_is_preconditioned(wrap):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # the legacy weight_norm's deprecation
        norm = {"weight_norm": parametrizations.weight_norm, "spectral_norm": parametrizations.spectral_norm,
                "legacy_weight_norm": nn.utils.weight_norm}[wrap]
        model = nn.Sequential(norm(nn.Conv1d(3, 8, 3, padding=1)), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 6, 4),
                              nn.Tanh(), norm(nn.Linear(4, 2)))
        emb = norm(nn.Embedding(10, 3))
    whole = nn.ModuleDict({"emb": emb, "net": model})
    opt = dopr.build(whole, "adamw", ap={}, lr=1e-2)
    cov = {e.name: e for e in opt.coverage()}
    for name in ("net.0", "net.5", "emb"):
        assert cov[name].status == "skipped" and "parametrization such as weight_norm" in cov[name].reason
    assert cov["net.3"].status == "preconditioned"
    before = [p.detach().clone() for p in whole.parameters()]
    for _ in range(2):
        out = model(emb(torch.randint(10, (5, 6))).transpose(1, 2))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["preconditioned"] == 2
    assert all(torch.isfinite(p).all() for p in whole.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, whole.parameters()))


# 2. a layer that receives no sample in a step
class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x, mask):
        h = torch.tanh(self.body(x))
        return self.head(h[mask]).square().sum() + h.square().mean()


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "newton_schulz", "rank1_diag", "rankk_diag"])
def test_a_layer_with_no_sample_this_step_gets_its_raw_gradient_on_every_solver(solver):
    torch.manual_seed(0)
    model = _Masked()
    opt = dopr.build(model, "sgd", ap={"solver": solver, "rank": 2}, lr=0.1, momentum=0.0)
    x = torch.randn(8, 6)
    model(x, torch.ones(8, dtype=torch.bool)).backward()
    opt.step()
    opt.zero_grad()
    head = model.head.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"no samples this step for \['head'\]"):
        model(x, torch.zeros(8, dtype=torch.bool)).backward()
        assert torch.equal(model.head.weight.grad, torch.zeros_like(head))   # no sample, no gradient
        opt.step()
    assert torch.equal(model.head.weight, head)          # its raw (zero) gradient: SGD leaves it
    stats = opt.stats()
    assert stats["no_samples"] == ["head"] and stats["nonfinite_skips"] == 0 and stats["no_forward"] == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


# 3. torch.func transforms
def test_per_sample_gradients_with_torch_func_run_and_are_named_in_the_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = dopr.build(model, "sgd", ap={}, lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 4), torch.randn(6, 1)

    def loss(p, xi, yi):
        return F.mse_loss(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)  # crashed in gram
    for k, p in model.named_parameters():
        p.grad = per_sample[k].mean(0)
    with pytest.warns(RuntimeWarning, match="torch.func transform"):
        opt.step()
    assert opt.stats()["no_forward"] == ["0", "2"]


def test_a_vmapped_training_forward_is_named_for_what_it_is():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = dopr.build(model, "sgd", ap={}, lr=0.1)
    torch.func.vmap(model)(torch.randn(3, 5, 4)).square().mean().backward()
    with pytest.warns(RuntimeWarning, match="torch.func transform") as record:
        opt.step()
    assert "eval() mode" not in str(record[0].message)


# 4. a bias frozen or thawed mid-run under the EMAs
@pytest.mark.parametrize("first", [True, False])
def test_freezing_or_thawing_a_bias_mid_run_restarts_that_layers_emas(first):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].bias.requires_grad_(first)
    opt = dopr.build(model, "adamw", ap={"grad_ema": 0.9, "precond_ema": 0.9}, lr=1e-2)
    x = torch.randn(16, 7)
    _step(model, opt, x)
    _step(model, opt, x)
    model[0].bias.requires_grad_(not first)       # homogeneous dim 8 <-> 7: crashed with a size mismatch
    if not first:                                 # dopr.build left the frozen bias out of the base optimizer
        opt.add_param_group({"params": [model[0].bias]})
    with pytest.warns(RuntimeWarning, match="froze or thawed their bias"):
        _step(model, opt, x)
    _step(model, opt, x)
    dims = {e.name: e.dim for e in opt.coverage() if e.status == "preconditioned"}
    assert dims["0"] == (7 if first else 8)
    assert opt.apply.grad_ema.buffers["0"]["t"] == 1 and opt.apply.grad_ema.buffers["0"]["g"].shape == (5, dims["0"])
    assert opt.apply.grad_ema.buffers["2"]["t"] == 4      # the other layer's history goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


# 5. an infinite damping
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_an_infinite_or_nan_or_negative_damping_is_refused_by_name(bad):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="Invalid damping"):
        dopr.build(model, "sgd", ap={"damping": bad}, lr=0.1)
