"""Issue 48's damping-free activation-preconditioner rules, their math in float64 on known spectra:
the ``span`` solver (pseudo-inverse of the undamped Sigma on the supported directions, amplification
capped) and the ``trace_activations`` damping mode (the trace without the homogeneous 1)."""
import math

import pytest
import torch
from torch import nn

from dopr import DoPr, DoPrOptions, solvers
from dopr.damping import trace_damping as damping
from dopr.solvers import span_inverse


EPS = torch.finfo(torch.float64).eps


def _orthogonal(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q


def _sigma(s, seed: int = 0):
    s = torch.tensor(s, dtype=torch.float64)
    u = _orthogonal(len(s), seed)
    return u @ torch.diag(s) @ u.T, u, s


# ------------------------------------------------------------------ span: the math
def test_span_is_the_exact_inverse_on_the_span_and_zero_off_it():
    sigma, u, s = _sigma([0.0, 0.0, 0.5, 1.0, 2.0, 4.0])       # cap not binding: mean 1.25 / 100 < 0.5
    p = span_inverse(sigma[None], rcond=1e-6, cap=100.0)[0]
    tol = 50 * EPS * float(s.max() / s[s > 0].min())            # eps times cond on the span
    span = u[:, 2:] @ u[:, 2:].T
    assert torch.allclose(p @ sigma @ p, p, atol=tol * float(p.abs().max()))
    assert torch.allclose(sigma @ p, span, atol=tol)
    assert torch.allclose(p, u[:, 2:] @ torch.diag(1 / s[2:]) @ u[:, 2:].T, atol=tol)
    g = torch.randn(7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) @ u[:, :2].T
    assert float((g @ p).abs().max()) <= 50 * EPS * float(g.abs().max() * p.abs().max())   # null space -> ~0


def test_span_amplifies_nothing_beyond_the_cap():
    for cap in (1.0, 10.0, 100.0):
        sigma, u, s = _sigma([1e-5, 1e-3, 0.1, 1.0, 10.0, 100.0], seed=2)
        p = span_inverse(sigma[None], rcond=1e-9, cap=cap)[0]
        mean = float(s.mean())
        top = float(torch.linalg.eigvalsh(p).max())
        assert top * mean <= cap * (1 + 1e-12)
        # the directions the cap does not reach are inverted exactly, those below it at cap / mean
        e = torch.diag(u.T @ p @ u)
        want = torch.where(s > mean / cap, 1 / s, torch.full_like(s, cap / mean))
        assert torch.allclose(e, want, rtol=1e-10)


def test_span_floor_zeroes_what_is_under_rcond_and_is_scale_equivariant():
    sigma, u, s = _sigma([1e-9, 1e-3, 1.0, 2.0, 3.0], seed=3)
    p = span_inverse(sigma[None], rcond=1e-6, cap=math.inf)[0]
    e = torch.diag(u.T @ p @ u)
    assert abs(float(e[0])) < 1e-9 and torch.allclose(e[1:], 1 / s[1:], rtol=1e-9)   # 1e-9 < 1e-6 * 3: null
    for a in (1e-3, 7.0):
        pa = span_inverse((a * a * sigma)[None], rcond=1e-6, cap=10.0)[0]
        assert torch.allclose(pa * a * a, span_inverse(sigma[None], rcond=1e-6, cap=10.0)[0], rtol=1e-9, atol=1e-12)


def test_span_floor_includes_the_dtypes_rounding():
    # float32: rcond 0 still drops directions under d * eps32 * max (eigh cannot tell them from 0)
    sigma, u, s = _sigma([1e-9, 1.0, 2.0, 4.0], seed=4)
    p = span_inverse(sigma.float()[None], rcond=0.0, cap=math.inf)[0].double()
    assert float((u[:, 0] @ p @ u[:, 0]).abs()) < 1e-3


def test_span_is_batched_and_returns_explicit_inverses():
    a, _, _ = _sigma([0.0, 1.0, 2.0], seed=5)
    b, _, _ = _sigma([3.0, 1.0, 2.0], seed=6)
    ops = solvers.SOLVERS["span"].bind(DoPrOptions(solver="span"))(torch.stack([a, b]), torch.zeros(2), {})
    assert all(isinstance(op, solvers.ExplicitInverse) for op in ops)
    assert torch.allclose(ops[1].p, torch.linalg.inv(b), atol=1e-12)
    assert torch.allclose(ops[0].p, span_inverse(a[None], 1e-6, 100.0)[0], atol=1e-14)


def test_span_ignores_the_damping():
    sigma, _, _ = _sigma([0.0, 1.0, 2.0, 5.0], seed=7)
    f = solvers.SOLVERS["span"].bind(DoPrOptions())
    p0 = f(sigma[None].clone(), torch.zeros(1), {})[0].p
    p1 = f(sigma[None].clone(), torch.full((1,), 10.0, dtype=torch.float64), {})[0].p
    assert torch.equal(p0, p1)


# ------------------------------------------------------------------ trace_activations
def test_trace_activations_leaves_out_the_homogeneous_entry():
    diag = torch.tensor([[0.5, 2.0, 0.25, 1.0], [3.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    lam = damping(1e-3, "trace_activations", diag, [True, False])
    assert torch.allclose(lam, torch.tensor([1e-3 * 2.75, 1e-3 * 6.0], dtype=torch.float64), rtol=1e-15)
    assert torch.equal(damping(1e-3, "trace_activations", diag, None), damping(1e-3, "trace", diag))
    assert torch.equal(damping(1e-3, "trace_activations", diag, False), damping(1e-3, "trace", diag))
    assert torch.allclose(damping(1e-3, "trace_activations", diag, True), 1e-3 * diag[:, :3].sum(-1))


def test_trace_activations_lambda_scales_with_the_activations():
    # z -> a z: the activation block scales by a^2, the homogeneous 1 does not; lambda follows a^2 exactly
    g = torch.Generator().manual_seed(0)
    z = torch.randn(50, 4, generator=g, dtype=torch.float64)
    for a in (1e-3, 10.0):
        zh, zah = torch.cat([z, torch.ones(50, 1, dtype=torch.float64)], 1), torch.cat(
            [a * z, torch.ones(50, 1, dtype=torch.float64)], 1)
        d1, da = (zh.T @ zh / 50).diagonal(), (zah.T @ zah / 50).diagonal()
        assert torch.allclose(damping(1e-3, "trace_activations", da, True),
                              a * a * damping(1e-3, "trace_activations", d1, True), rtol=1e-13)
        ratio = damping(1e-3, "trace", da) / damping(1e-3, "trace", d1)
        assert abs(float(ratio) - a * a) > 0.01 * a * a   # "trace" does not: the 1 is in it


class _Recording:
    """A dense solver that records the damping each factorisation receives."""

    def __init__(self):
        self.lams, self.sigmas = [], []

    def __call__(self, sigma, lam, counts):
        self.lams.append(lam.clone())
        self.sigmas.append(sigma.clone())
        return [solvers.ExplicitInverse(p) for p in solvers.pseudo_inverse(sigma, lam, 1e-12)]


@pytest.fixture
def recording():
    rec = _Recording()
    solvers.register_solver("recording_test", "dense", rec)
    yield rec
    solvers.SOLVERS.pop("recording_test")


def test_trace_activations_through_dopr_on_layers_with_and_without_a_bias(recording):
    # both layers' Sigma are 6 x 6 (5 inputs + the 1; 6 inputs, no bias): one batch, one flag each
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3, bias=False)).double()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), solver="recording_test", damping=1e-3,
               damping_mode="trace_activations")
    x = torch.randn(40, 5, dtype=torch.float64)
    model(x).square().mean().backward()
    opt.step()
    (lam,), (sigma,) = recording.lams, recording.sigmas
    assert sigma.shape == (2, 6, 6)
    d = sigma.diagonal(dim1=-2, dim2=-1)
    last = [float(s[-1, -1]) for s in sigma]
    first = 0 if abs(last[0] - 1.0) < 1e-12 else 1     # the Linear(5, 6)'s Sigma ends with E[1] = 1
    assert abs(last[first] - 1.0) < 1e-12
    assert torch.allclose(lam[first], 1e-3 * d[first, :-1].sum(), rtol=1e-14)
    assert torch.allclose(lam[1 - first], 1e-3 * d[1 - first].sum(), rtol=1e-14)
    opt.close()


