"""The AP applied to a step's gradients: M = Gbar (Sigmabar + lambda I)^-1 for every layer, bucketed by
operator type and gradient shape (one stack and one batched solve per bucket, no host sync), the step's
one read-back of its non-finite and trouble flags, and the rare repair path it may open. DoPr.precondition
calls them in that order; the factors come from dopr.refresh.Refresh.factor (dopr/statistics.py, dopr/solvers.py)."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.profiler import record_function

from . import solvers
from .buckets import GradientBucket
from .distributed import is_distributed, nonfinite_keys
from .statistics import statistics_dtype


def phase(what: str, layers: int, shape) -> str:
    """The name of a step phase's profiler span: ``dopr.factor 3 x (385, 385)`` (``dopr.profiling`` sums
    each span's device time, so a GPU profile says which sizes the step's time goes to)."""
    return f"dopr.{what} {layers} x {tuple(shape)}"


def solve(members: dict, grads: dict, grad_ema, buckets: dict) -> tuple:
    """([(layer names, M stacked, their GradientBucket or None, its gradient parts)], [per-bucket
    non-finite flags of G], the GradientBuckets to keep): the layers (``members``: {name: operator})
    bucketed by operator type (the solve space), gradient shape, bias column (a layer with a bias and one
    without may share G's shape: their blocks are laid out differently), dtype and device, each bucket read into one stack (dopr/buckets.py: a few
    ops for the bucket; other layer types ``read_grad``, a layer's G and bias column copied once), G
    proposed to ``grad_ema``, one batched solve, no host sync. ``buckets``: the last step's, reused
    while a bucket is the same."""
    by_shape = defaultdict(list)
    for name, op in members.items():
        h = grads[name]
        by_shape[(type(op), h.grad_shape(), h.homogeneous, h.grad_dtype(), h.module.weight.device)].append(name)
    solved, flags, kept = [], [], {}
    for (kind, shape, homogeneous, dtype, device), names in by_shape.items():
        with record_function(phase("apply", len(names), shape)):
            helpers = [grads[n] for n in names]
            parts, bucket = GradientBucket.parts(helpers), None
            if parts is not None:                       # the bucket's buffers are kept while it is the same
                key = (tuple(names), kind, shape, homogeneous, dtype, device)
                bucket = kept[key] = buckets.get(key) or GradientBucket(helpers, shape, statistics_dtype(dtype), device)
                g = bucket.read(parts)
            else:
                g = torch.empty((len(names), *shape), dtype=statistics_dtype(dtype), device=device)
                for i, h in enumerate(helpers):
                    h.read_grad(g[i])
            flags.append(~g.sum((-2, -1)).isfinite())    # finite unless an entry is (or the sum overflows)
            if grad_ema.on:
                g = torch.stack([grad_ema.propose(n, x) for n, x in zip(names, g.unbind(0))])
            solved.append((names, solvers.apply_stack([members[n] for n in names], g), bucket, parts))
    return solved, flags, kept


def step_flags(batches: list, gflags: list) -> list:
    """The flags the step reads back: each batch's non-finite Sigma, its factors' trouble, G's non-finite."""
    return [f for _, finite, res in batches for f in
            ([~finite] + ([res.trouble] if isinstance(res, solvers.Deferred) else []))] + gflags


def any_set(flags: list, sharded: bool) -> bool:
    """Whether any flag is set: the step's one host sync (under sharding, agreed by all ranks)."""
    flag = torch.cat([f.reshape(-1) for f in flags]).any()
    if sharded and is_distributed():
        flag = flag.float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag)


def repair(batches: list, ops: dict, grads: dict, skip, counts: dict, sharded: bool) -> tuple:
    """The rare path, layer by layer: groups with a non-finite Sigma and layers with a non-finite G
    get their raw gradient (``skip(keys, what)``: counted, warned once, or raised), Cholesky factors in
    trouble are retried (dopr.solvers.CholeskyBatch.finish). Under sharding a gradient's rows are spread
    over ranks: they agree on a non-finite G by one all-reduce. Returns (operators, skipped group keys
    and layer names)."""
    bad = skip({k for keys, fin, _ in batches for k, f in zip(keys, fin.tolist()) if not f}, "activation covariance")
    counts["factorizations"] -= len(bad)
    ops = dict(ops)
    for keys, finite, res in batches:
        if isinstance(res, solvers.Deferred):
            ops.update(zip(keys, res.finish(counts, finite)))
    for k in bad:
        ops.pop(k, None)
    group_of = {name: key for key in ops for name in key}
    bad_g = skip(nonfinite_keys({n: h.grad_matrix() for n, h in grads.items() if n in group_of},
                                across_ranks=sharded), "gradient")
    return ops, frozenset(bad) | frozenset(bad_g) | frozenset(n for k in bad for n in k)


def write_back(solved: list, helpers: dict) -> None:
    """Each layer's M as its gradient: a few ops per bucket (dopr/buckets.py), else layer by layer."""
    for names, ms, bucket, parts in solved:
        if bucket is not None:
            bucket.write(parts, ms)
        else:
            for name, m in zip(names, ms.unbind(0)):
                helpers[name].set_grad(m)
