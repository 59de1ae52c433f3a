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
    assert type(opt._damping) is damping.SampleCountRule
    g, m = _step(layer, opt, z, y)
    q = d / n
    share = max(1 / KAPPA - (1 - math.sqrt(min(q, 1.0))) ** 2, d * torch.finfo(torch.float64).eps)
    assert torch.isfinite(m).all()
    torch.testing.assert_close(m, ap_reference(g, z, share, "trace_per_dim"), rtol=1e-9, atol=1e-12)
    opt.close()


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
    with pytest.raises(ValueError, match=r"Invalid damping_rule: 'mp' \(choose from \('trace', 'sample_count'\)\)"):
        DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping_rule="mp")


def test_the_rule_and_a_weak_share_bound_together_are_refused():
    layer, _, _ = _layer_and_data(4, 3)
    with pytest.raises(ValueError, match=r"weak_share_bound=0.25 raises the trace rule's lambda, and "
                                         r"damping_rule='sample_count' chooses another rule: set one of them"):
        DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping_rule="sample_count",
             weak_share_bound=0.25, weak_share_estimate="filter")