# ------------------------------------------------------------------ invariance
def _one_step(w, b, x, y, **options):
    lin = nn.Linear(w.shape[1], w.shape[0]).double()
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.5), **options)
    ((lin(x) - y) ** 2).mean().backward()
    opt.step()
    opt.close()
    return lin


def _cond_on_span(x):
    z = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    e = torch.linalg.eigvalsh(z.T @ z)
    e = e[e > 1e-10 * e.max()]
    return float(e.max() / e.min())


@pytest.mark.parametrize("n", [64, 4])     # full rank; rank-deficient (N < d)
def test_span_keeps_the_affine_invariance_of_prop_precondinvariance(n):
    """z -> Q z + c with W -> W Q^-1, b -> b - W Q^-1 c gives the same function; after one DoPr-SGD step
    with the span solver (cap off) the two functions still agree: everywhere for a full-rank Sigma, on
    the training inputs for a rank-deficient one. The damped Cholesky rule does not."""
    g = torch.Generator().manual_seed(0)
    d, rows = 6, 3
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.tensor([1e-2, 0.1, 1, 1, 10, 3.0], dtype=torch.float64)
    y = torch.randn(n, rows, generator=g, dtype=torch.float64)
    w, b = torch.randn(rows, d, generator=g, dtype=torch.float64), torch.randn(rows, generator=g, dtype=torch.float64)
    q = torch.randn(d, d, generator=g, dtype=torch.float64) + 3 * torch.eye(d, dtype=torch.float64)
    c = torch.randn(d, generator=g, dtype=torch.float64)
    qinv = torch.linalg.inv(q)
    xbar = x @ q.T + c
    wbar, bbar = w @ qinv, b - w @ qinv @ c
    probe = x if n < d + 1 else torch.randn(20, d, generator=g, dtype=torch.float64)
    span = dict(solver="span", span_cap=math.inf, span_rcond=1e-10)
    a, abar = _one_step(w, b, x, y, **span), _one_step(wbar, bbar, xbar, y, **span)
    with torch.no_grad():
        out, outbar = a(probe), abar(probe @ q.T + c)
        scale = float(out.abs().max())
        cond = max(_cond_on_span(x), _cond_on_span(xbar))   # the rounding of Sigma's inverse, either side
        assert float((out - outbar).abs().max()) <= 100 * EPS * cond * scale
    damped = dict(solver="cholesky", damping=1e-3)
    a, abar = _one_step(w, b, x, y, **damped), _one_step(wbar, bbar, xbar, y, **damped)
    with torch.no_grad():
        assert float((a(probe) - abar(probe @ q.T + c)).abs().max()) > 1e-6 * scale


