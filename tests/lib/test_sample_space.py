"""The AP solved in sample space (dopr/sample_space.py): M = (1/lam)(G - (G Xs^T)(K + lam I)^-1 Xs) with
K = Xs Xs^T, for layers that see fewer rows n than their dimension d, equals the feature-space solve
G (Sigma + lam I)^-1 (float64: to 1e-10 relative), and the d x d Sigma is not formed."""
import copy

import pytest
import torch
from torch import nn

from dopr import DoPr
from dopr.sample_space import SampleRows
from dopr.statistics import DenseCovariance

RTOL = 1e-10


@pytest.fixture(autouse=True)
def _auto_takes_sample_space_wherever_n_is_below_d(monkeypatch):
    """These layers are small, where the CPU's rule for "auto" (dopr/solve_space.py: the measured table, else
    the FLOP rule) takes the feature space: here "auto" takes the sample space wherever n < d (the rule before
    issue 73), so that what is tested is the sample-space solve. The rule itself: tests/lib/test_routes_and_space.py."""
    from dopr import solve_space
    monkeypatch.setitem(solve_space.SOLVE_SPACE_TABLE, "cpu", "samples")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 30, bias=False), nn.Tanh(),
                         nn.Linear(30, 5)).double()


def _data(n=12, d=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).double(), torch.randn(n, 5, generator=g).double()


def _grads(model, batches, steps=1, **options):
    """Each parameter's gradient as the GP received it (M) after `steps` steps of SGD, over micro-batches
    `batches` per step, with the AP's counters."""
    model = copy.deepcopy(model)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
    for _ in range(steps):
        opt.zero_grad()
        for x, y in batches:
            ((model(x) - y) ** 2).sum().backward()
        opt.step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, opt.stats()


def _assert_same(a: dict, b: dict, rtol=RTOL):
    for n in a:
        err = (a[n] - b[n]).norm() / b[n].norm()
        assert err < rtol, f"{n}: relative difference {err:.2e}"


@pytest.mark.parametrize("damping_mode", ["trace", "trace_per_dim", "absolute", "trace_activations"])
def test_linear_layers_in_sample_space_equal_the_feature_space_solve(damping_mode):
    model, batch = _mlp(), [_data()]          # 12 rows for d = 25, 41, 30: every layer in sample space
    opts = dict(damping=1e-3, damping_mode=damping_mode)
    rows, stats = _grads(model, batch, steps=2, **opts)
    features, fstats = _grads(model, batch, steps=2, solve_space="features", **opts)
    _assert_same(rows, features)
    assert stats["sample_space_solves"] == 6 and fstats["sample_space_solves"] == 0
    assert stats["factorizations"] == fstats["factorizations"] == 6


def test_the_step_keeps_the_rows_and_forms_no_sigma():
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    ((model(x) - y) ** 2).sum().backward()
    kept = [layer.stat for layer in opt.capture.layers]
    assert all(isinstance(s, SampleRows) for s in kept)
    assert [tuple(s.rows.shape) for s in kept] == [(12, 25), (12, 40), (12, 31)]   # [z, 1] with a bias
    assert torch.equal(kept[0].rows[:, :24], x) and bool((kept[0].rows[:, 24] == 1).all())


def test_micro_batches_append_rows_and_become_sigma_when_they_reach_d():
    model = _mlp()
    batches = [_data(9, seed=s) for s in (1, 2, 3)]    # 9, 18, 27 rows: the 25-dim layer's reach d
    copied = copy.deepcopy(model)
    opt = DoPr(copied, torch.optim.SGD(copied.parameters(), lr=0.1))
    for x, y in batches:
        ((copied(x) - y) ** 2).sum().backward()
    kinds = [type(layer.stat) for layer in opt.capture.layers]
    assert kinds == [DenseCovariance, SampleRows, SampleRows]    # d = 25: Sigma; d = 40, 31 keep 27 rows
    rows, _ = _grads(model, batches)
    features, _ = _grads(model, batches, solve_space="features")
    _assert_same(rows, features)


def test_forced_sample_space_with_more_rows_than_d_still_equals_the_feature_space_solve():
    model, batch = _mlp(), [_data(50)]
    rows, stats = _grads(model, batch, damping=1e-3, solve_space="samples")
    features, _ = _grads(model, batch, damping=1e-3)
    _assert_same(rows, features)
    assert stats["sample_space_solves"] == 3


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)                 # 2 x 2 positions per sample
        self.pixels = nn.Conv2d(16, 4, 3, padding=1)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.pixels(self.conv(x).tanh()).flatten(1))


