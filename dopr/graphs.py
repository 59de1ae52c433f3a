"""The refresh step's numeric core replayed from a CUDA graph (issue 77; issue 61 item 4).

On a GPU a DoPr step launches some 30 small kernels per layer (the stack of each size's Sigma, the trace
damping, the finiteness flags, cholesky_ex, the batched apply, the gradients' flags). Once a step's *plan* is
static (the same groups, sizes, dtypes and routes as on the step before), that work is captured once into a
``torch.cuda.CUDAGraph`` and replayed: one launch. The graph reads static buffers (each size's stacked sums, the
gradients per bucket, one vector of scalars: the counts and gamma, never constants) that the step fills with a
few copies, and writes M into a static buffer the write-back copies from. A plan seen on two refreshes is
captured; after ``MAX_PLANS`` distinct plans the optimizer stays eager. The graph's outputs are the objects the
eager path makes (a :class:`dopr.solvers.CholeskyBatch` per size), so the step's read-back and repair path run on
them unchanged; a capture that raises turns graphs off with one warning.

Only the default path is captured (:func:`static_reason` names what keeps an optimizer eager), and not a health
report's refresh. A replay runs the eager step's kernels in the same order: M is the same, bit for bit
(tests/lib/test_graphs.py on the CPU, where :class:`StepGraph` runs its core eagerly on the static buffers;
``benchmarks/gpu_check.py``'s part ``graphs`` on a GPU).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import solvers
from .buckets import GradientBucket
from .damping import trace_floor
from .statistics import DenseCovariance, statistics_dtype

#: distinct plans after which an optimizer stops capturing (its shapes are not static)
MAX_PLANS = 8
#: captured plans kept at once (each holds its buffers and the graph's memory pool)
KEPT_PLANS = 2
#: what DoPr.stats() counts of the graphs: refresh cores run from a plan's static buffers, captures made
COUNTERS = ("graph_steps", "graph_captures")
#: device types whose plans are captured (tests add "cpu", where the core runs eagerly on the buffers)
DEVICES = {"cuda"}


def static_reason(options, solver, rule, sharded: bool) -> Optional[str]:
    """Why an optimizer with these options never replays a graph, or None: it may."""
    from .damping import TraceRule
    checks = (
        (options.cuda_graphs == "off", "cuda_graphs='off'"),
        (solver.name != "cholesky", f"solver {solver.name!r} (only cholesky is captured)"),
        (type(rule) is not TraceRule, f"damping rule {options.damping_rule!r} (only trace is captured)"),
        (callable(options.precond_ema) or options.precond_ema > 0, "a statistics EMA (precond_ema)"),
        (callable(options.grad_ema) or options.grad_ema > 0, "a gradient EMA (grad_ema)"),
        (options.weak_share_bound is not None, "weak_share_bound"),
        (options.on_nonfinite == "raise", "on_nonfinite='raise' (a raising step is undone on the host)"),
        (sharded, "sharded parameters"),
    )
    return next((why for cond, why in checks if cond), None)


class Replay(NamedTuple):
    """What a plan gives a refresh step: the groups it factored, the layers it solved, and ``batches``, ``solved``,
    ``gflags`` as dopr.refresh.Refresh.factor and dopr.apply.solve give them (M in static buffers)."""

    keys: frozenset
    names: frozenset
    batches: list
    solved: list
    gflags: list


class StepGraph:
    """One static plan: its buffers and its graph (off CUDA, its core run eagerly). ``batches``: [(group keys, the
    stacked sums' shape, dtype, homogeneous flags or None, the bound factor)]; ``buckets``: [(layer names, G's shape,
    the statistics dtype, the helpers)]; ``group_of``: {layer name: its group key}."""

    def __init__(self, batches: list, buckets: list, group_of: dict, damping_mode: str, device) -> None:
        self.batches, self.buckets, self.group_of, self.mode = batches, buckets, group_of, damping_mode
        self.device, self.graph, self.out = torch.device(device), None, None
        self.sums = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype, _, _ in batches]
        dtype = batches[0][2]
        self.scalars = torch.zeros(1 + sum(shape[0] for _, shape, _, _, _ in batches), dtype=dtype, device=device)
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(self.scalars.shape, dtype=dtype, pin_memory=pinned)
        self.gs = [GradientBucket(helpers, shape, sdtype, device) for _, shape, sdtype, helpers in buckets]

    def _core(self) -> tuple:
        """Sigma = sums / counts, lambda, finiteness, the factors, M per bucket: the eager path's calls."""
        gamma, at, batches, ops = self.scalars[0], 1, [], {}
        for (keys, _, _, homogeneous, factor), sums in zip(self.batches, self.sums):
            sigma = sums / self.scalars[at:at + len(keys)][:, None, None]   # a fresh copy: the solver damps it
            at += len(keys)
            sigma, lam, finite = DenseCovariance.prepare(sigma, trace_floor(gamma, self.mode), False, homogeneous)
            res = DenseCovariance.factor(sigma, lam, factor, {})
            batches.append((keys, finite, res))
            ops.update(zip(keys, res.ops()))
        solved, gflags = [], []
        for (names, _, _, _), bucket in zip(self.buckets, self.gs):
            gflags.append(~bucket.m.sum((-2, -1)).isfinite())
            solved.append(solvers.apply_stack([ops[self.group_of[n]] for n in names], bucket.m))
        return batches, solved, gflags

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # lazy initialisations (cuBLAS, cuSOLVER handles) outside the capture
            self._core()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._core()
        self.graph = graph

    def fill(self, stats: list, gamma: float, grads: dict) -> None:
        """The step's inputs into the static buffers: the sums by size, the counts and gamma, G by bucket."""
        counts = [gamma]
        for sums, members in zip(self.sums, stats):
            torch.stack([s.sums[0] for s in members], out=sums)
            counts += [s.count for s in members]
        self.host.copy_(torch.tensor(counts, dtype=self.host.dtype))
        self.scalars.copy_(self.host, non_blocking=True)
        for (names, _, _, _), bucket in zip(self.buckets, self.gs):
            helpers = [grads[n] for n in names]
            parts = GradientBucket.parts(helpers)
            if parts is None:
                for i, h in enumerate(helpers):
                    h.read_grad(bucket.m[i])
            else:
                bucket.fill(parts)

    def run(self) -> tuple:
        """(batches, solved, gflags) as dopr.refresh.Refresh.factor and dopr.apply.solve give them, M in static buffers;
        captured on the first run on CUDA."""
        if self.device.type != "cuda":
            return self._core()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out