# ------------------------------------------------------------------ options and end to end
@pytest.mark.parametrize("kw,msg", [({"span_cap": 0.5}, r"Invalid span_cap: 0.5 \(must be a number >= 1"),
                                    ({"span_cap": "ten"}, r"Invalid span_cap: got str 'ten'"), ({"span_cap": "0.5"}, r"Invalid span_cap: 0.5 \(must"),
                                    ({"span_rcond": 1.0}, r"Invalid span_rcond: 1.0 \(must be in \[0, 1\)\)"),
                                    ({"damping_mode": "trace_activation"}, r"Invalid damping_mode: 'trace_activation'")])
def test_the_new_options_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DoPrOptions(**kw)


def test_the_defaults_are_unchanged():
    o = DoPrOptions()
    assert (o.solver, o.damping_mode, o.damping) == ("cholesky", "trace", 1e-4)
    assert DoPrOptions(span_cap=math.inf).span_cap == math.inf


@pytest.mark.parametrize("options", [dict(solver="span"), dict(solver="span", precond_every=2),
                                     dict(damping_mode="trace_activations"),
                                     dict(damping_mode="trace_activations", solver="rank1_diag"),
                                     dict(damping_mode="trace_activations", solver="eigh")])
def test_dopr_trains_an_mlp_with_biases(options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **options)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin()], 1)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0]
    assert opt.stats()["preconditioned"] > 0
    opt.close()