@pytest.mark.parametrize("conv2d", ["full", "sua"])
def test_convolutions_in_sample_space_equal_the_feature_space_solve(conv2d):
    torch.manual_seed(0)
    model = _ConvNet().double()
    g = torch.Generator().manual_seed(1)
    batch = [(torch.randn(3, 3, 4, 4, generator=g).double(), torch.randn(3, 2, generator=g).double())]
    rows, stats = _grads(model, batch, steps=2, damping=1e-3, conv2d=conv2d)
    features, _ = _grads(model, batch, steps=2, damping=1e-3, conv2d=conv2d, solve_space="features")
    _assert_same(rows, features)
    # full: 12 patch rows for d = 28 and 145; SUA: 48 pixels for 3 channels (Sigma), 12 for 16 channels;
    # the head: 3 rows for d = 17
    assert stats["sample_space_solves"] == 2 * (3 if conv2d == "full" else 2)


def test_lora_adapters_in_sample_space_equal_the_feature_space_solve():
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.q_proj(x) + self.v_proj(x).tanh()

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(Block(), cfg).double()
    for p in model.parameters():  # peft initialises lora_B to zero; make the gradient of A non-zero
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(1)
    batch = [(torch.randn(2, 5, 32, generator=g).double(), torch.randn(2, 5, 32, generator=g).double())]
    rows, stats = _grads(model, batch, steps=2, damping=1e-3)
    features, _ = _grads(model, batch, steps=2, damping=1e-3, solve_space="features")
    _assert_same(rows, features)
    # lora_A (d = 32) of q and v read the same x: one group, 10 rows; lora_B (d = 4) forms Sigma
    assert stats["sample_space_solves"] == 2 * 1 and stats["factorizations"] == 2 * 3


def test_a_cached_sample_space_operator_is_reused_and_checkpointed():
    model, batches = _mlp(), [[_data(seed=s)] for s in range(4)]

    def run(opts, load_from=None):
        m = copy.deepcopy(model)
        opt = DoPr(m, torch.optim.SGD(m.parameters(), lr=1e-3), damping=1e-3, precond_every=2, **opts)
        out = []
        for i, batch in enumerate(batches):
            if i == 1 and load_from is not None:   # between a refresh and the step that reuses its operator
                opt.load_state_dict(load_from)
            opt.zero_grad()
            for x, y in batch:
                ((m(x) - y) ** 2).sum().backward()
            opt.step()
            out.append({n: p.grad.clone() for n, p in m.named_parameters()})
            if i == 0:
                saved = copy.deepcopy(opt.state_dict())
        return out, saved, opt.stats()

    rows, saved, stats = run({})
    features, _, _ = run({"solve_space": "features"})
    for a, b in zip(rows, features):
        _assert_same(a, b)
    assert stats["sample_space_solves"] == 2 * 3 and stats["refreshes"] == 2
    assert {s["type"] for s in saved["dopr"]["cache"].values()} == {"SampleSpaceInverse"}
    resumed, _, _ = run({}, load_from=saved)
    for a, b in zip(rows[1:], resumed[1:]):
        _assert_same(a, b)


def test_a_factor_without_damping_falls_back_to_the_feature_space_solve():
    """Woodbury needs lambda > 0: a zero damping (a schedule reaching 0) is solved from Sigma by the
    feature-space solver (here its pseudo-inverse of the singular Sigma), counted."""
    model, batch = _mlp(), [_data()]
    rows, stats = _grads(model, batch, damping=lambda step: 0.0, solve_space="samples")
    features, fstats = _grads(model, batch, damping=0.0)
    _assert_same(rows, features)
    assert stats["sample_space_fallbacks"] == 3 and stats["eigh_fallbacks"] == fstats["eigh_fallbacks"] == 3


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_nonfinite_rows_follow_the_nonfinite_rules(on_nonfinite):
    model = _mlp()
    x, y = _data()
    x[3, 5] = float("nan")
    if on_nonfinite == "raise":
        with pytest.raises(FloatingPointError, match=r"non-finite activation covariance in DoPr layer\(s\) \['0'"):
            _grads(model, [(x, y)], on_nonfinite="raise")
        return
    with pytest.warns(RuntimeWarning, match="non-finite activation covariance"):
        rows, stats = _grads(model, [(x, y)])
    assert stats["nonfinite_skips"] == 3 and stats["sample_space_solves"] == 3
    assert all(torch.isnan(g).any() for g in rows.values())      # the raw (non-finite) gradient, to the GP