class StepGraphs:
    """An optimizer's plans: which step is replayed, captured or run eagerly (see the module doc)."""

    def __init__(self, reason: Optional[str], before: Optional["StepGraphs"] = None) -> None:
        """``before``: the graphs before the layers changed (their counters and a failed capture carry over)."""
        failed = before is not None and (before.off or "").startswith("the capture failed")
        self.off = reason or (before.off if failed else None)   # None: plans may be captured
        self.plans: OrderedDict = OrderedDict()  # key -> StepGraph (captured, at most KEPT_PLANS)
        self.seen: dict = {}                     # key -> refreshes it was seen on
        self.counts = dict(before.counts) if before else dict.fromkeys(COUNTERS, 0)

    def run(self, groups: dict, grads: dict, gamma: float, factor_for: Callable,
            homogeneous_of: Optional[dict], mode: str) -> Optional[Replay]:
        """This refresh's feature-space groups ({group key: statistics}) from a graph (a :class:`Replay`), or None:
        all run eagerly. ``factor_for(keys)``: the bound factor; ``homogeneous_of``: {layer: flag} or None."""
        if self.off is not None or not groups:
            return None
        plan = self._plan(groups, grads, factor_for, homogeneous_of)
        if plan is None:
            return None
        key, batches, buckets, group_of, stats, device = plan
        graph = self.plans.get(key)
        if graph is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if len(self.seen) > MAX_PLANS:
                self.off, self.plans = f"more than {MAX_PLANS} distinct step plans (shapes are not static)", OrderedDict()
                return None
            if self.seen[key] < 2:
                return None
            graph = StepGraph(batches, buckets, group_of, mode, device)
            self.plans[key] = graph
            while len(self.plans) > KEPT_PLANS:
                self.plans.popitem(last=False)
        self.plans.move_to_end(key)
        graph.fill(stats, gamma, grads)
        capturing = graph.graph is None and graph.device.type == "cuda"
        try:
            out = graph.run()
        except Exception as exc:   # a kernel that cannot be captured: eager from now on, said once
            self.off, self.plans = f"the capture failed ({type(exc).__name__}: {exc})", OrderedDict()
            warnings.warn(f"DoPr: CUDA graph capture failed, the step runs eagerly from now on: {exc}",
                          RuntimeWarning, stacklevel=4)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return None
        self.counts["graph_steps"] += 1
        self.counts["graph_captures"] += capturing
        batches_out, ms, gflags = out
        solved = []
        for (names, _, _, _), m, bucket in zip(graph.buckets, ms, graph.gs):
            parts = GradientBucket.parts([grads[n] for n in names])
            solved.append((names, m, bucket if parts is not None else None, parts))
        return Replay(frozenset(group_of.values()), frozenset(n for names, *_ in graph.buckets for n in names),
                      batches_out, solved, gflags)

    @staticmethod
    def _plan(groups: dict, grads: dict, factor_for: Callable, homogeneous_of: Optional[dict]):
        """(key, batch specs, bucket specs, group_of, the step's statistics per batch), or None: not capturable."""
        by_size: dict = {}
        for key, stat in groups.items():
            if type(stat) is DenseCovariance and stat.sums[0].device.type in DEVICES:
                s = stat.sums[0]
                by_size.setdefault((tuple(s.shape), s.dtype, s.device), []).append((key, stat))
        if not by_size:
            return None
        batches, stats, group_of = [], [], {}
        if len({device for _, _, device in by_size}) != 1 or len({dtype for _, dtype, _ in by_size}) != 1:
            return None
        for (shape, dtype, device), items in by_size.items():
            keys = tuple(k for k, _ in items)
            homogeneous = [homogeneous_of.get(k[0], False) for k in keys] if homogeneous_of else None
            factor = factor_for(keys)
            route = getattr(factor, "keywords", {}).get("rows")
            batches.append((keys, (len(keys), *shape), dtype, homogeneous, factor, route))
            stats.append([s for _, s in items])
            group_of.update({n: k for k in keys for n in k})
        by_shape: dict = {}
        for name, h in grads.items():
            if name in group_of:
                by_shape.setdefault((h.grad_shape(), h.homogeneous, h.grad_dtype(), h.module.weight.device), []).append(name)
        buckets = [(tuple(names), shape, statistics_dtype(dtype), [grads[n] for n in names])
                   for (shape, _, dtype, _), names in by_shape.items()]
        key = (tuple((b[0], b[1], b[2], None if b[3] is None else tuple(b[3]), b[5]) for b in batches),
               tuple((names, shape, h, dtype, str(dev)) for (shape, h, dtype, dev), names in
                     ((k, tuple(v)) for k, v in by_shape.items())))
        return key, [b[:5] for b in batches], buckets, group_of, stats, device
