"""The sample-count damping rule (issue 67 items 1-2, dopr/sample_count.py, dopr.damping.SampleCountRule):
the count of independent rows a layer sees, the EMA's equivalent count, and lambda from q = d / N_eff by the
Marchenko-Pastur lower edge, on the Cholesky path."""
import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dopr import DoPr, damping
from dopr.sample_count import KAPPA, design_effect, ema_count_factor, sample_count_damping
from reference import ap_reference
from test_damping import _step_grad as _step


def _tokens(n, t, d, rho, seed=0):
    """z_nt = a_n + e_nt, isotropic, tr(Cov a) / tr(Cov z) = rho."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 1, d, generator=g, dtype=torch.float64) * math.sqrt(rho)
    e = torch.randn(n, t, d, generator=g, dtype=torch.float64) * math.sqrt(1.0 - rho)
    return a + e


@pytest.mark.parametrize("rho", [0.05, 0.3, 0.8])
def test_design_effect_is_kish_for_tokens_with_a_known_intra_sample_correlation(rho):
    """tokens = per-sample part + independent noise: the estimate is 1 + (T - 1) rho, so N_eff = N T / that.
    Its error: tr(Cov m) and tr(Cov z) are sums of N d and N T d squares, relative std <= sqrt(2 / (N d));
    5 of those, plus the centring's O(1 / N)."""
    n, t, d = 512, 16, 32
    expected = 1.0 + (t - 1) * rho
    tol = 5 * math.sqrt(2.0 / (n * d)) + 2.0 / n
    got = float(design_effect(_tokens(n, t, d, rho)))
    assert abs(got / expected - 1.0) <= tol, (got, expected)


def test_rows_constant_within_a_sample_count_once_and_one_row_per_sample_counts_each():
    """A conditioning vector broadcast over T positions (adaLN, FiLM): design effect T exactly, N_eff = N;
    a 2-D input (an MLP, the timestep embedding's first layer): 1; independent rows: near 1 (clamped at 1)."""
    g = torch.Generator().manual_seed(1)
    c = torch.randn(64, 1, 8, generator=g).expand(64, 10, 8)
    assert float(design_effect(c)) == pytest.approx(10.0, rel=1e-5)   # float32 sums of 640 rows
    assert float(design_effect(torch.randn(64, 8, generator=g))) == 1.0
    n, t, d = 512, 16, 32
    assert 1.0 <= float(design_effect(_tokens(n, t, d, 0.0))) <= 1.0 + t * (5 * math.sqrt(2.0 / (n * d)) + 2.0 / n)


@pytest.mark.parametrize("beta,t", [(0.0, 5), (0.9, 1), (0.9, 3), (0.95, 200), (0.5, 40)])
def test_ema_count_is_the_inverse_of_the_ema_weights_sum_of_squares(beta, t):
    """The EMA's recursion b <- beta b + (1 - beta) x, bias-corrected by 1 - beta^t, fed one-hot batches:
    its weights w; t independent batches of N rows then have the variance of sum w^2 / N."""
    b = torch.zeros(t, dtype=torch.float64)
    for k in range(t):
        b = beta * b + (1 - beta) * torch.nn.functional.one_hot(torch.tensor(k), t).double()
    w = b / (1 - beta ** t)
    assert ema_count_factor(beta, t) == pytest.approx(1.0 / float((w * w).sum()), rel=1e-12)
    assert ema_count_factor(beta, t) <= (1 + beta) / (1 - beta) + 1e-12


def test_the_rule_is_zero_below_a_quarter_and_a_quarter_of_the_mean_eigenvalue_past_one():
    """lambda / (tr / d) = max(1/KAPPA - (1 - sqrt q)^2, d eps): the MP lower edge (1 - sqrt q)^2 is 1/4 at
    q = 1/4, (1 - 1/sqrt 2)^2 at q = 1/2, 0 from q = 1 on (rank-deficient Sigma): lambda = tr / (4 d)."""
    d, trace = 64, torch.full((5,), 128.0, dtype=torch.float64)
    n = torch.tensor([d / 0.01, d / 0.25, d / 0.5, d / 1.0, d / 4.0], dtype=torch.float64)
    lam = sample_count_damping(trace, d, n) / (trace / d)
    eps = d * torch.finfo(torch.float64).eps
    assert KAPPA == 4.0
    torch.testing.assert_close(lam, torch.tensor([eps, eps, 0.25 - (1 - 2 ** -0.5) ** 2, 0.25, 0.25],
                                                 dtype=torch.float64), rtol=1e-12, atol=1e-12)