# ------------------------------------------------------------------ damping set by the health report
def _share(e, g2, lam, weak):
    """The weak directions' share of ||M||^2, written out: sum_i g2_i / (e_i + lam)^2."""
    energy = [g / (v + lam) ** 2 for v, g in zip(e, g2)]
    return sum(x for x, w in zip(energy, weak) if w) / sum(energy)


def test_damping_scale_is_the_smallest_doubling_that_brings_the_weak_share_under_the_bound():
    from dopr.damping import WEAK_VARIANCE, damping_scale
    e = torch.tensor([1e-7, 1e-5, 0.5, 1.0, 2.0], dtype=torch.float64)   # two weak directions (share < 1e-4)
    p = e / e.sum()
    weak = [bool(v < WEAK_VARIANCE) for v in p]
    assert weak == [True, True, False, False, False]
    g2 = torch.tensor([1e-6, 1e-4, 1.0, 1.0, 1.0], dtype=torch.float64)   # G's own weak share: 1e-4 / 3
    lam = 1e-6 * float(e.sum())
    for bound in (0.9, 0.5, 0.1, 0.01):
        f = damping_scale(e, p, g2, lam, bound)
        j = round(math.log2(f))
        assert f == 2.0 ** j and 0 <= j <= 20
        assert _share(e.tolist(), g2.tolist(), f * lam, weak) <= bound
        if j > 0:                                    # the smallest: one doubling less is over the bound
            assert _share(e.tolist(), g2.tolist(), f / 2 * lam, weak) > bound
    assert damping_scale(e, p, g2, lam, 0.9) < damping_scale(e, p, g2, lam, 0.01)
    # nothing weak, or no gradient along the weak directions' amplification: lambda as it was
    assert damping_scale(e[2:], e[2:] / e[2:].sum(), g2[2:], lam, 0.1) == 1.0
    assert damping_scale(e, p, torch.zeros(5, dtype=torch.float64), lam, 0.1) == 1.0
    # a rank holding no rows of a sharded layer contributes zero energy to the all-reduce (and joins it)
    from dopr.damping import direction_energy
    sigma = torch.diag(e)
    e2, p2, g2_empty = direction_energy(sigma, torch.zeros(0, 5))
    assert torch.equal(g2_empty, torch.zeros(5, dtype=torch.float64)) and torch.allclose(e2, e.sort().values)
    # a bound under G's own weak share cannot be met by any damping: the largest factor tried
    only_weak = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert damping_scale(e, p, only_weak, lam, 0.5) == 2.0 ** 20


def _weak_layer(seed=0):
    """A Linear(3, 2) whose third input barely varies (std 1e-3 of the others': 1e-6 of the variance) but
    drives the target: at damping 1e-6 tr(Sigma) the AP puts nearly all of M into that direction."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1.0, 1e-3], dtype=torch.float64)
    y = torch.stack([x[:, 0] + 1e3 * x[:, 2], x[:, 1]], 1)
    lin = nn.Linear(3, 2, bias=False).double()
    with torch.no_grad():
        lin.weight.zero_()
    return lin, x, y


def test_the_bound_sets_each_layers_damping_and_m_is_the_damped_solve_at_it():
    from dopr.health import layer_health
    reports = {}
    for bound in (None, 0.5):
        lin, x, y = _weak_layer()
        opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.1), damping=1e-6, health_every=1,
                   weak_share_bound=bound)
        ((lin(x) - y) ** 2).mean().backward()
        g = lin.weight.grad.clone()
        opt.step()
        (rep,) = opt.stats()["health"].values()
        reports[bound] = rep
        sigma = x.T @ x / len(x)
        f = rep.get("damping_scale", 1.0)
        lam = f * 1e-6 * float(sigma.trace())
        m = g @ torch.linalg.inv(sigma + lam * torch.eye(3, dtype=torch.float64))
        # SGD without momentum: the step is -lr M; the solve's rounding is eps * cond(Sigma + lam I)
        cond = float(torch.linalg.cond(sigma + lam * torch.eye(3, dtype=torch.float64)))
        assert torch.allclose(lin.weight, -0.1 * m, atol=100 * EPS * cond * float(m.abs().max()))
        assert rep["weak_share"] == layer_health(sigma, lam, g)["weak_share"]
        opt.close()
    assert reports[None]["weak_share"] > 0.9 and "damping_scale" not in reports[None]
    assert reports[0.5]["weak_share"] <= 0.5 and reports[0.5]["damping_scale"] > 1


def test_a_report_step_eigendecomposes_each_layer_once_for_the_rule_and_the_report(monkeypatch):
    """The damping rule and the health report share Sigmabar's spectrum: one eigh per group on a report
    step (two before), and the report's weak share is the one at the chosen damping."""
    from dopr.health import layer_health
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a, *args, **kw: calls.append(tuple(a.shape)) or eigh(a, *args, **kw))
    lin, x, y = _weak_layer()
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.1), damping=1e-6, health_every=1, weak_share_bound=0.5)
    ((lin(x) - y) ** 2).mean().backward()
    g = lin.weight.grad.clone()
    opt.step()
    assert calls == [(3, 3)]
    (rep,) = opt.stats()["health"].values()
    sigma = x.T @ x / len(x)
    lam = rep["damping_scale"] * 1e-6 * float(sigma.trace())
    assert rep["weak_share"] == layer_health(sigma, lam, g)["weak_share"] <= 0.5
    opt.close()


