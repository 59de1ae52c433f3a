"""Issue 73, items 1, 2 and 4: regressions in the optimizer's default path, checked against the float64
formula M = [G | g_b] (Sigma + lam I)^-1 (tests/reference.py) or bit for bit. Each test failed at ddf57e1.

1. Two layers whose gradient matrices have one shape, one with a bias and one without, shared a gradient
   bucket and crashed the first step ("Sizes of tensors must match", dopr/buckets.py).
2. A float32 resume between refreshes (precond_every > 1) with a layer solved in sample space was not
   bit-identical: loading cast the cached float64 factor of K + lam I to float32.
3. (issue item 4) A dtype change of the model between refreshes crashed the next step: the cached
   operators kept the old dtype.

Tolerances: a solve of A = Sigma + lam I whose Sigma is formed from n rows of width d has a relative
(normwise) error of at most about (n + d) u cond(A) (u the unit roundoff of the dtype it is formed and
factored in: gamma_n for the Gram, gamma_d for the factor and solves, amplified by the condition number),
plus u_out where M is rounded once more into a lower-precision gradient."""
import io

import pytest
import torch
from torch import nn

import dopr
from reference import ap_reference, conv1d_patches, with_ones

LAYERS = (nn.Linear, nn.Conv1d)


def _cond(z: torch.Tensor, lam: float) -> float:
    """cond(Sigma + lam I) of Sigma = Z^T Z / n, in float64."""
    z = z.double()
    e = torch.linalg.eigvalsh(z.T @ z / z.shape[0])
    return float((e.max() + lam) / (e.min().clamp(min=0) + lam))


def _lam(z: torch.Tensor, damping: float, mode: str) -> float:
    tr = float((z.double() ** 2).sum() / z.shape[0])
    return {"trace": damping * tr, "trace_per_dim": damping * tr / z.shape[1], "absolute": damping}[mode]


def _rows_and_g(m: nn.Module, x: torch.Tensor, gw: torch.Tensor, gb) -> tuple:
    """(Z: the rows the layer multiplied, with the homogeneous 1 where its bias trains; G as (rows, d))."""
    if isinstance(m, nn.Conv1d):
        z, gw = conv1d_patches(x.double(), m.kernel_size[0], m.stride[0], m.padding[0], m.dilation[0]), gw.flatten(1)
    else:
        z = x.double()
    if gb is None:
        return z, gw.double()
    return with_ones(z), torch.cat([gw, gb[:, None]], 1).double()


def _assert_formula(got: torch.Tensor, want: torch.Tensor, z: torch.Tensor, lam: float, u: float, u_out: float = 0.0):
    n, d = z.shape
    bound = (n + d) * u * _cond(z, lam) + u_out
    err = float((got.double() - want).norm() / want.norm())
    assert err <= bound, f"relative error {err:.3g} > (n + d) u cond(A) + u_out = {bound:.3g}"


