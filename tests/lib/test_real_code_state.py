"""DoPr's state in real training code (issue 62, items 2, 3, 4 and 8): the cached factors of
precond_every > 1 across refreshes, layers of the same width in two dtypes, checkpoint state cast on
load to the layer's dtype and device, and a step that raises under on_nonfinite="raise" leaving no
trace. Each test failed on a7af4b7."""
import contextlib
import warnings

import pytest
import torch
from torch import nn

import dopr
from dopr.solvers import SOLVERS
from reference import ap_reference, assert_within, cholesky_ap_error_bound, gamma, matmul_error_bound


# 3. a float32 and a float64 layer of the same input width
class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(4, 3, bias=False).double()

    def forward(self, x):
        return self.a(x).square().sum() + self.b(x.double()).square().sum()


@pytest.mark.numerics   # against bounds counted from the roundings: run again under other kernels (make test-kernels)
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
                want, got = ap_reference(g[n], x, 0.1), getattr(model, n).weight.grad.double()
                if options.get("solver", "cholesky") == "cholesky":   # the rounding of each step, counted
                    assert_within(got, want, cholesky_ap_error_bound(got, want, x, 0.1, dtype))
                    continue
                # eigh: LAPACK states its backward error as O(eps) ||A|| with no constant, so this is an estimate,
                # not a bound: A = Sigma + 0.1 tr(Sigma) I has condition <= 11, error ~ 11 * d * eps of the dtype
                tol = 10 * 11 * 4 * torch.finfo(dtype).eps
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
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
    opt = dopr.build(model, "adamw", ap={"damping": 1e-6, "on_nonfinite": "raise", **options}, lr=1e-2)
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