def _layer_and_data(n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 3.0, d, dtype=torch.float64)
    z = torch.randn(n, d, generator=g, dtype=torch.float64) * scales
    return nn.Linear(d, 3, bias=False).double(), z, torch.randn(n, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("n,d", [(64, 6), (12, 6), (4, 8)])
def test_m_is_the_float64_formula_with_the_rules_lambda_and_finite_at_q_above_one(n, d):
    """DoPr(damping_rule="sample_count", damping=0): M = G (Sigma + lambda I)^-1 with lambda from q = d / n
    (the rows of a 2-D input are its samples). q = 6/64: the d eps floor; q = 1/2: the edge; q = 2: Sigma
    has rank 4 of 8 and lambda = tr / (4 d) keeps M finite. Cholesky vs LU in float64 on cond <= 4 d + 1
    (q >= 1) or cond(Sigma) ~ 1e2: rounding far under 1e-9."""
    layer, z, y = _layer_and_data(n, d)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    assert type(opt.refresh.damping) is damping.SampleCountRule
    g, m = _step(layer, opt, z, y)
    q = d / n
    share = max(1 / KAPPA - (1 - math.sqrt(min(q, 1.0))) ** 2, d * torch.finfo(torch.float64).eps)
    assert torch.isfinite(m).all()
    torch.testing.assert_close(m, ap_reference(g, z, share, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    opt.close()


@pytest.mark.parametrize("n,d", [(64, 6), (12, 6), (4, 8), (2, 8)])
def test_the_seen_rule_scales_the_lift_past_q_one_by_q(n, d):
    """damping_rule="sample_count_seen": below q = 1 the sample-count rule's lambda; past it
    tr(Sigma) / (4 N) = q tr / (4 d) (q = 2 and 4 here: Sigma of rank n < d). M against the float64 formula
    (Cholesky vs LU on cond <= 4 N / ... + 1: rounding far under 1e-9)."""
    layer, z, y = _layer_and_data(n, d)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count_seen")
    assert type(opt.refresh.damping) is damping.SampleCountSeenRule
    g, m = _step(layer, opt, z, y)
    q = d / n
    share = max(1 / KAPPA - (1 - math.sqrt(min(q, 1.0))) ** 2, d * torch.finfo(torch.float64).eps) * max(q, 1.0)
    torch.testing.assert_close(m, ap_reference(g, z, share, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    opt.close()
    trace = torch.full((3,), 10.0, dtype=torch.float64)      # continuous at q = 1, equal below it
    ns = torch.tensor([d / 0.5, float(d), d / 4.0], dtype=torch.float64)
    seen, flat = sample_count_damping(trace, d, ns, seen=True), sample_count_damping(trace, d, ns)
    torch.testing.assert_close(seen[:2], flat[:2], rtol=0, atol=0)
    torch.testing.assert_close(seen[2], trace[2] / (KAPPA * ns[2]), rtol=1e-12, atol=0)


def test_micro_batches_add_their_rows():
    """Two micro-batches of 6 rows each, d = 8: N_eff = 12 (q = 2/3, lambda = (1/4 - (1 - sqrt(2/3))^2) tr / d),
    not 6 (q = 4/3, tr / (4 d)); M against the formula on the 12 rows and the summed gradient."""
    layer, z, y = _layer_and_data(12, 8)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    opt.zero_grad()
    for part in (slice(0, 6), slice(6, 12)):
        ((layer(z[part]) - y[part]) ** 2).sum().backward()
    g = layer.weight.grad.clone()
    opt.precondition()
    share = 1 / KAPPA - (1 - math.sqrt(8 / 12)) ** 2
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, z, share, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    opt.close()


def test_a_group_solved_in_sample_space_gets_the_same_lambda():
    """solve_space="samples" (n = 4 rows < d = 8: q = 2): the Woodbury solve with lambda = tr(Sigma) / (4 d),
    the same M as the feature-space formula (float64, cond(K + lambda I) <= 4 d + 1)."""
    layer, z, y = _layer_and_data(4, 8)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=1e-12, damping_rule="sample_count",
               solve_space="samples")
    g, m = _step(layer, opt, z, y)
    assert opt.stats()["sample_space_solves"] == 1
    torch.testing.assert_close(m, ap_reference(g, z, 1 / KAPPA, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    opt.close()


def test_the_damping_option_stays_a_floor():
    """With damping (the trace rule's gamma) above the rule's lambda, lambda is gamma tr(Sigma)."""
    layer, z, y = _layer_and_data(64, 6)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=1e-2, damping_rule="sample_count")
    g, m = _step(layer, opt, z, y)
    torch.testing.assert_close(m, ap_reference(g, z, 1e-2), rtol=1e-9, atol=1e-12)
    opt.close()


def test_the_ema_count_leaves_in_the_state_dict_and_comes_back():
    """precond_ema = 0.9: the rule holds each group's EMA updates (damping_scale), N_eff = n times
    ema_count_factor; a fresh optimizer loaded from the state dict takes the next step as the first does."""
    n, d = 8, 6     # q = 3/4 at t = 1, 3/4 / 1.9 after two updates: lambda changes with t
    layer, z, y = _layer_and_data(n, d)
    opts = dict(damping=0.0, damping_rule="sample_count", precond_ema=0.9)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), **opts)
    for _ in range(2):
        _step(layer, opt, z, y)
    state = opt.state_dict()
    assert state["dopr"]["damping_scale"] == {"": 2}
    layer2 = copy.deepcopy(layer)
    fresh = DoPr(layer2, torch.optim.SGD(layer2.parameters(), lr=0.0), **opts)
    fresh.load_state_dict(state)
    g, m = _step(layer, opt, z, y)
    _, m2 = _step(layer2, fresh, z, y)
    q = d / (n * ema_count_factor(0.9, 3))
    share = max(1 / KAPPA - (1 - math.sqrt(q)) ** 2, d * torch.finfo(torch.float64).eps)
    torch.testing.assert_close(m, ap_reference(g, z, share, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m2, m, rtol=0.0, atol=0.0)
    opt.close()
    fresh.close()


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def test_no_eigendecomposition_is_run():
    """The step's aten ops under the rule: a Cholesky factor, no eigh / eig / svd."""
    layer, z, y = _layer_and_data(12, 6)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping_rule="sample_count")
    opt.zero_grad()
    ((layer(z) - y) ** 2).mean().backward()
    with _Ops() as ops:
        opt.precondition()
    assert any("cholesky" in o for o in ops.names), sorted(ops.names)
    assert not [o for o in ops.names if any(w in o for w in ("eigh", "eig", "svd"))]
    opt.close()


def test_a_bad_damping_rule_is_named():
    layer, _, _ = _layer_and_data(4, 3)
    with pytest.raises(ValueError, match=r"Invalid damping_rule: 'mp' \(choose from \('trace', 'sample_count', 'sample_count_seen'\)\)"):
        DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping_rule="mp")


def test_the_rule_and_a_weak_share_bound_together_are_refused():
    layer, _, _ = _layer_and_data(4, 3)
    with pytest.raises(ValueError, match=r"weak_share_bound=0.25 raises the trace rule's lambda, and "
                                         r"damping_rule='sample_count' chooses another rule: set one of them"):
        DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping_rule="sample_count",
             weak_share_bound=0.25, weak_share_estimate="filter")


# ------------------------------------------------------------------ the capture's count (issue 67 item 1)
def _samples(opt, index=0):
    """The independent rows the capture holds for layer `index` since the last step (a 0-d tensor)."""
    return opt.capture.layers[index].stat.extras["samples"]


def _share(n_eff, d):
    return max(1 / KAPPA - (1 - math.sqrt(min(d / n_eff, 1.0))) ** 2, d * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("rho", [0.1, 0.5])
def test_a_linear_layer_fed_correlated_tokens_counts_n_t_over_kish(rho):
    """A Linear on (N, T, d) tokens with intra-sample correlation rho: samples = N T / (1 + (T - 1) rho),
    within the design effect's error (the test above: 5 sqrt(2 / (N d)) + 2 / N relative, and samples is
    N T over it)."""
    n, t, d = 512, 16, 32
    layer = nn.Linear(d, 3, bias=False).double()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    layer(_tokens(n, t, d, rho)).square().mean().backward()
    expected = n * t / (1.0 + (t - 1) * rho)
    tol = 5 * math.sqrt(2.0 / (n * d)) + 2.0 / n
    assert opt.capture.layers[0].stat.count == n * t
    assert abs(float(_samples(opt)) / expected - 1.0) <= 1.5 * tol, (float(_samples(opt)), expected)
    opt.close()


def test_a_conditioning_vector_repeated_over_tokens_counts_each_sample_once():
    """adaLN / FiLM: one vector per sample broadcast over T = 10 positions counts N = 12, not N T = 120
    (float32 sums of N T terms: relative error <= N T eps). lambda follows q = d / samples = 2/3, not
    8/120 (where it would be the d eps floor)."""
    n, t, d = 12, 10, 8
    layer, c, _ = _layer_and_data(n, d)
    y = torch.randn(n, t, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    x = c[:, None, :].expand(n, t, d)
    ((layer(x) - y) ** 2).mean().backward()
    g = layer.weight.grad.clone()
    samples = float(_samples(opt))
    assert samples == pytest.approx(n, rel=n * t * torch.finfo(torch.float32).eps)
    opt.precondition()
    z = x.reshape(-1, d)
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, z, _share(samples, d), "trace_per_dim"),
                               rtol=1e-9, atol=1e-12)
    assert _share(samples, d) > 0.2
    opt.close()


def test_micro_batches_add_their_independent_rows_and_lambda_follows_the_sum():
    """Two micro-batches of (6, 4, 8) tokens (rho 0.9 and 0.2): samples is the sum of each forward's
    rows / design effect (dopr.sample_count.independent_rows, as the capture computes it), and M the float64
    formula with q = 8 / that sum on all 48 rows."""
    from dopr.sample_count import independent_rows
    n, t, d = 6, 4, 8
    layer = nn.Linear(d, 3, bias=False).double()
    parts = [_tokens(n, t, d, 0.9, seed=2), _tokens(n, t, d, 0.2, seed=3)]
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    for x in parts:
        layer(x).square().mean().backward()
    g = layer.weight.grad.clone()
    expected = sum(float(independent_rows(x.reshape(-1, d), n)) for x in parts)
    assert float(_samples(opt)) == pytest.approx(expected, rel=4 * torch.finfo(torch.float32).eps)
    assert expected < n * t     # the rows are not independent: fewer samples than rows
    samples = float(_samples(opt))
    opt.precondition()
    z = torch.cat([x.reshape(-1, d) for x in parts])
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, z, _share(samples, d), "trace_per_dim"),
                               rtol=1e-9, atol=1e-12)
    opt.close()


