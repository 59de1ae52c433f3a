"""What a DoPr step costs on the host: device read-backs (host syncs) and aten ops per layer, counted by
the profiler outside the base optimizer's own step (issue "DoPr at the paper's cost on a GPU"), and the
dtypes the covariance GEMM receives under autocast."""
import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import dopr
from dopr import statistics
from dopr.damping import trace_floor

#: every read of a device value to the host goes through _local_scalar_dense (item(), bool(), float())
SYNCS = ("aten::_local_scalar_dense",)


def _mlp(layers, width=32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def _profiled_step(gp, layers, ap=None):
    """aten events of one training step (forward, backward, step, zero_grad) after two warm-up steps,
    as (name, inside the base optimizer's own step) pairs."""
    model = _mlp(layers)
    opt = dopr.build(model, gp, ap=ap, lr=1e-3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(), step()
    base = f"Optimizer.step#{type(getattr(opt, 'base', opt)).__name__}.step"   # the GP's own step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out = []
    for e in prof.events():
        if e.name.startswith("aten::"):
            p = e.cpu_parent
            while p is not None and p.name != base:
                p = p.cpu_parent
            out.append((e.name, p is not None))
    return out


@pytest.fixture
def device_path(monkeypatch):
    """The step as it runs on an accelerator: no LAPACK cholesky_solve / cholesky_inverse, whose status
    reads the CPU path keeps (they wait for nothing there)."""
    from dopr import solvers

    monkeypatch.setattr(solvers, "LAPACK_DEVICES", set())


@pytest.mark.parametrize("layers", [4, 16])
def test_a_dopr_step_reads_the_device_once_whatever_the_layer_count(layers, device_path):
    # before: 7 (4 layers) and 19 (16) reads: the non-finite checks, the Cholesky info check and one
    # cholesky_solve status read per layer; now the step's one flag (non-finite Sigma or G, a factor to retry)
    events = _profiled_step("adamw", layers, ap={})
    syncs = [n for n, in_base in events if n in SYNCS and not in_base]
    assert len(syncs) == 1
    gp = _profiled_step("adamw", layers)
    assert [n for n, in_base in gp if n in SYNCS and not in_base] == []   # the count is DoPr's own


@pytest.mark.parametrize("solve_space", ["features", "auto"])
def test_dopr_adds_at_most_20_aten_ops_per_preconditioned_layer(device_path, solve_space, monkeypatch):
    # 16 identical Linear layers (with bias): the work is grouped by shape (one stack, factorisation and
    # solve per size), so what is left per layer is the forward hook's statistics (features: one GEMM of
    # [z, 1]; auto, here 16 rows < d = 33: the rows [z, 1] kept, one concatenation), and M written back
    # (dopr/buckets.py: G read by concatenation, M by two foreach copies from views made once). Before:
    # 134 per layer, then 39 (a7af4b7: the homogeneous blocks written through views, a division per Sigma,
    # G and M copied layer by layer).
    layers = 16
    from dopr import solve_space as rule
    monkeypatch.setitem(rule.SOLVE_SPACE_TABLE, "cpu", "samples")   # "auto" here: sample space where n < d
    extra = len(_profiled_step("adamw", layers, ap={"solve_space": solve_space})) - len(_profiled_step("adamw", layers))
    assert 0 < extra / layers <= 20, extra / layers


@pytest.mark.parametrize("lapack", [True, False])
def test_same_size_layers_are_solved_in_one_batched_call(monkeypatch, lapack):
    from dopr import solvers

    monkeypatch.setattr(solvers, "LAPACK_DEVICES", {"cpu"} if lapack else set())
    model = _mlp(3, width=8)
    opt = dopr.build(model, "sgd", ap={}, lr=0.0)
    calls = []
    name, module = ("cholesky_solve", torch) if lapack else ("solve_triangular", torch.linalg)
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda b, a, *args, **k: calls.append(tuple(b.shape)) or real(b, a, *args, **k)
                        if lapack else calls.append(tuple(a.shape)) or real(b, a, *args, **k))
    model(torch.randn(32, 8)).pow(2).sum().backward()
    opt.step()
    # L L^T M^T = G^T for the three layers at once: one cholesky_solve, or two triangular solves
    assert calls == ([(3, 9, 8)] if lapack else [(3, 9, 8), (3, 9, 8)])


class _GemmDtypes(TorchDispatchMode):
    """Records the input dtypes (and out_dtype) of every mm / bmm, and runs the half-precision-in,
    float32-out GEMMs that only CUDA implements on the CPU as what they are: float32 accumulation of the
    exact products of the inputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
            out_dtype = args[2] if len(args) > 2 else kwargs.get("out_dtype")
            self.calls.append((func.overloadpacket.__name__, args[0].dtype, args[1].dtype, out_dtype))
            if out_dtype is not None:
                return func.overloadpacket(args[0].float(), args[1].float())
        return func(*args, **kwargs)


@pytest.mark.parametrize("rows", [300, 2 * statistics.GRAM_CHUNK_ROWS + 100])
def test_under_autocast_sigma_is_formed_from_the_half_precision_activations(monkeypatch, rows):
    # where the device's GEMM accumulates bf16 inputs in float32 (CUDA), Sigma takes the autocast
    # activations as they are: no float32 copy, and exact on the inputs up to float32 accumulation.
    # The CPU has no such GEMM: the test lets the CPU stand for it and runs the GEMM as CUDA would.
    monkeypatch.setattr(statistics, "LOW_PRECISION_GRAM_DEVICES", {"cpu"})
    torch.manual_seed(0)
    z = torch.randn(rows, 24).bfloat16()
    with _GemmDtypes() as mode:
        stat = statistics.DenseCovariance.from_activations(z, homogeneous=True)
    assert mode.calls and all(c[1:] == (torch.bfloat16, torch.bfloat16, torch.float32) for c in mode.calls)
    assert [c[0] for c in mode.calls] == (["mm"] if rows <= statistics.GRAM_CHUNK_ROWS else ["bmm", "mm"])
    s = stat.sums[0]
    assert s.dtype == torch.float32
    z64 = torch.cat([z.double(), torch.ones(rows, 1, dtype=torch.float64)], 1)
    want = z64.T @ z64
    # float32 sums of at most GRAM_CHUNK_ROWS exact products each, then the chunks: (chunk + n / chunk)
    # units of float32 roundoff relative to the sums of |z_i z_j|
    bound = (statistics.GRAM_CHUNK_ROWS + rows / statistics.GRAM_CHUNK_ROWS) * 2**-24 * (z64.abs().T @ z64.abs())
    assert ((s.double() - want).abs() <= bound).all()


def test_the_cpu_covariance_gemm_gets_float32_from_half_precision_activations():
    # without a float32-accumulating half-precision GEMM, z is upcast first (the default on the CPU)
    z = torch.randn(64, 16).bfloat16()
    with _GemmDtypes() as mode:
        statistics.DenseCovariance.from_activations(z, homogeneous=False)
    assert mode.calls == [("mm", torch.float32, torch.float32, None)]


def test_autocast_training_feeds_the_gemm_bf16_activations(monkeypatch):
    # the whole path under torch.autocast: every hooked layer's input reaches the covariance GEMM as
    # bf16, the first layer's float32 input too, cast as autocast casts it for the layer's own GEMM
    monkeypatch.setattr(statistics, "LOW_PRECISION_GRAM_DEVICES", {"cpu"})
    model = _mlp(3, width=16)
    opt = dopr.build(model, "adamw", ap={"solve_space": "features"}, lr=1e-3)   # 8 rows < d: Sigma, not the rows
    with _GemmDtypes() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 16)).float().square().mean()
    gram_calls = [c for c in mode.calls if c[3] == torch.float32]
    assert len(gram_calls) == 3
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert collections.Counter(c[1] for c in gram_calls) == {torch.bfloat16: 3}


@pytest.mark.parametrize("low_precision_gemm", [True, False])
def test_under_autocast_a_float32_input_reaches_sigma_as_the_layer_multiplies_it(monkeypatch, low_precision_gemm):
    # a layer fed float32 under autocast has its Sigma formed from bf16(x), bit for bit the cast its own
    # GEMM multiplies, where the GEMM accumulates bf16 in float32 (CUDA; the CPU stands in) and elsewhere
    # (the CPU's default, which upcasts it for the gram; issue 62)
    monkeypatch.setattr(statistics, "LOW_PRECISION_GRAM_DEVICES", {"cpu"} if low_precision_gemm else set())
    seen = []
    original = statistics.DenseCovariance.from_activations.__func__
    monkeypatch.setattr(statistics.DenseCovariance, "from_activations",
                        classmethod(lambda cls, z, homogeneous: (seen.append(z), original(cls, z, homogeneous))[1]))
    torch.manual_seed(0)
    layer = nn.Linear(16, 4)
    opt = dopr.build(layer, "sgd", ap={}, lr=1e-3)
    x = torch.randn(64, 16) * 3
    with _GemmDtypes(), torch.autocast("cpu", dtype=torch.bfloat16):   # (runs the CPU's mm as CUDA's)
        layer(x).float().sum().backward()
    opt.step()
    assert len(seen) == 1
    want = x.bfloat16()
    assert seen[0].dtype == want.dtype and torch.equal(seen[0].reshape(want.shape), want)


def test_with_a_cached_inverse_the_refresh_step_still_reads_the_device_once(monkeypatch):
    # precond_every=2: the refresh step inverts each size's factors in one batched call, off the CPU
    # without cholesky_inverse's status read (one per call; on the CPU potri, whose read waits for
    # nothing, is kept: the test takes the device path); the step in between applies the cached inverses
    from dopr import solvers

    monkeypatch.setattr(solvers, "LAPACK_DEVICES", set())
    model = _mlp(4, width=16)
    opt = dopr.build(model, "adamw", ap={"precond_every": 2}, lr=1e-3)
    x = torch.randn(32, 16)
    reads = []
    for _ in range(4):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).square().mean().backward()
            opt.precondition()
        reads.append(sum(e.name in SYNCS for e in prof.events()))
        opt.zero_grad()
    assert reads == [1, 1, 1, 1]


@pytest.mark.parametrize("potri", [True, False])
def test_the_cached_inverse_is_the_damped_inverse(monkeypatch, potri):
    from dopr import solvers

    monkeypatch.setattr(solvers, "LAPACK_DEVICES", {"cpu"} if potri else set())
    torch.manual_seed(0)
    x = torch.randn(64, 12, dtype=torch.float64)
    sigma = x.T @ x / 64
    lam = torch.tensor([1e-3 * float(sigma.trace())], dtype=torch.float64)
    op = solvers.CholeskyBatch(sigma[None].clone(), lam, 1e-6).ops()[0]
    p = solvers.cached({("a",): op})[("a",)].p
    want = torch.linalg.inv(sigma + lam * torch.eye(12, dtype=torch.float64))
    # float64: the inverse's error is ~cond(A) * eps, cond(A) <= (tr + lam) / lam ~ 1e3
    torch.testing.assert_close(p, want, rtol=1e-10, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize("lapack", [True, False])
def test_the_steps_numeric_core_compiles_whole(monkeypatch, lapack):
    # What a CUDA graph would capture (issue 61 item 4): the calls DoPr.precondition makes on its default
    # path, in its order: Sigma from the activations (the forward hook's), the batch's Sigma stacked and
    # divided by the counts, the damping and finiteness flags, the Cholesky factor with its trouble flags,
    # the batched apply. torch.compile(fullgraph=True) raises on a graph break, which any read of a device
    # value to the host (a bool(), an .item(), a data-dependent branch) would be. The compiled result
    # equals eager's within float32 rounding.
    from dopr import solvers
    from dopr.statistics import DenseCovariance

    monkeypatch.setattr(solvers, "LAPACK_DEVICES", {"cpu"} if lapack else set())

    def core(z, g):
        stats = [DenseCovariance.from_activations(z[i], True) for i in range(z.shape[0])]
        sigma, lam, finite = DenseCovariance.prepare(DenseCovariance.stacked_mean(stats), trace_floor(1e-3, "trace"), False)
        batch = solvers.CholeskyBatch(sigma, lam.to(sigma.dtype), 1e-6)
        return solvers.apply_stack(batch.ops(), g), batch.trouble | ~finite

    gen = torch.Generator().manual_seed(0)
    z, g = torch.randn(3, 16, 7, generator=gen), torch.randn(3, 5, 8, generator=gen)
    torch._dynamo.reset()
    m, trouble = torch.compile(core, fullgraph=True, backend="eager")(z, g)
    m_eager, trouble_eager = core(z, g)
    assert not trouble.any() and not trouble_eager.any()
    torch.testing.assert_close(m, m_eager)


class _Gemms(TorchDispatchMode):
    """Counts the GEMMs (mm, addmm, bmm, baddbmm) a region runs, by op."""

    OPS = ("mm", "addmm", "bmm", "baddbmm")

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_between_refreshes_adds_one_gemm_per_bucket():
    # issue 61 item 5: with no statistics EMA, a step whose Sigma will not be used gathers no activations
    # (no covariance GEMM in the forward) and applies the cached inverses, one batched GEMM per bucket of
    # same-shape layers, over the GP's own step. 64 rows for d = 33: the feature-space solve (with fewer
    # rows than d, solve_space="auto" caches the rows and their n x n factor instead, dopr/sample_space.py)
    def gemms(gp, steps_before, ap=None):
        model = _mlp(4)
        opt = dopr.build(model, gp, ap=ap, lr=1e-3)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(steps_before):
            step()
        with _Gemms() as counter:
            step()
        return counter.calls

    gp = gemms("adamw", 1)
    between = gemms("adamw", 1, ap={"precond_every": 10})       # step 2 of 10: the cached inverses
    assert sum(between.values()) == sum(gp.values()) + 1     # 4 layers of one shape: one bucket, one bmm
    assert between["bmm"] == gp["bmm"] + 1
    refresh = gemms("adamw", 10, ap={"precond_every": 10})      # step 11: a refresh, one covariance GEMM per layer
    assert refresh["mm"] == gp["mm"] + 4 and between["mm"] == gp["mm"]