def test_float32_rows_keep_the_feature_space_accuracy():
    """Against a float64 solve: the float32 model's sample-space M is as accurate as its feature-space M
    (the n x n side in float64), at the default damping and at 1e-6."""
    model, (x, y) = _mlp(), _data()
    for damping in (1e-4, 1e-6):
        exact, _ = _grads(model, [(x, y)], damping=damping, solve_space="features")
        errs = {}
        for space in ("samples", "features"):
            m32, _ = _grads(model.float(), [(x.float(), y.float())], damping=damping, solve_space=space)
            model.double()
            errs[space] = max(float((m32[n].double() - exact[n]).norm() / exact[n].norm()) for n in exact)
        assert errs["samples"] <= 10 * errs["features"], (damping, errs)


# ------------------------------------------------------------------ float32 against the float64 formula
U32, U64 = 2.0 ** -24, 2.0 ** -53      # unit roundoffs


def _one_layer(x, **options):
    """One float32 Linear(d, 5) on rows x, one step: (G, M, stats) with G = [W.grad | b.grad] as the
    backward gave it and M what DoPr handed the GP (both float64 copies of the float32 matrices)."""
    torch.manual_seed(0)
    layer = nn.Linear(x.shape[1], 5)
    y = torch.randn(len(x), 5, generator=torch.Generator().manual_seed(2))
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), **options)
    ((layer(x) - y) ** 2).sum().backward()
    g = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()
    opt.step()
    return g, torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double(), opt.stats()


def _formula(x, g, damping, mode="trace"):
    """(M, cond(Sigma + lam I)) of M = G (Sigma + lam I)^-1 in float64, Sigma = [x, 1]^T [x, 1] / n."""
    z = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    sigma = z.T @ z / len(z)
    a = sigma + (damping * sigma.trace() if mode == "trace" else damping) * torch.eye(len(sigma), dtype=torch.float64)
    e = torch.linalg.eigvalsh(a)
    return torch.linalg.solve(a, g.T).T, float(e[-1] / e[0])


def _error(m, exact):
    return float((m - exact).norm() / exact.norm())


def test_float32_rows_at_a_small_absolute_damping_keep_the_float64_formula():
    """Inputs of scale 1e4, absolute damping 1e-3: cond(Sigma + lam I) ~ 6e11. The apply's cancellation
    G - (G Xs^T)(K + lam I)^-1 Xs = lam M runs in float64 (and Xs = X / sqrt(n) is not rounded to float32), so M
    is the formula's to float32's rounding plus float64's times cond (1.9e-5); in float32 it was off by 2.3x
    (relative), not counted. (float32's roundoff times cond, 3e4, would bound nothing here.)"""
    x = torch.randn(12, 24, generator=torch.Generator().manual_seed(1)) * 1e4
    g, m, stats = _one_layer(x, damping=1e-3, damping_mode="absolute", solve_space="samples")
    exact, cond = _formula(x, g, 1e-3, "absolute")
    assert cond > 1e11 and _error(m, exact) <= 2 * (U32 + U64 * cond), (_error(m, exact), cond)
    assert stats["sample_space_solves"] == 1 and stats["sample_space_fallbacks"] == 0


@pytest.mark.parametrize("damping", [1e-4, 1e-6])
def test_float32_rows_with_columns_spanning_1e8_keep_the_feature_space_accuracy(damping):
    """Unnormalised features (columns of scale 1e-4..1e4) at 8 rows for d = 33: against the float64 formula the
    sample-space M is no worse than 10x the feature-space solve's (the Cholesky solve is insensitive to the
    column scales, the cancellation is not): in float32 it was 290-1000x at 1e-4 and 2800-5000x at 1e-6; in
    float64 it is M's float32 rounding (2-3e-8)."""
    for seed in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-4, 4, 32)
        errs = {}
        for space in ("samples", "features"):
            g, m, _ = _one_layer(x, damping=damping, solve_space=space)
            exact, cond = _formula(x, g, damping)
            errs[space] = _error(m, exact)
        assert errs["samples"] <= 10 * errs["features"], (seed, errs)
        assert errs["samples"] <= 2 * (U32 + U64 * cond), (seed, errs, cond)