def _seen(model):
    """Forward hooks recording each Linear / Conv1d's input: {name: input}, and the hooks."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, i[0].detach().clone()))
             for n, m in model.named_modules() if isinstance(m, LAYERS)]
    return seen, hooks


def _grads(model) -> dict:
    return {n: (m.weight.grad.clone(), None if m.bias is None or m.bias.grad is None else m.bias.grad.clone())
            for n, m in model.named_modules() if isinstance(m, LAYERS)}


def _m(m: nn.Module, with_bias: bool) -> torch.Tensor:
    gw = m.weight.grad.flatten(1)
    return torch.cat([gw, m.bias.grad[:, None]], 1) if with_bias else gw


# 1. a layer with a bias and one without, of one gradient shape, in one step
class _Two(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x, y):
        return self.a(x).tanh().square().sum() + self.b(y).tanh().square().sum()


def _linear_beside_linear(batch):
    g = torch.Generator().manual_seed(1)
    return (_Two(nn.Linear(7, 4), nn.Linear(8, 4, bias=False)),
            (torch.randn(batch, 7, generator=g), torch.randn(batch, 8, generator=g)))


def _conv_beside_linear(batch):   # Conv1d(2, 4, 3) with its bias: G is (4, 2 * 3 + 1), as the Linear's (4, 7)
    g = torch.Generator().manual_seed(1)
    return (_Two(nn.Conv1d(2, 4, 3), nn.Linear(7, 4, bias=False)),
            (torch.randn(max(batch // 3, 1), 2, 5, generator=g), torch.randn(batch, 7, generator=g)))


class _MLP(nn.Sequential):
    def __init__(self):   # layers 0 and 2 have G of shape (8, 8): 7 inputs and a bias, 8 inputs and a frozen bias
        super().__init__(nn.Linear(7, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self[2].bias.requires_grad_(False)

    def forward(self, x):
        return super().forward(x).square().sum()


def _mlp_with_a_frozen_bias(batch):
    return _MLP(), (torch.randn(batch, 7, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("batch", [16, 5], ids=["features", "samples"])   # 5 rows < d: sample space ("auto")
@pytest.mark.parametrize("make", [_linear_beside_linear, _conv_beside_linear, _mlp_with_a_frozen_bias],
                         ids=lambda f: f.__name__.strip("_"))
def test_layers_of_one_gradient_shape_with_and_without_a_bias_step_and_get_the_formula(make, batch):
    torch.manual_seed(0)
    model, inputs = make(batch)
    model.double()
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0))   # the default options
    o = opt.options
    seen, hooks = _seen(model)
    model(*[x.double() for x in inputs]).backward()
    for h in hooks:
        h.remove()
    raw = _grads(model)
    opt.step()
    assert opt.stats()["preconditioned"] == len(raw)
    for n, m in model.named_modules():
        if isinstance(m, LAYERS):
            z, g = _rows_and_g(m, seen[n], *raw[n])
            lam = _lam(z, o.damping, o.damping_mode)
            _assert_formula(_m(m, raw[n][1] is not None), ap_reference(g, z, o.damping, o.damping_mode), z, lam,
                            torch.finfo(torch.float64).eps / 2)


# 2. a float32 resume between refreshes is bit-identical, a layer solved in sample space included
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))   # 8 rows < 33 and 17: sample space


def _train(model, opt, batches):
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("solve_space", ["auto", "features"])
def test_a_float32_resume_between_refreshes_is_bit_identical(solve_space):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 32, generator=g) for _ in range(9)]
    ap = {"precond_every": 3, "solve_space": solve_space}
    model = _net()
    opt = dopr.build(model, "adamw", ap=ap, lr=1e-2)
    _train(model, opt, batches[:5])                 # refreshes at steps 0 and 3; step 4 is not one
    assert not opt.collecting and (opt.stats()["sample_space_solves"] > 0) == (solve_space == "auto")
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, batches[5:])                 # steps 5 (cached), 6 (refresh), 7, 8

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    resumed.load_state_dict(saved["model"])
    opt2 = dopr.build(resumed, "adamw", ap=ap, lr=1e-2)
    opt2.load_state_dict(saved["opt"])
    loaded = opt2.ap_state_dict()["cache"]
    _train(resumed, opt2, batches[5:])
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    for key, s in saved["opt"]["dopr"]["cache"].items():   # each cached tensor kept its own dtype
        for name, t in s["tensors"].items():
            assert loaded[key]["tensors"][name].dtype == t.dtype, (key, name)


# 3. (issue item 4) a dtype or device change of the model between refreshes: preconditioned on, from the cached factor
def _step_after_a_change(convert, solve_space, damping, dtype=torch.float32, device="cpu"):
    """DoPr-SGD at lr 0, precond_every=3: a refresh, a cached step, ``convert(model)``, a cached step. The
    model, the rows each layer saw on the refresh step and the gradients of the last step (on the CPU)."""
    model = _net().to(device=device, dtype=dtype)
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=damping, precond_every=3,
                    solve_space=solve_space)
    g = torch.Generator().manual_seed(1)
    seen, hooks = _seen(model)
    for step in range(3):        # 0: the refresh; 1: cached; 2: cached, after the change
        if step == 2:
            convert(model)
        w = model[0].weight
        model(torch.randn(8, 32, generator=g).to(w)).square().mean().backward()
        for h in hooks:
            h.remove()
        raw = _grads(model)
        opt.step()
        if step < 2:
            opt.zero_grad()
    assert opt.stats()["preconditioned"] == 6 and opt.stats()["refreshes"] == 1
    return model, {n: x.cpu() for n, x in seen.items()}, {n: tuple(None if t is None else t.cpu() for t in gs)
                                                          for n, gs in raw.items()}


def _assert_cached_formula(model, seen, raw, damping, u, u_out=0.0):
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            z, g = _rows_and_g(m, seen[n], *raw[n])     # Sigma from the refresh step's rows, G from this step
            _assert_formula(_m(m, True).cpu(), ap_reference(g, z, damping), z, _lam(z, damping, "trace"), u, u_out)


@pytest.mark.parametrize("solve_space", ["auto", "features"])
@pytest.mark.parametrize("before, after", [(torch.float32, torch.float64), (torch.float64, torch.bfloat16),
                                           (torch.float32, torch.bfloat16)], ids=["float32-double", "float64-bfloat16",
                                                                                 "float32-bfloat16"])
def test_a_dtype_change_between_refreshes_keeps_preconditioning_with_the_cached_factor(before, after, solve_space):
    model, seen, raw = _step_after_a_change(lambda m: m.to(after), solve_space, 1e-3, dtype=before)
    assert all(p.grad.dtype == after for p in model.parameters())
    # the factor was made in the statistics dtype before the change and is applied in the one after
    u = max(torch.finfo(dopr.statistics.statistics_dtype(t)).eps / 2 for t in (before, after))
    u_out = torch.finfo(after).eps / 2 if after.itemsize < 4 else 0.0   # M rounded into a bf16 gradient
    _assert_cached_formula(model, seen, raw, 1e-3, u, u_out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a device move between refreshes)")
@pytest.mark.parametrize("solve_space", ["auto", "features"])
@pytest.mark.parametrize("start, move", [("cpu", lambda m: m.cuda()), ("cuda", lambda m: m.cpu())],
                         ids=["cpu-cuda", "cuda-cpu"])
def test_a_device_move_between_refreshes_keeps_preconditioning_with_the_cached_factor(start, move, solve_space):
    model, seen, raw = _step_after_a_change(move, solve_space, 1e-3, device=start)
    assert model[0].weight.grad.device != torch.device(start)
    _assert_cached_formula(model, seen, raw, 1e-3, torch.finfo(torch.float32).eps / 2)


def test_a_cached_factor_batch_with_a_failed_member_inverts_the_others():
    # issue 73's oracle: precond_every=2, a LoRA adapter whose input dropout zeroed (Sigma = 0, lambda = 0): the
    # batch's failed member (L = 0, solved by a fallback) made cholesky_inverse raise "the input matrix is
    # singular" when the batch was cached; the members in use must get their exact inverse
    from dopr import solvers

    l = torch.tensor([[[1.5, 0.0], [0.5, 2.0]], [[0.0, 0.0], [0.0, 0.0]], [[float("nan"), 0.0], [1.0, 1.0]]],
                     dtype=torch.float64)
    out = solvers.cached({"a": solvers.CholeskyFactor(batch=l, index=0)})
    a = l[0] @ l[0].T
    got = out["a"].apply(torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(got, torch.linalg.inv(a), rtol=1e-14, atol=0)


class _CalledTwice(nn.Module):
    """A module called twice beside two layers of its gradient shape: one Cholesky batch of three."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 7), nn.Linear(7, 7), nn.Linear(7, 7)

    def forward(self, x):
        return self.c(self.b(self.a(self.a(x))))


