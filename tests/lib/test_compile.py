"""torch.compile: DoPr's capture traces into the model's graph (no graph break, no recompilation from
step to step, fullgraph=True trains) and gives the eager result."""
import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import dopr
from dopr import DoPr

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (6, 12), generator=g), torch.randn(6, 12, 4, generator=g)


def _train(forward, opt, steps=4):
    x, y = _data()
    for _ in range(steps):
        opt.zero_grad()
        for mb in (slice(0, 3), slice(3, 6)):  # two micro-batches per step
            ((forward(x[mb]) - y[mb]) ** 2).mean().backward()
        opt.step()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """A clean dynamo and its module-hook guards as torch ships them (skipped) for each test."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield
    torch._dynamo.reset()


def test_the_capture_breaks_no_graph():
    model = _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    explained = torch._dynamo.explain(model)(_data()[0])
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert opt.pending_samples() == {"0": 0, "1": 0, "3": 0, "5": 0}  # traced, not backpropagated


@pytest.mark.slow
@pytest.mark.parametrize("base", ["sgd", "adamw"])
def test_compiled_fullgraph_training_equals_eager(base):
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[base]
    eager = _model()
    opt = DoPr(eager, make(eager.parameters()), damping=1e-3)
    _train(eager, opt)
    model = _model()
    copt = DoPr(model, make(model.parameters()), damping=1e-3)
    _train(torch.compile(model, fullgraph=True), copt)
    assert copt.stats()["preconditioned"] == opt.stats()["preconditioned"] == 4 * 4
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # compiled once, never again


def test_refresh_and_reuse_steps_compile_one_graph_each():
    model = _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), precond_every=2)
    _train(torch.compile(model, backend="aot_eager", fullgraph=True), opt, steps=6)
    assert opt.stats()["refreshes"] == 3 and opt.stats()["preconditioned"] == 6 * 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # collecting or not


def test_a_compiled_forward_counts_only_when_backpropagated():
    model = _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, _ = _data()
    compiled(x[:3])                          # grad enabled, train mode, never backpropagated
    assert set(opt.pending_samples().values()) == {0}
    compiled(x[:3]).sum().backward()
    assert opt.pending_samples() == {"0": 36.0, "1": 36.0, "3": 36.0, "5": 36.0}
    opt.zero_grad()
    assert set(opt.pending_samples().values()) == {0}


def test_dopr_built_after_the_model_was_compiled_and_run_still_captures():
    dopr.enable_compiled_capture()            # before compiling: graphs guard on the module hooks
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    x, _ = _data()
    compiled(x).sum().backward()              # traced before any DoPr hook existed
    opt = DoPr(compiled, torch.optim.SGD(model.parameters(), lr=0.1))   # the wrapper is unwrapped
    opt.zero_grad()
    compiled(x).sum().backward()
    assert opt.pending_samples() == {"0": 72.0, "1": 72.0, "3": 72.0, "5": 72.0}


def test_a_graph_compiled_for_an_unhooked_instance_is_not_reused_for_the_hooked_one():
    """Dynamo skips module-hook guards by default: the graph of a plain instance of the same class
    (a baseline, an evaluation copy) ran for DoPr's model and it gathered nothing."""
    dopr.enable_compiled_capture()
    model, plain = _model(), _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, _ = _data()
    torch.compile(plain, backend="aot_eager")(x).sum().backward()
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert opt.pending_samples() == {"0": 72.0, "1": 72.0, "3": 72.0, "5": 72.0}


def test_without_enable_compiled_capture_a_stale_graph_is_named_in_the_warning():
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    x, _ = _data()
    compiled(x).sum().backward()              # traced before any DoPr hook existed, no hook guards
    opt = DoPr(compiled, torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    compiled(x).sum().backward()
    assert set(opt.pending_samples().values()) == {0}   # the hook-less graph ran
    with pytest.warns(RuntimeWarning, match=r"dopr\.enable_compiled_capture\(\) before compiling"):
        opt.step()


def test_dopr_never_drops_an_unrelated_functions_compiled_code():
    """Creating a DoPr, re-attaching after a freeze and deep-copying leave other compiled code alone."""
    compiles = []

    def backend(gm, inputs):
        compiles.append(1)
        return gm.forward

    f = torch.compile(lambda t: torch.sin(t) * 2, backend=backend)
    t = torch.randn(5)
    f(t)
    model = _model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    f(t)
    model[1].weight.requires_grad_(False)                       # a freeze: re-attached at the step
    x, y = _data()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    f(t)
    copy.deepcopy(opt)
    f(t)
    assert len(compiles) == 1
    assert torch._dynamo.config.skip_nnmodule_hook_guards   # nor changes dynamo's configuration


def test_a_wide_layer_compiles_its_blocked_gram_and_matches_eager():
    from dopr.statistics import gram_blocks

    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(2))
    assert gram_blocks(1024, 256) == 2          # the blocked symmetric product, not one GEMM
    sums = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        layer = nn.Linear(256, 8)
        opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        forward = torch.compile(layer, backend="aot_eager", fullgraph=True) if mode == "compiled" else layer
        forward(x).sum().backward()
        sums[mode] = opt.capture.groups([""]).popitem()[1].sums[0]   # the root module is the layer ""
    torch.testing.assert_close(sums["compiled"], sums["eager"], rtol=1e-6, atol=1e-3)
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0


class _QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)
        return self.o(a)


def test_compiled_q_k_v_share_one_factorisation_as_in_eager():
    # float64: the compiled graph forms Sigma with other kernels (the gram assembled from blocks), and the
    # damped inverse multiplies that rounding by cond(Sigma + lambda I), up to ~1e4 d here; float32's
    # 1e-7 becomes ~1e-4 (seen on an AMD EPYC), float64's 1e-16 stays under 1e-11
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = _QKV().double()
        opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if mode == "compiled" else model
        for _ in range(2):
            opt.zero_grad()
            forward(x).square().sum().backward()
            opt.step()
        out[mode] = (opt.stats()["factorizations"], [p.detach().clone() for p in model.parameters()])
    assert out["compiled"][0] == out["eager"][0] == 2 * 2   # per step: {q, k, v} and o
    for p, q in zip(out["eager"][1], out["compiled"][1]):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)