def test_the_ema_count_multiplies_the_independent_rows():
    """precond_ema = 0.9, the same (6, 4, 8) tokens on two steps (lr 0: Sigmabar = Sigma): the second
    step's N_eff is samples times ema_count_factor(0.9, 2)."""
    n, t, d = 6, 4, 8
    layer = nn.Linear(d, 3, bias=False).double()
    x = _tokens(n, t, d, 0.9, seed=2)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count",
               precond_ema=0.9)
    for _ in range(2):
        opt.zero_grad()
        layer(x).square().mean().backward()
        g = layer.weight.grad.clone()
        samples = float(_samples(opt))
        opt.precondition()
    share = _share(samples * ema_count_factor(0.9, 2), d)
    assert 0 < share < 1 / KAPPA     # between the floor and the cap: lambda reads the count
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, x.reshape(-1, d), share, "trace_per_dim"),
                               rtol=1e-9, atol=1e-12)
    opt.close()


def test_the_trace_rule_counts_nothing_and_steps_bit_for_bit_as_with_the_count():
    """The default rule: no statistic carries samples (the capture computes none), and forcing the count
    on changes no bit of a step (params of a token MLP after two AdamW steps)."""
    def run(count):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), damping=1e-3)
        opt.capture.reads = ("samples",) if count else ()
        x = _tokens(8, 5, 6, 0.5, seed=4).float()
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            has = ["samples" in l.stat.extras for l in opt.capture.layers]
            opt.step()
        opt.close()
        return [p.detach().clone() for p in model.parameters()], has

    plain, has_plain = run(False)
    counted, has_counted = run(True)
    assert has_plain == [False, False] and has_counted == [True, True]
    for a, b in zip(plain, counted):
        assert torch.equal(a, b)