def test_the_chosen_scale_holds_between_reports_and_survives_a_checkpoint():
    lin, x, y = _weak_layer()
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=1e-3), damping=1e-6, health_every=3, weak_share_bound=0.5)
    for _ in range(2):
        opt.zero_grad()
        ((lin(x) - y) ** 2).mean().backward()
        opt.step()
    scale = dict(opt.refresh.damping.scale)
    assert len(scale) == 1 and next(iter(scale.values())) > 1        # chosen on refresh 0, held on refresh 1
    state = opt.state_dict()
    assert state["dopr"]["damping_scale"] == {"|".join(k): f for k, f in scale.items()}
    lin2, _, _ = _weak_layer()
    opt2 = DoPr(lin2, torch.optim.SGD(lin2.parameters(), lr=1e-3), damping=1e-6, health_every=3, weak_share_bound=0.5)
    opt2.load_state_dict(state)
    assert opt2.refresh.damping.scale == scale
    opt.close()
    opt2.close()


@pytest.mark.parametrize("kw,msg", [({"weak_share_bound": 1.0}, r"Invalid weak_share_bound: 1.0 \(must be in \(0, 1\) or None\)"),
                                    ({"weak_share_bound": 0.5}, r"weak_share_bound=0.5 .* set health_every >= 1")])
def test_the_bound_is_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DoPrOptions(**kw)


# ------------------------------------------------------------------ weak share by a rational filter (no eigh)
def _soft_shares(e, u, g, lam, max_doublings=20):
    """The filter's soft share at each f = 2^j, j = 0..max_doublings, from the eigen-directions (float64):
    sum_i g2_i w_i phi_i / sum_i g2_i w_i, w_i = (e_i + f lam)^-2, phi_i = tau^2 / (e_i^2 + tau^2)."""
    from dopr.health import WEAK_VARIANCE
    tau = WEAK_VARIANCE * float(e.sum())
    g2 = (g @ u).square().sum(0)
    phi = tau ** 2 / (e.square() + tau ** 2)
    f = 2.0 ** torch.arange(max_doublings + 1, dtype=torch.float64)
    w = g2 / (e + lam * f[:, None]).square()
    return (w * phi).sum(1) / w.sum(1)


SPREAD = [[1e-9, 3e-7, 1e-2, 0.3, 1.0, 2.0], [1e-8, 1e-6, 0.05, 0.5, 1.0, 1.5], [2e-9, 5e-8, 1e-3, 0.2, 0.7, 3.0]]
GAPPED = [[1e-9, 3e-7, 0.05, 0.3, 1.0, 2.0], [1e-8, 1e-6, 0.05, 0.5, 1.0, 1.5], [2e-9, 5e-8, 0.1, 0.2, 0.7, 3.0]]


