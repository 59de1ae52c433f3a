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


# 8. a step that raises under on_nonfinite="raise" leaves no trace
class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 5), nn.Linear(6, 5), nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x[0])) + torch.tanh(self.b(x[1]))).square().mean()


def _batches(n):
    g = torch.Generator().manual_seed(1)
    # weak directions in the inputs, so that the weak-share rules raise lambda
    scale = torch.tensor([1.0, 1.0, 1e-3, 1e-3, 1e-4, 1.0], dtype=torch.float64)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64) * scale,
             torch.randn(8, 6, generator=g, dtype=torch.float64) * scale) for _ in range(n)]


def _assert_same(a, b, where="state_dict"):
    """a == b bit for bit: nested dicts, lists and tuples of tensors and plain values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def _run(options, batches, bad_at=None):
    torch.manual_seed(0)
    model = _TwoInputs().double()
    opt = dopr.build(model, "dopr_adamw", lr=1e-2, damping=1e-6, on_nonfinite="raise", **options)
    for i, x in enumerate(batches):
        if i == bad_at:   # b's input has a NaN: its Sigma and head's are non-finite, a's is fine
            bad = (x[0], x[1].clone().index_fill_(0, torch.tensor([0]), float("nan")))
            model(bad).backward()
            with pytest.raises(FloatingPointError, match=r"non-finite (activation covariance|gradient) in DoPr layer\(s\)"):
                opt.step()
            opt.zero_grad()
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("options", [
    dict(weak_share_bound=0.1, health_every=2), dict(weak_share_bound=0.1, weak_share_estimate="filter"),
    dict(weak_share_bound=0.1, health_every=2, precond_ema=0.5, grad_ema=0.5, precond_every=2)],
    ids=["spectrum", "filter", "spectrum-emas-every2"])
def test_a_step_that_raises_leaves_no_trace(options):
    batches = _batches(6)
    for bad_at in (1, 2):   # before a refresh step with a health report, and before one without
        want_model, want = _run(options, batches)
        got_model, got = _run(options, batches, bad_at=bad_at)
        assert want.stats()["damping_raises"] > 0          # the rule binds: the scale is exercised
        assert got.stats() == want.stats()
        for p, q in zip(got_model.parameters(), want_model.parameters()):
            assert torch.equal(p, q)
        _assert_same(got.state_dict(), want.state_dict())


# 4. DoPr's checkpoint state cast on load to the layer's dtype and device
def _ap_tensors(state: dict) -> list:
    """[(where, tensor)] of DoPr's own state: EMA buffers and cached inverses."""
    out = [(f"grad_ema {k}", v["g"]) for k, v in state["grad_ema"].items()]
    out += [(f"precond_ema {k} {i}", s) for k, v in state["precond_ema"].items() for i, s in enumerate(v["sums"])]
    return out + [(f"cache {k} {n}", t) for k, v in state["cache"].items() for n, t in v["tensors"].items()]


def _mlp():
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))


def _train(model, opt, steps, dtype, device="cpu"):
    for _ in range(steps):
        model(torch.randn(12, 5, dtype=dtype, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("options", [dict(grad_ema=0.9), dict(precond_ema=0.9), dict(precond_every=3)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_float32_checkpoint_loads_into_a_float64_model_cast_as_torch_optim_casts(options):
    torch.manual_seed(0)
    model = _mlp()
    opt = dopr.build(model, "dopr_adamw", lr=1e-2, **options)
    _train(model, opt, 2, torch.float32)
    saved = opt.state_dict()
    assert _ap_tensors(saved["dopr"]) and all(t.dtype == torch.float32 for _, t in _ap_tensors(saved["dopr"]))

    model64 = _mlp().double()
    model64.load_state_dict(model.state_dict())
    opt64 = dopr.build(model64, "dopr_adamw", lr=1e-2, **options)
    opt64.load_state_dict(saved)
    loaded = dict(_ap_tensors(opt64.ap_state_dict()))
    for where, t in _ap_tensors(saved["dopr"]):   # float32 -> float64 is exact
        assert loaded[where].dtype == torch.float64 and torch.equal(loaded[where], t.double()), where
    assert opt64.state_dict()["state"][0]["exp_avg"].dtype == torch.float64   # torch.optim's own cast

    # the next step runs, from the cast state
    x = torch.randn(12, 5, dtype=torch.float64)
    model64(x).square().mean().backward()
    g, gbias = model64[2].weight.grad.clone(), model64[2].bias.grad.clone()
    opt64.step()
    after = opt64.ap_state_dict()
    assert opt64.stats()["steps"] == 3 and all(t.dtype == torch.float64 for _, t in _ap_tensors(after))
    if "grad_ema" in options:   # Gbar's buffer: beta * the cast buffer + (1 - beta) G, in float64
        want = 0.9 * saved["dopr"]["grad_ema"]["2"]["g"][:, :6].double() + 0.1 * g
        torch.testing.assert_close(after["grad_ema"]["2"]["g"][:, :6], want, rtol=4 * torch.finfo(torch.float64).eps, atol=0)
    if "precond_every" in options:   # a step between refreshes: M = [G, g_b] times the cast inverse
        p = saved["dopr"]["cache"]["2"]["tensors"]["p"].double()
        m = torch.cat([g, gbias[:, None]], 1) @ p       # homogeneous coordinates: the bias is column 7
        tol = 7 * torch.finfo(torch.float64).eps * float(m.abs().max())   # a dot product of 7 terms
        torch.testing.assert_close(model64[2].weight.grad, m[:, :6], rtol=0, atol=tol)
        torch.testing.assert_close(model64[2].bias.grad, m[:, 6], rtol=0, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU checkpoint -> CUDA model)")
@pytest.mark.parametrize("options", [dict(grad_ema=0.9), dict(precond_ema=0.9), dict(precond_every=3)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_checkpoint_loaded_to_the_cpu_resumes_on_cuda(options, tmp_path):
    """A one-GPU Hugging Face Trainer resume: the optimizer's state is loaded with map_location="cpu"."""
    torch.manual_seed(0)
    model = _mlp().cuda()
    opt = dopr.build(model, "dopr_adamw", lr=1e-2, **options)
    _train(model, opt, 2, torch.float32, "cuda")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    saved = torch.load(tmp_path / "optimizer.pt", map_location="cpu")
    assert all(t.device.type == "cpu" for _, t in _ap_tensors(saved["dopr"]))
    resumed = _mlp().cuda()
    resumed.load_state_dict(model.state_dict())
    opt2 = dopr.build(resumed, "dopr_adamw", lr=1e-2, **options)
    opt2.load_state_dict(saved)
    for where, t in _ap_tensors(opt2.ap_state_dict()):
        assert t.device.type == "cuda", where
    _train(resumed, opt2, 2, torch.float32, "cuda")
    assert opt2.stats()["steps"] == 4 and all(torch.isfinite(p).all() for p in resumed.parameters())
