"""The CUDA-graph replay of the refresh core (dopr/graphs.py), its plan logic on the CPU.

On the CPU a plan's core runs eagerly on the plan's static buffers (the same calls a CUDA graph captures,
on the same inputs): these tests check that path gives the eager step's M bit for bit, that plans are
keyed, captured and dropped as the module says, and that the read-back's repair path and a failed capture
fall back to the eager step. The capture itself needs a GPU (benchmarks/gpu_check.py, part graphs)."""
import warnings

import pytest
import torch
from torch import nn

import dopr
from dopr import graphs


@pytest.fixture
def cpu_plans(monkeypatch):
    monkeypatch.setattr(graphs, "DEVICES", {"cpu"})


class Net(nn.Module):
    """Two sizes, a layer without a bias beside one with (one G shape, two layouts), two layers reading one
    input (one shared Sigma)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8, bias=False)
        self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(x))
        return self.d(torch.tanh(self.c(h)))


def _train(graphs_on: bool, steps: int = 6, batches=(16, 9, 16, 12, 16, 7, 16, 16), poison=None, **ap):
    torch.manual_seed(0)
    model = Net()
    opt = dopr.DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                    **{"cuda_graphs": "auto" if graphs_on else "off", **ap})
    gen = torch.Generator().manual_seed(1)
    ms = []
    for i in range(steps):
        x = torch.randn(batches[i], 6, generator=gen)
        model(x).square().mean().backward()
        if poison is not None and i == poison:
            model.c.weight.grad[0, 0] = float("nan")
        opt.step()
        ms.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad()
    return ms, opt.stats(), model


def _steps(model, opt, batches):
    """The gradients the GP received at each step (M), and the counters."""
    out = []
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        out.append([p.grad.clone() for p in model.parameters()])
        opt.zero_grad()
    return out, opt.stats()


def _same(a, b):
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            assert torch.equal(x, y) or (x.isnan().any() and torch.equal(x.isnan(), y.isnan()))


def test_a_replayed_refresh_gives_the_eager_m_bit_for_bit(cpu_plans):
    # batch sizes change (the counts reach the plan as data); the plan is the same from step 1 on
    eager, eager_stats, _ = _train(False)
    replayed, stats, _ = _train(True)
    _same(replayed, eager)
    assert eager_stats["graph_steps"] == 0
    assert stats["graph_steps"] == 5             # step 0 sees the plan once: eager; steps 1-5 from the plan
    assert stats["refreshes"] == eager_stats["refreshes"] == 6
    assert stats["factorizations"] == eager_stats["factorizations"]


def test_a_scheduled_damping_reaches_the_plan_as_data(cpu_plans):
    ap = {"damping": lambda step: 1e-4 * 10.0 ** (step % 3)}
    eager, _, _ = _train(False, **ap)
    replayed, stats, _ = _train(True, **ap)
    _same(replayed, eager)
    assert stats["graph_steps"] == 5


@pytest.mark.parametrize("every", [2, 3])
def test_refreshes_every_k_steps_replay_and_cache_as_eager(cpu_plans, every):
    eager, _, _ = _train(False, steps=8, precond_every=every)
    replayed, stats, _ = _train(True, steps=8, precond_every=every)
    _same(replayed, eager)
    refreshes = len(range(0, 8, every))
    assert stats["graph_steps"] == refreshes - 1


def test_a_non_finite_gradient_on_a_replayed_step_takes_the_repair_path(cpu_plans):
    eager, eager_stats, _ = _train(False, poison=5)   # the last step: NaN weights would follow
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replayed, stats, _ = _train(True, poison=5)
    _same(replayed, eager)
    assert stats["nonfinite_skips"] == eager_stats["nonfinite_skips"] == 1
    assert stats["graph_steps"] == 5


def test_a_factor_in_trouble_on_a_replayed_step_is_repaired_as_eager(cpu_plans):
    # damping 0 on inputs of rank 2 in 6 dimensions: a singular Sigma, the pseudo-inverse fallback
    def data(n, gen):
        return torch.randn(n, 2, generator=gen) @ torch.randn(2, 6, generator=torch.Generator().manual_seed(5))

    def run(on):
        torch.manual_seed(0)
        model = Net()
        opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-2), damping=0.0,
                        cuda_graphs="auto" if on else "off")
        gen = torch.Generator().manual_seed(2)
        return _steps(model, opt, [data(16, gen) for _ in range(4)])

    eager, eager_stats = run(False)
    replayed, stats = run(True)
    _same(replayed, eager)
    assert stats["eigh_fallbacks"] == eager_stats["eigh_fallbacks"] > 0
    assert stats["graph_steps"] == 3


def test_a_new_plan_runs_eagerly_once_then_replays(cpu_plans):
    torch.manual_seed(0)
    model = Net()
    opt = dopr.DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def step():
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return opt.stats()["graph_steps"]

    assert [step(), step(), step()] == [0, 1, 2]
    model.c.weight.requires_grad_(False)        # a layer frozen: new layers, a new plan seen once: eager
    model.c.bias.requires_grad_(False)
    assert [step(), step(), step()] == [2, 3, 4]
    assert len(opt.graphs.plans) == 1 and opt.graphs.off is None


def test_freezing_a_whole_layer_between_steps_trains_on():
    # the forward after a freeze ran the old hooks on a weight that no longer requires grad, and asked autograd
    # for its gradient node: AttributeError ('NoneType' object has no attribute 'next_functions')
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    for i in range(4):
        if i == 2:
            model[2].weight.requires_grad_(False)
            model[2].bias.requires_grad_(False)
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["steps"] == 4
    assert [e.name for e in opt.coverage() if e.mode is not None] == ["0", "4"]


def test_more_plans_than_the_limit_turn_the_optimizer_eager(cpu_plans, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_PLANS", 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    # one Sigma per layer normally; the same tensor into both layers' hooks never happens here, so the plans
    # change only through the layers that had a forward: alternate which layers run
    for i in range(6):
        x = torch.randn(8, 4)
        if i % 3 == 0:
            loss = model(x).sum()
        elif i % 3 == 1:
            loss = model[0](x).sum() + 0 * model[2].weight.sum() + 0 * model[2].bias.sum()
        else:
            loss = model[2](torch.randn(8, 4)).sum() + 0 * model[0].weight.sum() + 0 * model[0].bias.sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss.backward()
            opt.step()
        opt.zero_grad()
    assert opt.stats()["graph_steps"] == 0
    assert "more than 2 distinct step plans" in opt.graphs.off


def test_a_capture_that_raises_warns_once_and_the_step_runs_eagerly(cpu_plans, monkeypatch):
    eager, _, _ = _train(False)

    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.StepGraph, "_core", broken)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture failed.*not permitted"):
        replayed, stats, _ = _train(True)
    _same(replayed, eager)
    assert stats["graph_steps"] == 0


@pytest.mark.parametrize("option, value, why", [
    ("cuda_graphs", "off", "cuda_graphs='off'"),
    ("solver", "eigh", "solver 'eigh'"),
    ("damping_rule", "sample_count", "damping rule 'sample_count'"),
    ("precond_ema", 0.9, "statistics EMA"),
    ("grad_ema", 0.9, "gradient EMA"),
    ("on_nonfinite", "raise", "on_nonfinite='raise'"),
])
def test_options_off_the_captured_path_name_why_and_stay_eager(cpu_plans, option, value, why):
    _, stats, _ = _train(True, **{option: value})
    assert stats["graph_steps"] == 0
    torch.manual_seed(0)
    model = Net()
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-2), **{option: value})
    assert why in opt.graphs.off


def test_off_cuda_no_plan_is_made():
    assert graphs.DEVICES == {"cuda"}
    _, stats, _ = _train(True)
    assert stats["graph_steps"] == 0 and stats["graph_captures"] == 0


def test_a_copy_of_the_optimizer_plans_afresh(cpu_plans):
    import copy
    _, _, model = _train(True)
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    for _ in range(3):
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(opt)
    assert opt.stats()["graph_steps"] == 2
    assert not twin.graphs.plans and twin.stats()["graph_steps"] == 0   # graphs are not copied: planned afresh
    for _ in range(3):
        twin.model(torch.randn(8, 6)).sum().backward()
        twin.step()
        twin.zero_grad()
    assert twin.stats()["graph_steps"] == 2


def test_a_step_with_sample_space_groups_replays_the_rest(cpu_plans):
    # a layer of more inputs than rows solves in sample space (eagerly); the others come from the plan
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 40), nn.Linear(40, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    def run(on):
        torch.manual_seed(0)
        model = Wide()
        opt = dopr.DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), solve_space="auto",
                        cuda_graphs="auto" if on else "off")
        gen = torch.Generator().manual_seed(3)
        return _steps(model, opt, [torch.randn(16, 6, generator=gen) for _ in range(4)])   # 16 rows < 41 inputs of b

    eager, eager_stats = run(False)
    replayed, stats = run(True)
    _same(replayed, eager)
    assert stats["sample_space_solves"] == eager_stats["sample_space_solves"] > 0
    assert stats["graph_steps"] == 3 and stats["factorizations"] == eager_stats["factorizations"]