@pytest.mark.parametrize("make, rows", [(lambda: nn.Sequential(nn.Linear(7, 7), nn.Linear(7, 7)), 1),
                                        (_CalledTwice, 1)], ids=["two-linear-7x7", "called-twice"])
def test_a_float32_resume_between_refreshes_with_the_statistics_ema_is_bit_identical(make, rows):
    """N6 (docs/library.md, "Open defects the oracle found"): with precond_ema the groups are factored in
    feature space, and layers of one d share a Cholesky batch whose cached inverse (cholesky_inverse's) was
    column-major; the live run applied it as it was, a resumed one stacked the saved members row-major, and
    bmm rounds the two layouts differently (3.8e-6 and 1.5e-6 off). Resumed at each step between refreshes."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(rows, next(make().parameters()).shape[1], generator=g) for _ in range(6)]
    ap = dict(precond_every=2, precond_ema=0.5)

    def fresh():
        torch.manual_seed(0)
        model = make()
        return model, dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-3), **ap)

    model, opt = fresh()
    _train(model, opt, batches)
    for at in (1, 3, 5):
        first, opt1 = fresh()
        _train(first, opt1, batches[:at])
        assert not opt1.collecting
        buf = io.BytesIO()
        torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        resumed, opt2 = fresh()
        resumed.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        _train(resumed, opt2, batches[at:])
        for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
            assert torch.equal(p, q), (at, n, float((p - q).abs().max()))