def test_a_sample_space_solve_that_would_lose_its_digits_is_solved_in_feature_space_and_counted():
    """Absolute damping 1e-9 on inputs of scale 1e4: eps64 tr(Sigma) / lam ~ 500, float64 keeps no digit of
    the cancellation. The solve is trouble (solved from Sigma, whose factor lost lam and is retried at 10x the
    damping floor, as the feature-space solve's is), counted; it went uncounted before."""
    x = torch.randn(12, 24, generator=torch.Generator().manual_seed(1)) * 1e4
    _, m, stats = _one_layer(x, damping=1e-9, damping_mode="absolute", solve_space="samples")
    g, m_features, fstats = _one_layer(x, damping=1e-9, damping_mode="absolute", solve_space="features")
    assert stats["sample_space_fallbacks"] == 1
    assert stats["cholesky_retries"] == fstats["cholesky_retries"] == 1
    z = torch.cat([x.double(), torch.ones(12, 1, dtype=torch.float64)], 1)
    retried = 10 * 1e-6 * float((z.square().sum() / 12)) / 25        # 10x the floor, 1e-6 tr(Sigma) / d
    exact, cond = _formula(x, g, retried, "absolute")
    assert _error(m, exact) <= 2 * (U32 + U64 * cond) and _error(m_features, exact) <= 2 * U32 * cond


def test_forced_sample_space_names_what_it_cannot_do():
    for kw, why in [(dict(solver="eigh"), "solver='eigh' factors Sigma itself"),
                    (dict(precond_ema=0.9), "precond_ema keeps an EMA of Sigma itself"),
                    (dict(health_every=1), "health_every and weak_share_bound read Sigma's spectrum"),
                    (dict(damping=0.0), "damping 0")]:
        with pytest.raises(ValueError, match=r"Invalid solve_space: 'samples' \(" + why.replace("(", r"\(")):
            DoPr(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), solve_space="samples", **kw)
    # auto keeps to the feature space where sample space cannot run
    _, stats = _grads(_mlp(), [_data()], precond_ema=0.5)
    assert stats["sample_space_solves"] == 0 and stats["factorizations"] == 3


# ------------------------------------------------------------------ data parallel: rows on several ranks
ROWS = (16, 11)      # uneven: 27 rows in all, >= d = 25 for the first layer (Sigma), < 40 and 31 (rows)


def _global_batch():
    return _data(sum(ROWS), seed=3)


def _rank_grads(model, loss, **options):
    """Each step's M (whole matrices) over 2 steps of ``loss(model)``."""
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-3), damping=1e-3, **options)
    out = []
    for _ in range(2):
        opt.zero_grad()
        loss(model).backward()
        opt.step()
        out.append({n.removeprefix("module."): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                    .clone() for n, p in model.named_parameters() if p.grad is not None})
    return out, opt.stats()


def _squares(x, y):
    """The loss summed over the rows: the data-parallel mean of 2 ranks' sums is the whole batch's sum / 2."""
    return lambda m: ((m(x) - y) ** 2).sum()


class _Heads(nn.Module):
    """Two Linear(40, 40); ``both=False`` runs the first only (a rank that skips a layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(40, 40), nn.Linear(40, 40)

    def forward(self, x, both=True):
        return self.a(x).tanh() + self.b(2 * x) if both else self.a(x).tanh()   # b: not a's input, its own group


def _heads_data():
    x = torch.randn(sum(ROWS), 40, generator=torch.Generator().manual_seed(4)).double()
    return x[:ROWS[0]], x[ROWS[0]:]


def _rank_worker(rank, world, init_file, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from ranks import leave_process_group

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from dopr import solve_space
    solve_space.SOLVE_SPACE_TABLE["cpu"] = "samples"     # this process's: the module fixture's rule
    x, y = _global_batch()
    mine = slice(sum(ROWS[:rank]), sum(ROWS[:rank + 1]))
    result = {}
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    result["ddp"] = _rank_grads(ddp, _squares(x[mine], y[mine]))
    sharded = _mlp()
    for i in (0, 2, 4):
        fully_shard(sharded[i])
    fully_shard(sharded)
    result["fsdp2"] = _rank_grads(sharded, _squares(x[mine], y[mine]))
    heads = nn.parallel.DistributedDataParallel(_Heads().double(), find_unused_parameters=True)
    result["partial"] = _rank_grads(heads, lambda m: m(_heads_data()[rank], both=rank == 0).square().sum())
    ddp = sharded = heads = None
    leave_process_group()
    if rank == 0:
        torch.save(result, out)


@pytest.fixture(scope="module")
def two_ranks():
    from ranks import rank0_result

    return rank0_result(_rank_worker)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_rows_on_two_ranks_are_gathered_and_equal_the_whole_batch_feature_space_solve(two_ranks, wrapper):
    x, y = _global_batch()
    expected, _ = _rank_grads(_mlp(), lambda m: _squares(x, y)(m) / 2, solve_space="features")
    got, stats = two_ranks[wrapper]
    for a, b in zip(got, expected):
        _assert_same(a, b)
    # 27 rows in all: the 25-dim layer forms Sigma (each rank alone had fewer than 25), the others gather rows
    assert stats["sample_space_solves"] == 2 * 2 and stats["factorizations"] == 2 * 3


def test_layers_of_one_shape_with_other_row_counts_are_solved_each_with_its_rows():
    """Two Linear(24, 24) reading 12 and 7 rows: one gradient bucket, two factor batches."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(24, 24), nn.Linear(24, 24)

        def forward(self, xs):
            return self.a(xs[0]).tanh().sum(0) + self.b(xs[1]).tanh().sum(0)

    torch.manual_seed(0)
    model = Two().double()
    g = torch.Generator().manual_seed(1)
    batch = [((torch.randn(12, 24, generator=g).double(), torch.randn(7, 24, generator=g).double()),
              torch.randn(24, generator=g).double())]
    for every in (1, 2):      # the step's own factors, and the cached operators of the refresh before
        rows, stats = _grads(model, batch, steps=2, damping=1e-3, precond_every=every)
        features, _ = _grads(model, batch, steps=2, damping=1e-3, precond_every=every, solve_space="features")
        _assert_same(rows, features)
        assert stats["sample_space_solves"] == 2 * (3 - every)