class _Heads(nn.Module):
    """a on x, and b on 2 x where ``both`` (a rank that skips a layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 3, bias=False), nn.Linear(16, 3, bias=False)

    def forward(self, x, both):
        return self.a(x).square().mean() + (self.b(2 * x).square().mean() if both else 0.0)


def _ranks_worker(rank, world, init_file, out):
    """Rank 0: a on (8, 8, 16) tokens (rho 0.6) and b on twice them; rank 1: a alone on 10 rows (N, 16),
    each row a sample. Each rank saves its input, G (DDP's average) and M."""
    import torch.distributed as dist
    from ranks import leave_process_group

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(_Heads().double(), find_unused_parameters=True)
    x = _tokens(8, 8, 16, 0.6, seed=6) if rank == 0 else torch.randn(10, 16, dtype=torch.float64,
                                                                       generator=torch.Generator().manual_seed(7))
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    model(x, both=rank == 0).backward()
    inner = model.module
    g = {k: getattr(inner, k).weight.grad.clone() for k in ("a", "b")}
    opt.precondition()
    m = {k: getattr(inner, k).weight.grad.clone() for k in ("a", "b")}
    opt.close()
    del model, opt
    leave_process_group()
    torch.save({"x": x, "g": g, "m": m}, f"{out}.{rank}")


@pytest.mark.slow
def test_two_ranks_add_their_independent_rows_and_agree_on_lambda():
    """DDP on 2 gloo ranks whose inputs differ in design effect (tokens on one, one row per sample on the
    other) and in layers (b runs on rank 0 only: rank 1 sends count 0 for it): no hang, every rank the
    same M, and M the float64 formula on both ranks' rows with N_eff = rank 0's rows / design effect + 10."""
    import os
    import tempfile
    import torch.multiprocessing as mp
    from dopr.sample_count import independent_rows

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_ranks_worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2, join=True)
        r0, r1 = (torch.load(f"{out}.{r}") for r in (0, 1))
    for k in ("a", "b"):
        assert torch.equal(r0["m"][k], r1["m"][k])
    tokens = r0["x"].reshape(-1, 16)
    n_a = float(independent_rows(tokens, 8)) + 10.0
    n_b = float(independent_rows(2 * tokens, 8))
    # float32 sums of 64 rows, here and on the rank: relative error <= 64 eps32 in samples
    tol = 64 * torch.finfo(torch.float32).eps
    assert 1 / KAPPA - (1 - math.sqrt(16 / n_a)) ** 2 > 0.05   # q in (1/4, 1): lambda reads N_eff
    for k, z, n_eff in (("a", torch.cat([tokens, r1["x"]]), n_a), ("b", 2 * tokens, n_b)):
        torch.testing.assert_close(r0["m"][k], ap_reference(r0["g"][k], z, _share(n_eff, 16), "trace_per_dim"),
                                   rtol=tol, atol=1e-12)


