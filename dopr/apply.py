"""The AP applied to a step's gradients (:class:`Apply`): M = Gbar (Sigmabar + lambda I)^-1 for every layer, one
batched solve per bucket, the step's one read-back of its flags, the rare repair path and the write-back."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.profiler import record_function

from . import solvers
from .buckets import GradientBucket
from .distributed import is_distributed, nonfinite_keys
from .ema import GradientEMA
from .statistics import statistics_dtype


def phase(what: str, layers: int, shape) -> str:
    """The name of a step phase's profiler span (``dopr.profiling``): ``dopr.factor 3 x (385, 385)``."""
    return f"dopr.{what} {layers} x {tuple(shape)}"


def solve(members: dict, grads: dict, grad_ema, buckets: dict) -> tuple:
    """([(layer names, M stacked, their GradientBucket or None, its gradient parts)], [per-bucket non-finite flags
    of G], the buckets to keep): ``members`` ({name: operator}) bucketed by operator type, G's shape, bias column,
    dtype and device; per bucket one stack of G, proposed to ``grad_ema``, and one batched solve, no host sync.
    ``buckets``: the last step's, reused while a bucket is the same."""
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
    """The rare path: groups with a non-finite Sigma and layers with a non-finite G get their raw gradient
    (``skip(keys, what)``), Cholesky factors in trouble are retried (dopr.solvers.CholeskyBatch.finish).
    Returns (operators, skipped group keys and layer names)."""
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


@dataclass
class Borrowed:
    """What the apply borrows from DoPr for one step."""
    helpers: dict
    empty: set
    attached_now: set
    sharded: bool
    warn: Callable
    no_forward_cause: Callable


class Apply:
    """The apply side of a DoPr step: the gradient EMA (``grad_ema``), the last step's buckets (``buckets``) and
    ``no_forward`` (the layers with a gradient but no training forward on the last step)."""

    def __init__(self, options) -> None:
        self.options = options
        self.grad_ema = GradientEMA(options.grad_ema)
        self.buckets: dict = {}
        self.no_forward: list = []

    @classmethod
    def from_pickled(cls, options, state: dict) -> "Apply":
        """The apply side of a DoPr copied before this class: its ``_grad_ema`` and ``_no_forward`` were DoPr's."""
        out = cls(options)
        out.grad_ema = state.pop("_grad_ema", out.grad_ema)
        out.no_forward = state.pop("_no_forward", [])
        return out

    def begin(self, step: int) -> None:
        """A step starts: proposals of a step that raised are dropped, a scheduled rate is read at ``step``."""
        self.grad_ema.pending.clear()
        if self.grad_ema.scheduled:
            self.grad_ema.beta = self.options.at("grad_ema", step)

    def __call__(self, ops: dict, batches: list, grads: dict, graphed, raw: frozenset, refresh,
                 borrowed: Borrowed) -> tuple:
        """Every layer's M as its gradient, the EMAs' proposals committed but the skipped layers': ``ops`` {group
        key: operator}, ``graphed`` a CUDA graph's replay or None, ``raw`` layers without a factor. Returns (the
        operators after any repair, the solved buckets)."""
        members = self.members(ops, grads, raw, borrowed)     # Gbar, M = Gbar A^-1 for every layer, speculatively:
        solved, gflags, self.buckets = solve({n: op for n, op in members.items() if not graphed or n not in graphed.names},
                                             grads, self.grad_ema, self.buckets)
        solved, gflags = (graphed.solved + solved, graphed.gflags + gflags) if graphed else (solved, gflags)
        flags = step_flags(batches, gflags)
        if flags and any_set(flags, borrowed.sharded):        # the one read-back of the step
            skip = lambda bad, what: self.skip(bad, what, refresh.counts, borrowed.warn)   # noqa: E731
            ops, skipped = repair(batches, ops, grads, skip, refresh.counts, borrowed.sharded)
            members = self.members(ops, grads, skipped | raw, borrowed)
            solved, _, self.buckets = solve(members, grads, self.grad_ema, self.buckets)
            refresh.precond_ema.commit(skip={k for keys, _, _ in batches for k in keys if k in skipped})
            self.grad_ema.commit(skip=skipped)
        else:
            refresh.precond_ema.commit()
            self.grad_ema.commit()
        write_back(solved, borrowed.helpers)                  # each layer's M as its grad
        return ops, solved

    def members(self, ops: dict, grads: dict, skipped: frozenset, borrowed: Borrowed) -> dict:
        """{layer name: its operator} for the layers with a gradient and a factor (a sharded embedding's restricted
        to its columns); warns about layers that had no training forward."""
        group_of = {name: key for key in ops for name in key}
        skipped = skipped | borrowed.empty
        self.no_forward = [n for n in grads if n not in group_of and n not in skipped]
        missing = sorted(set(self.no_forward) - borrowed.attached_now)   # the attach warning named the others
        if missing:
            borrowed.warn("no_forward", lambda: f"no training forward since the last step for {self.no_forward}: "
                          "their gradients go to the GP unpreconditioned (see DoPr.stats()); the likely cause is "
                          + borrowed.no_forward_cause(missing))
        out = {}
        for name in grads:
            if name in group_of and name not in skipped:
                op, cols = ops[group_of[name]], borrowed.helpers[name].local_columns()
                out[name] = op.restrict(cols) if cols is not None else op
        return out

    def skip(self, bad: set, what: str, counts: dict, warn: Callable) -> set:
        """`bad` keys (layer names or group tuples) whose `what` is non-finite: raised, or counted and warned."""
        if not bad:
            return set()
        names = sorted(n for k in bad for n in (k if isinstance(k, tuple) else (k,)))
        if self.options.on_nonfinite == "raise":
            raise FloatingPointError(f"non-finite {what} in DoPr layer(s) {names}")
        counts["nonfinite_skips"] += len(names)
        warn("nonfinite", f"non-finite {what} in {names}: AP skipped for them this step, "
             "raw gradient to the GP (counted in DoPr.stats()['nonfinite_skips'])")
        return bad

    def snapshot(self) -> tuple:
        return dict(self.grad_ema.buffers), self.no_forward

    def restore(self, saved: tuple) -> None:
        self.grad_ema.buffers, self.no_forward = saved
        self.grad_ema.pending = {}

    def state_dict(self, helpers: dict) -> dict:
        """The checkpoint's ``grad_ema`` entry: the gradient EMA's buffers (FSDP2: gathered to whole matrices)."""
        return self.grad_ema.state_dict(helpers)

    def load_state_dict(self, state: dict, helpers: dict, to) -> None:
        """Restore :meth:`state_dict`'s entry (FSDP2: each rank its rows), cast by ``to`` (dopr.checkpoint.placement)."""
        self.grad_ema.load_state_dict(state, helpers, to)

    def __getstate__(self) -> dict:   # the write-back buffers are not copied (rebuilt on the next step)
        return {k: v for k, v in self.__dict__.items() if k != "buckets"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, buckets={})