@pytest.mark.slow
def test_a_layer_that_one_rank_skips_is_solved_from_the_other_ranks_rows(two_ranks):
    """Rank 1 runs head a only: b's rows are rank 0's 16 (rank 1 holds no rows for it), a's all 27."""
    x0, x1 = _heads_data()
    expected, _ = _rank_grads(_Heads().double(), lambda m: (m(x0).square().sum() + m(x1, both=False).square().sum()) / 2,
                              solve_space="features")
    got, stats = two_ranks["partial"]
    for a, b in zip(got, expected):
        _assert_same(a, b)
    assert stats["sample_space_solves"] == 2 * 2


def _exact(z, g, lam):
    """M = G (Z^T Z / n + lam I)^-1 in exact rational arithmetic from the float64 inputs (Gauss-Jordan)."""
    from fractions import Fraction as F
    n, d = z.shape
    zf = [[F(float(v)) for v in row] for row in z.tolist()]
    a = [[sum(zf[k][i] * zf[k][j] for k in range(n)) / n + (F(lam) if i == j else 0) for j in range(d)]
         for i in range(d)]
    rhs = [[F(float(v)) for v in row] for row in g.T.tolist()]              # A M^T = G^T
    for c in range(d):
        piv = a[c][c]
        for r in range(d):
            if r != c and a[r][c] != 0:
                f = a[r][c] / piv
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
                rhs[r] = [x - f * y for x, y in zip(rhs[r], rhs[c])]
    return torch.tensor([[float(rhs[i][j] / a[i][i]) for i in range(d)] for j in range(len(rhs[0]))],
                        dtype=torch.float64)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_forced_sample_space_is_kept_only_where_it_loses_no_more_than_feature_space(n):
    """Issue 73, N5: float64 Linear(2, 2), n rows of scale 100 around 3, absolute damping 1e-3 (cond(Sigma + lam I)
    ~ 1e7-1e8): the Woodbury apply's rounding is the feature-space solve's amplified by cond(K + lam I) (nearly
    collinear rows; at n >= d, K singular, cond(Sigma + lam I) itself), up to 1.8e-6 off (n = 2) and 1.8e-5
    (n = 4) against the feature-space bound u (n + d + 4)(1 + cond), nothing counted. Such rows are now solved in
    feature space where the pivots of K + lam I spread over more than n + d, counted in sample_space_fallbacks."""
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(n, 2, generator=gen, dtype=torch.float64) + 3.0) * 100.0
        torch.manual_seed(seed)
        layer = nn.Linear(2, 2).double()
        opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=1e-3, damping_mode="absolute",
                   solve_space="samples")
        (layer(x) - torch.randn(n, 2, generator=gen, dtype=torch.float64)).square().sum().backward()
        g = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).clone()
        opt.step()
        m = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
        z = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
        exact = _exact(z, g, 1e-3)
        e = torch.linalg.eigvalsh(z.T @ z / n + 1e-3 * torch.eye(3, dtype=torch.float64))
        assert _error(m, exact) <= U64 * (n + 3 + 4) * (1 + float(e[-1] / e[0])), (seed, _error(m, exact))
        assert opt.stats()["sample_space_solves"] == 1