@pytest.mark.numerics   # against bounds counted from the roundings: run again under other kernels (make test-kernels)
@pytest.mark.parametrize("options", [dict(grad_ema=0.9), dict(precond_ema=0.9), dict(precond_every=3)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_float32_checkpoint_loads_into_a_float64_model_cast_as_torch_optim_casts(options):
    torch.manual_seed(0)
    model = _mlp()
    opt = dopr.build(model, "adamw", ap=options, lr=1e-2)
    _train(model, opt, 2, torch.float32)
    saved = opt.state_dict()
    assert _ap_tensors(saved["dopr"]) and all(t.dtype == torch.float32 for _, t in _ap_tensors(saved["dopr"]))

    model64 = _mlp().double()
    model64.load_state_dict(model.state_dict())
    opt64 = dopr.build(model64, "adamw", ap=options, lr=1e-2)
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
        beta, buf = 0.9, saved["dopr"]["grad_ema"]["2"]["g"][:, :6].double()
        want = beta * buf + (1 - beta) * g
        # two sums of two rounded products, DoPr's and this one: each within gamma_2 (beta |buf| + (1 - beta) |g|)
        # of the exact value, entry by entry (relative to |want| is no bound where the two terms cancel)
        bound = 2 * gamma(2, torch.float64) * (beta * buf.abs() + (1 - beta) * g.abs())
        assert_within(after["grad_ema"]["2"]["g"][:, :6], want, bound)
    if "precond_every" in options:   # a step between refreshes: M = [G, g_b] times the cast inverse
        p = saved["dopr"]["cache"]["2"]["tensors"]["p"].double()
        gh = torch.cat([g, gbias[:, None]], 1)          # homogeneous coordinates: the bias is column 7
        m = gh @ p
        # DoPr's GEMM and this one, each within gamma_7 |[G, g_b]| |P| of the exact product (7-term dot products)
        bound = 2 * matmul_error_bound(gh, p, torch.float64)
        assert_within(torch.cat([model64[2].weight.grad, model64[2].bias.grad[:, None]], 1), m, bound)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU checkpoint -> CUDA model)")
@pytest.mark.parametrize("options", [dict(grad_ema=0.9), dict(precond_ema=0.9), dict(precond_every=3)],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_checkpoint_loaded_to_the_cpu_resumes_on_cuda(options, tmp_path):
    """A one-GPU Hugging Face Trainer resume: the optimizer's state is loaded with map_location="cpu"."""
    torch.manual_seed(0)
    model = _mlp().cuda()
    opt = dopr.build(model, "adamw", ap=options, lr=1e-2)
    _train(model, opt, 2, torch.float32, "cuda")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    saved = torch.load(tmp_path / "optimizer.pt", map_location="cpu")
    assert all(t.device.type == "cpu" for _, t in _ap_tensors(saved["dopr"]))
    resumed = _mlp().cuda()
    resumed.load_state_dict(model.state_dict())
    opt2 = dopr.build(resumed, "adamw", ap=options, lr=1e-2)
    opt2.load_state_dict(saved)
    for where, t in _ap_tensors(opt2.ap_state_dict()):
        assert t.device.type == "cuda", where
    _train(resumed, opt2, 2, torch.float32, "cuda")
    assert opt2.stats()["steps"] == 4 and all(torch.isfinite(p).all() for p in resumed.parameters())


# 2. precond_every > 1: each layer keeps its last good factor until it has a new one
class _Heads(nn.Module):
    """A trunk and two heads reading its output (one statistics group when both run)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3, bias=False), nn.Linear(6, 3, bias=False)

    def inputs(self, x):
        return torch.tanh(self.trunk(x))

    def forward(self, x, heads="ab"):
        h = self.inputs(x)
        return sum(getattr(self, n)(h).square().mean() for n in heads)


def _heads(**options):
    torch.manual_seed(0)
    model = _Heads().double()
    # lr 0: the weights stay, so each step's head inputs can be recomputed for the reference
    return model, dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.1, **options)


def _head_step(model, opt, x, heads):
    """One step; returns {head: (its raw G, its M)} for the heads that ran."""
    model(x, heads).backward()
    g = {n: getattr(model, n).weight.grad.clone() for n in heads}
    opt.step()
    out = {n: (g[n], getattr(model, n).weight.grad.clone()) for n in heads}
    opt.zero_grad()
    return out


def _assert_ap(g, m, z):
    """m = G (Sigma + 0.1 tr(Sigma) I)^-1 with Sigma from the inputs z: condition <= 11, float64."""
    want = ap_reference(g, z, 0.1)
    tol = 10 * 11 * z.shape[1] * torch.finfo(torch.float64).eps
    torch.testing.assert_close(m, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_a_head_absent_on_a_refresh_step_keeps_its_factor_and_a_changed_group_is_split():
    model, opt = _heads(precond_every=3)
    xs = [torch.randn(16, 5, dtype=torch.float64) for _ in range(5)]
    runs = ["ab", "b", "a", "a", "b"]        # step 3 refreshes without b; a and b shared a group at step 0
    got = [_head_step(model, opt, x, heads) for x, heads in zip(xs, runs)]
    z0, z3 = model.inputs(xs[0]).detach(), model.inputs(xs[3]).detach()
    _assert_ap(*got[1]["b"], z0)
    _assert_ap(*got[3]["a"], z3)
    _assert_ap(*got[4]["b"], z0)             # step 0's factor, not dropped by the refresh at step 3
    assert opt.stats()["preconditioned"] == 11 and opt.stats()["no_forward"] == []


def test_a_head_never_run_on_a_refresh_step_is_factored_from_the_next_collecting_step():
    model, opt = _heads(precond_every=2)     # a on the refresh steps, b between them
    xs = [torch.randn(16, 5, dtype=torch.float64) for _ in range(6)]
    with pytest.warns(RuntimeWarning, match=r"layers \['b'\] have a gradient but no factor yet"):
        got = [_head_step(model, opt, x, "ab"[i % 2]) for i, x in enumerate(xs)]
    g, m = got[1]["b"]
    assert torch.equal(g, m)                 # step 1: no factor yet, raw
    _assert_ap(*got[3]["b"], model.inputs(xs[3]).detach())   # statistics gathered at step 3, b's next run
    _assert_ap(*got[5]["b"], model.inputs(xs[3]).detach())   # and kept
    assert opt.stats()["refreshes"] == 3      # step 3 factored b without being a refresh


def test_a_non_finite_sigma_on_a_refresh_step_loses_the_ap_for_that_step_only():
    model, opt = _heads(precond_every=3)
    xs = [torch.randn(16, 5, dtype=torch.float64) for _ in range(6)]
    big = torch.zeros(6, dtype=torch.float64)
    big[0] = 1e200                           # b's Sigma overflows to inf, its G stays finite

    def step(i, poisoned):
        h = model.inputs(xs[i])
        loss = model.a(h).square().mean() + model.b(h + big if poisoned else h).sum()
        loss.backward()
        g = model.b.weight.grad.clone()
        opt.step()
        m = model.b.weight.grad.clone()
        opt.zero_grad()
        return g, m, (h + big if poisoned else h).detach()

    with pytest.warns(RuntimeWarning, match=r"non-finite activation covariance in \['b'\]"):
        g0, m0, _ = step(0, True)            # the first refresh: no factor before it
    assert torch.equal(g0, m0)
    g1, m1, z1 = step(1, False)              # factored from step 1's statistics
    _assert_ap(g1, m1, z1)
    step(2, False)
    g3, m3, _ = step(3, True)                # a refresh with a non-finite Sigma: raw that step ...
    assert torch.equal(g3, m3)
    g4, m4, _ = step(4, False)               # ... then the last good factor, step 1's
    _assert_ap(g4, m4, z1)
    assert opt.stats()["nonfinite_skips"] == 2


def test_a_layer_thawed_between_refreshes_is_preconditioned_from_the_next_step():
    model, opt = _heads(precond_every=4)
    model.b.weight.requires_grad_(False)
    xs = [torch.randn(16, 5, dtype=torch.float64) for _ in range(4)]
    for i in range(2):
        _head_step(model, opt, xs[i], "a")
    model.b.weight.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match=r"layers \['b'\] train now: preconditioned from the next step on"):
        g2, m2 = _head_step(model, opt, xs[2], "ab")["b"]
    assert torch.equal(g2, m2)
    got = _head_step(model, opt, xs[3], "ab")   # b factored from step 3's statistics, a keeps step 0's factor
    _assert_ap(*got["b"], model.inputs(xs[3]).detach())
    _assert_ap(*got["a"], model.inputs(xs[0]).detach())


def test_a_bias_thawed_between_refreshes_drops_the_factor_of_the_old_dimension():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model[2].bias.requires_grad_(False)
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.1, precond_every=4)
    for i in range(4):
        if i == 2:
            model[2].bias.requires_grad_(True)   # the AP's dimension 6 -> 7 (homogeneous coordinates)
        model(torch.randn(16, 5, dtype=torch.float64)).square().mean().backward()
        with pytest.warns(RuntimeWarning) if i == 2 else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
    assert opt.stats()["preconditioned"] == 7   # all but the resized layer's step-2 gradient


def test_a_layer_with_a_stale_gradient_and_no_forward_does_not_make_every_step_collect():
    model, opt = _heads(precond_every=4)
    collecting = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):                   # b runs once, at step 1 (no factor: raw), and keeps a zero gradient
            collecting.append(opt.collecting)
            model(torch.randn(16, 5, dtype=torch.float64), "ab" if i == 1 else "a").backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    # step 2 gathers statistics for b, which has no forward there: b waits for the refreshes (0, 4)
    assert collecting == [True, False, True, False, True, False, False, False]
    said = " ".join(str(w.message) for w in caught)
    assert "['b'] have a gradient but no factor yet" in said and "no training forward since the last step for ['b']" in said


def test_a_resume_between_refreshes_keeps_which_layers_await_a_factor():
    xs = [torch.randn(16, 5, dtype=torch.float64) for _ in range(4)]
    model, opt = _heads(precond_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # b's raw first step, said once
        for i in range(2):
            _head_step(model, opt, xs[i], "ab"[i])
        saved = opt.state_dict()
        want = [_head_step(model, opt, x, "ab") for x in xs[2:]]
        resumed, opt2 = _heads(precond_every=4)
        resumed.load_state_dict(model.state_dict())
        opt2.load_state_dict(saved)
        got = [_head_step(resumed, opt2, x, "ab") for x in xs[2:]]
    for w, g in zip(want, got):
        for n in "ab":
            assert torch.equal(w[n][1], g[n][1])
    _assert_ap(*got[0]["b"], model.inputs(xs[2]).detach())   # b factored at step 2, the step after its raw one