def _filter_batch(seed=0, spectra=SPREAD):
    """Three 6-d covariances spread over eight decades (two directions under 1e-4 of the variance) with
    random eigenvectors, and gradients of 4, 2 and 3 rows (the batch pads with zero rows) with 0.03 of their
    scale along the two weak directions."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (s, rows) in enumerate(zip(spectra, (4, 2, 3))):
        sigma, u, e = _sigma(s, seed=seed + k)
        g = torch.randn(rows, 6, generator=gen, dtype=torch.float64)
        g = g @ u @ torch.diag(torch.tensor([0.03, 0.03, 1, 1, 1, 1], dtype=torch.float64)) @ u.T
        out.append((sigma, u, e, g))
    return out


def _stack(batch):
    rows = max(g.shape[0] for *_, g in batch)
    grads = torch.zeros(len(batch), rows, 6, dtype=torch.float64)
    for i, (*_, g) in enumerate(batch):
        grads[i, :g.shape[0]] = g
    return torch.stack([b[0] for b in batch]), grads


def test_the_filters_soft_share_falls_with_the_damping_and_bisection_finds_its_smallest_doubling():
    """filtered_damping_scale against the soft share evaluated on the known spectra: the share is
    non-increasing in f (the docstring's argument), and the factor is the smallest 2^j at or under the bound.
    The solves' relative error is about eps * cond(Sigma + lam I) <= 1e-16 * 1e7, so a bound farther than 1e-6
    from every share is decided as in exact arithmetic (checked, not assumed)."""
    from dopr.damping import filtered_damping_scale
    batch = _filter_batch()
    sigma, grads = _stack(batch)
    lam = torch.tensor([1e-6 * float(e.sum()) for _, _, e, _ in batch], dtype=torch.float64)
    shares = [_soft_shares(e, u, g, float(l)) for (_, u, e, g), l in zip(batch, lam)]
    for s in shares:
        assert bool((s[1:] <= s[:-1] * (1 + 1e-12)).all())
        assert float(s[0]) > 0.9 and float(s[-1]) < 0.1           # the bound binds, and can be met
    for bound in (0.8, 0.5, 0.25, 0.1):
        assert all(float((s - bound).abs().min()) > 1e-6 for s in shares)
        f = filtered_damping_scale(sigma, grads, lam, bound)
        want = [2.0 ** int((s <= bound).nonzero()[0, 0]) for s in shares]
        assert f.tolist() == want
    # the padding rows change nothing: each member alone gives the same factor
    together = filtered_damping_scale(sigma, grads, lam, 0.25).tolist()
    alone = [filtered_damping_scale(sg[None], g[None], lam[i:i + 1], 0.25).item() for i, (sg, _, _, g) in enumerate(batch)]
    assert alone == together


def test_the_filter_agrees_with_the_spectrum_rule_where_the_spectrum_has_a_gap():
    """Weak eigenvalues at most tau/100 and the rest at least 100 tau: the filter counts a weak direction's
    energy with weight >= 1/(1 + 1e-4) and a strong one's with <= 1e-4, so the soft share lies in
    [h (1 - 1e-4), h + 1e-4] for the hard share h, and both rules choose the same factor for a bound outside
    those intervals."""
    from dopr.damping import WEAK_VARIANCE, damping_scale, filtered_damping_scale
    batch = _filter_batch(seed=3, spectra=GAPPED)
    sigma, grads = _stack(batch)
    lam = torch.tensor([1e-6 * float(e.sum()) for _, _, e, _ in batch], dtype=torch.float64)
    for bound in (0.5, 0.25):
        f = filtered_damping_scale(sigma, grads, lam, bound)
        for i, (sg, u, e, g) in enumerate(batch):
            p = e / e.sum()
            tau = WEAK_VARIANCE * float(e.sum())
            assert bool(((e <= tau / 100) | (e >= 100 * tau)).all())      # the gap
            g2 = (g @ u).square().sum(0)
            fs = 2.0 ** torch.arange(21, dtype=torch.float64)
            w = g2 / (e + float(lam[i]) * fs[:, None]).square()
            hard = w[:, p < WEAK_VARIANCE].sum(1) / w.sum(1)
            assert not bool(((hard * (1 - 1e-4) <= bound) & (bound <= hard + 1e-4)).any())
            assert float(f[i]) == damping_scale(e, p, g2, float(lam[i]), bound)


def test_the_filter_leaves_lambda_where_nothing_is_to_choose():
    from dopr.damping import filtered_damping_scale
    sigma, u, e = _sigma([1e-9, 1e-2, 1.0])
    lam = torch.tensor([1e-6 * float(e.sum())], dtype=torch.float64)
    assert filtered_damping_scale(sigma[None], torch.zeros(1, 2, 3, dtype=torch.float64), lam, 0.25).tolist() == [1.0]
    assert filtered_damping_scale(torch.zeros(1, 3, 3), torch.ones(1, 2, 3), lam, 0.25).tolist() == [1.0]    # Sigma = 0
    assert filtered_damping_scale(sigma[None], torch.ones(1, 2, 3), torch.zeros(1), 0.25).tolist() == [1.0]   # lam = 0
    # G only along the weakest direction: no damping brings the share under the bound, the largest factor
    g = u[:, 0].reshape(1, 1, 3) * 5.0
    assert filtered_damping_scale(sigma[None], g, lam, 0.25).tolist() == [2.0 ** 20]


def test_dopr_with_the_filter_solves_at_its_factor_every_refresh_without_an_eigendecomposition(monkeypatch):
    """weak_share_estimate="filter" needs no health report (health_every=0), calls no eigh, and M is the
    damped solve at the filter's factor; the counters tally its choices and raises, also in the state dict."""
    from dopr.damping import filtered_damping_scale
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: (_ for _ in ()).throw(AssertionError("eigh called")))
    lin, x, y = _weak_layer()
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.1), damping=1e-6, weak_share_bound=0.5,
               weak_share_estimate="filter")
    ((lin(x) - y) ** 2).mean().backward()
    g = lin.weight.grad.clone()
    opt.step()
    sigma = x.T @ x / len(x)
    lam = 1e-6 * float(sigma.trace())
    f = float(filtered_damping_scale(sigma[None], g[None], torch.tensor([lam], dtype=torch.float64), 0.5))
    assert f > 1                                                     # the weak input needs a raise
    a = sigma + f * lam * torch.eye(3, dtype=torch.float64)
    m = g @ torch.linalg.inv(a)
    cond = float(torch.linalg.cond(a))
    assert torch.allclose(lin.weight, -0.1 * m, atol=100 * EPS * cond * float(m.abs().max()))
    for _ in range(2):
        opt.zero_grad()
        ((lin(x) - y) ** 2).mean().backward()
        opt.step()
    stats = opt.stats()
    assert stats["damping_choices"] == 3 and 1 <= stats["damping_raises"] <= 3 and "health" not in stats
    assert opt.state_dict()["dopr"]["counts"]["damping_choices"] == 3
    assert opt.refresh.damping.scale == {}                                  # nothing held between refreshes
    opt.close()