def test_a_convolution_counts_its_patches_from_its_pixels():
    """Conv2d: a map constant over space within each sample (a conditioning map) gives identical patches
    within a sample, N = 6 samples of 36 rows each; a 1x1 kernel's patches are its pixels, so samples is
    their rows over design_effect exactly (the same traces; float32 rounding of 6 * 64 rows); an unbatched
    input is one sample, its rows counted as they are."""
    from dopr.sample_count import independent_rows
    g = torch.Generator().manual_seed(8)
    for kernel, x, expected in (
            (3, torch.randn(6, 4, 1, 1, generator=g).expand(6, 4, 8, 8), 6.0),
            (1, _tokens(6, 64, 4, 0.5, seed=9).float().reshape(6, 8, 8, 4).permute(0, 3, 1, 2), None)):
        conv = nn.Conv2d(4, 5, kernel)
        opt = DoPr(conv, torch.optim.SGD(conv.parameters(), lr=0.0), damping_rule="sample_count")
        conv(x).square().mean().backward()
        if expected is None:
            expected = float(independent_rows(x.permute(0, 2, 3, 1).reshape(-1, 4), 6))
            assert expected < 6 * 64 / 2      # rho = 0.5 over 64 pixels: a design effect of about 32
        assert float(_samples(opt)) == pytest.approx(expected, rel=6 * 64 * torch.finfo(torch.float32).eps)
        opt.close()
    conv = nn.Conv2d(4, 5, 3)
    opt = DoPr(conv, torch.optim.SGD(conv.parameters(), lr=0.0), damping_rule="sample_count")
    conv(torch.randn(4, 8, 8, generator=g)).square().mean().backward()
    assert float(_samples(opt)) == 36.0
    opt.close()