def test_the_filter_reports_its_factor_when_a_health_report_is_due():
    lin, x, y = _weak_layer()
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.1), damping=1e-6, health_every=1, weak_share_bound=0.5,
               weak_share_estimate="filter")
    ((lin(x) - y) ** 2).mean().backward()
    opt.step()
    (rep,) = opt.stats()["health"].values()
    assert rep["damping_scale"] > 1 and rep["weak_share"] <= 0.5     # the hard share meets the bound too here
    opt.close()


@pytest.mark.parametrize("kw,msg", [({"weak_share_estimate": "eig"}, r"Invalid weak_share_estimate: 'eig' \(choose from \('spectrum', 'filter'\)\)")])
def test_the_estimate_is_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DoPrOptions(**kw)
    assert DoPrOptions(weak_share_bound=0.25, weak_share_estimate="filter").health_every == 0


def test_a_health_warning_names_a_layer_that_is_the_whole_model():
    """Issue 66: a model that is itself the layer printed "DoPr: : effective rank ..."; the warning names it <root>."""
    lin, x, y = _weak_layer()
    opt = DoPr(lin, torch.optim.SGD(lin.parameters(), lr=0.1), damping=1e-6, health_every=1)
    ((lin(x) - y) ** 2).mean().backward()
    with pytest.warns(RuntimeWarning) as caught:
        opt.step()
    health = [str(w.message) for w in caught if "effective rank" in str(w.message)]
    assert health and all(m.startswith("DoPr: <root>: effective rank ") for m in health), health
    opt.close()