def test_a_compiled_forward_counts_its_rows():
    """torch.compile: the probes carry Sigma's sums and the count only, so the rule counts rows there
    (docs/library.md): samples stays unset, N = 24 rows of (6, 4, 8) tokens, q = 1/3, and M is the formula's."""
    import torch._dynamo
    torch._dynamo.reset()
    n, t, d = 6, 4, 8
    layer = nn.Linear(d, 3, bias=False).double()
    x = _tokens(n, t, d, 0.9, seed=2)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=0.0, damping_rule="sample_count")
    torch.compile(layer, backend="aot_eager")(x).square().mean().backward()
    g = layer.weight.grad.clone()
    opt.capture.groups({""})      # the probes' count to the host
    stat = opt.capture.layers[0].stat
    assert "samples" not in stat.extras and stat.count == n * t
    opt.precondition()
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, x.reshape(-1, d), _share(n * t, d), "trace_per_dim"),
                               rtol=1e-9, atol=1e-12)
    opt.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("rule", ["sample_count", "sample_count_seen", "trace"])
def test_an_unseen_token_at_damping_zero_gets_the_pseudo_inverse(rule):
    """N2 (docs/library.md, "Open defects the oracle found"): at damping 0 the rule's lambda on an embedding's
    diagonal Sigma (token counts / n) is 0, and a token no row carried has Sigma_ii = 0. Its gradient column is
    0, so M = G Sigma^+ (the float64 reference's pseudo-inverse): finite, the seen tokens' rows scaled by n /
    count, the unseen ones' 0, and nothing to count."""
    from oracle_reference import ReferenceAP, grad_matrix
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 3))
    before = model[0].weight.detach().clone().double()
    opts = dict(damping=0.0, damping_rule=rule)
    ref = ReferenceAP(model, opts)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=1.0), **opts)
    x = torch.tensor([[0, 1, 1], [2, 3, 0]])                       # tokens 4 and 5 unseen
    model(x).square().sum().backward()
    grads = {p: p.grad.detach().clone() for p in model.parameters()}
    opt.step()
    m = (before - model[0].weight.detach().double()).T            # the reference's layout (d x tokens)
    expected = ref.step(grads)["0"].m
    assert torch.isfinite(m).all()
    torch.testing.assert_close(m, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(m[:, 4:], torch.zeros_like(m[:, 4:]))
    assert grad_matrix(ref.layers[0], grads)[:, 4:].abs().max() == 0
    opt.close()
    ref.close()
