"""The refresh: what turns a step's statistics into factors, and when (issue 75 item 1).

A :class:`Refresh` owns one DoPr's refresh state: the policy (dopr/refresh_policy.py), the cached factors, the
damping rule (dopr/damping.py), the Sigma EMA (dopr/ema.py) and the counters, and serialises it (its entries of the
checkpoint's ``"dopr"`` dict). The apply (Gbar, the solve, read-back, write-back) is dopr/apply.py's.
"""
from __future__ import annotations

import functools
from collections import defaultdict, namedtuple

from torch.autograd.profiler import record_function

from . import apply, damping, refresh_policy, solvers
from .distributed import agree_groups, all_reduce_statistics
from .ema import CovarianceEMA
from .sample_space import SampleRows, gather_rows
from .solve_space import choose as choose_space, group_rows
from .statistics import statistics_dtype

#: what a refresh borrows from its DoPr for one step (homogeneous: None unless the damping rule reads the flags;
#: collective: lambda's choice is one (FSDP2); attached_now: layers that started training this step, raw)
Factoring = namedtuple("Factoring", "solver factor_with health statistic homogeneous collective damping_mode warn "
                                    "graphs attached_now")


def without(cache: dict, names) -> dict:
    """The cached factors but those of `names`: a group that loses members keeps its factor for the rest."""
    out = {}
    for key, op in cache.items():
        rest = tuple(n for n in key if n not in names)
        if rest:
            out[rest if len(rest) < len(key) else key] = op
    return out


def factor_for(solver, factor, keys: tuple, grads: dict):
    """``factor`` for a batch of groups, given (a solver that ``takes_rows``) the mean gradient rows its operators
    are applied to: the Cholesky route depends on them (dopr.solvers.cholesky_route)."""
    if not solver.takes_rows or factor is None:
        return factor
    rows = round(sum(group_rows(key, grads) for key in keys) / len(keys))
    return functools.partial(factor, rows=rows or None)


def _means(kind, items: list, report: bool) -> tuple:
    """(means, items) of a batch: Sigma = sums / counts stacked at once where no EMA proposed Sigmabar
    (the items then carry each member's, when a report reads them)."""
    keys, stats, means = zip(*items)
    if means[0] is not None:
        return list(means), items
    means = kind.stacked_mean(list(stats))
    return means, ([(key, stat, (m,)) for key, stat, m in zip(keys, stats, means.unbind(0))] if report else items)


def cache_on_layers(cache: dict, helpers: dict) -> dict:
    """The cached factors {group key: operator} in their layers' statistics dtype and device (a float64
    sample-space factor keeps its dtype: bit-identical resume). ``helpers``: {name: helper}."""
    out = {}
    for key, op in cache.items():
        w = next((helpers[n].module.weight for n in key if n in helpers), None)
        out[key] = op if w is None else solvers.operator_to(op, statistics_dtype(w.dtype), w.device)
    return out


class Refresh:
    """The refresh state of one DoPr. ``gathering``, which the capture's forward hooks read, is a plain bool: a
    compiled forward guards on its value and compiles once per value."""

    def __init__(self, options) -> None:
        self.policy = refresh_policy.build(options)      # when factors are refreshed
        self.damping = damping.build(options)            # lambda per group, its state and counters
        self.precond_ema = CovarianceEMA(options.precond_ema)
        self.cache: dict = {}          # a caching policy: {group key: its last good factor}
        self.unfactored: set = set()   # layers with a gradient and no factor: the next step gathers statistics
        self.idle: set = set()         # layers with a gradient but no forward on a collecting step: wait
        self.empty: set = set()        # layers with no samples this step (an empty batch or mask): raw gradients
        self.counts = defaultdict(int)
        self.gathering = True          # whether the forwards now gather statistics (:meth:`next_step`)

    def __setstate__(self, state: dict) -> None:
        """A copy pickled before ``empty`` and ``gathering`` moved here from DoPr gets their starting values."""
        self.__dict__.update({"empty": set(), "gathering": True, **state})

    @classmethod
    def from_pickled(cls, options, state: dict) -> "Refresh":
        """The refresh state of a DoPr pickled before this module, popped from its ``__dict__``."""
        out = cls(options)
        rule, policy = state.pop("_damping", None), state.pop("_policy", None)
        out.damping = damping.from_pickled(options, state) if rule is None else rule
        out.policy = out.policy if policy is None else policy
        out.precond_ema = state.pop("_precond_ema", out.precond_ema)
        out.cache, out.unfactored, out.idle = state.pop("_cache", {}), state.pop("_unfactored", set()), state.pop("_idle", set())
        out.counts, out.empty = defaultdict(int, state.pop("_counts", {})), state.pop("_empty", set())
        state.pop("_damping_scale", None)
        return out

    def gathers(self, step: int, warming_up: bool) -> bool:
        """Whether the forwards of AP step ``step`` gather statistics: not while warming up; when the policy says,
        or while a layer has a gradient but no factor."""
        return not warming_up and (self.policy.gathers(step) or bool(self.unfactored))

    def next_step(self, step: int, warming_up: bool) -> None:
        """The answer the capture reads until the next step (``gathering``): whether step ``step`` gathers."""
        self.gathering = self.gathers(step, warming_up)

    def counters(self) -> dict:
        return {**self.counts, **self.damping.counters()}

    def forget(self, names, keep: set) -> None:
        """Drop the factors of `names` (their dimension changed) and the unfactored layers not in `keep`."""
        self.cache = without(self.cache, names)
        self.unfactored &= keep

    def store(self, fresh: dict) -> None:
        """New factors {group key: operator} replace their layers' old ones only."""
        self.cache = {**without(self.cache, {n for key in fresh for n in key}), **fresh}

    def gather(self, capture, grads: dict, refresh: bool, step: int, gamma: float, how: Factoring) -> tuple:
        """A collecting step's statistics (all-reduced) and the policy's groups factored, nothing read back:
        (groups, gathered names, refresh, batches, operators, graphed, raw)."""
        groups = capture.groups(grads)                             # layers reading one input share Sigma
        groups = agree_groups(groups, capture.layers, capture.statistic)   # data parallel: one layout
        groups = gather_rows(groups, capture.rows)                 # data parallel: every rank's rows (sample space)
        all_reduce_statistics([s for s in groups.values() if not isinstance(s, SampleRows)],   # the global Sigma
                              capture.reads)
        gathered = {n for key, stat in groups.items() if stat.count > 0 for n in key}
        groups, refresh = self.select(groups, step, refresh)       # the policy's, the unfactored
        self.empty = {n for key, stat in groups.items() if stat.count == 0 for n in key}
        if self.empty:                                             # an empty batch or mask: Sigma = 0/0, no AP
            groups = {key: stat for key, stat in groups.items() if stat.count > 0}
            how.warn("no_samples", f"no samples this step for {sorted(self.empty)} (an empty batch "
                     "or mask, an expert no token was routed to): their gradients go to the GP raw "
                     "(see DoPr.stats()['no_samples'])")
        groups = choose_space(groups, grads)
        graphed = self._graphed(groups, grads, gamma, how) if refresh else None   # a CUDA graph's replay
        batches = (graphed.batches if graphed else []) + self.factor(
            {k: s for k, s in groups.items() if not graphed or k not in graphed.keys}, grads, gamma, refresh, how)
        return groups, gathered, refresh, batches, self.operators(batches, refresh), graphed, frozenset()

    def cached(self, grads: dict, refresh: bool, how: Factoring) -> tuple:
        """A step between refreshes: the cached inverses; a layer with none gets its raw gradient (warned)."""
        ops, self.empty = self.cache, set()
        covered = {n for key in ops for n in key}
        raw = frozenset(n for n in grads if n not in covered)   # factored from the next step's statistics
        if raw - how.attached_now:
            how.warn("unfactored", f"layers {sorted(raw)} have a gradient but no factor yet (no forward "
                     "on a refresh step so far): raw this step, factored from the statistics of their "
                     "next forward (see docs/library.md, precond_every)")
        return {}, set(), refresh, [], ops, None, raw

    def _graphed(self, groups: dict, grads: dict, gamma: float, how: Factoring):
        """A refresh's (batches, solved, G's flags) from a CUDA graph (dopr/graphs.py), counted; None: eager."""
        if how.graphs.off is not None or how.health.due(self.counts["refreshes"]):
            return None
        out = how.graphs.run(groups, grads, gamma, lambda keys: factor_for(how.solver, how.factor_with, keys, grads),
                             self.damping.reads_homogeneous and how.homogeneous, how.damping_mode)
        self.counts["factorizations"] += sum(len(keys) for keys, _, _ in out.batches) if out else 0
        return out

    def select(self, groups: dict, step: int, refresh: bool) -> tuple:
        """(the groups to factor, whether the step refreshes every group): all on a full refresh; else the
        policy's due groups and the layers without a factor."""
        due = self.policy.due(step, groups) if refresh else set()   # the policy's groups to refresh
        refresh = refresh and len(due) == len(groups)
        if not refresh:
            groups = {sub: stat for key, stat in groups.items()
                      if (sub := key if key in due else tuple(n for n in key if n in self.unfactored))}
        return groups, refresh

    def factor(self, groups: dict, grads: dict, gamma: float, refresh: bool, how: Factoring) -> list:
        """[(group keys, finite, factors)] per batch of same-kind, same-size groups, damped by the damping rule at
        ``gamma`` and factored in one call (``finite``: device flags; ``factors``: operators or a
        dopr.solvers.Deferred). Not a ``refresh``: layers without a factor (no health report, not counted)."""
        report, out, flags = refresh and how.health.due(self.counts["refreshes"]), [], how.homogeneous
        for (kind, shape, _, _), items in self._batches(choose_space(groups, grads), how.statistic).items():
            keys = tuple(key for key, _, _ in items)
            homogeneous = None if flags is None else [flags.get(key[0], False) for key in keys]
            with record_function(apply.phase("factor", len(keys), shape)):   # a profile's span per size (dopr.profiling)
                means, items = _means(kind, items, report)
                batch, floor, finite = kind.prepare(means, damping.trace_floor(gamma, how.damping_mode),   # one stack per size
                                                    how.solver.finite_inputs, homogeneous)
                b = damping.Groups(keys, kind, items, batch, floor, finite, grads, report, how.collective)
                lam = self.damping.lam(b)
                for warning in how.health.record_batch(b, lam) if report else ():    # on request (syncs)
                    how.warn("health", warning)
                out.append((keys, finite, kind.factor(batch, lam, factor_for(how.solver, how.factor_with, keys, grads),
                                                      self.counts)))
        self.counts["refreshes"] += int(refresh)
        self.counts["factorizations"] += sum(len(keys) for keys, _, _ in out)
        return out

    def _batches(self, groups: dict, statistic: type) -> dict:
        """{(kind, shape, dtype, device): [(key, statistic, Sigmabar or None: stacked at once, no EMA)]}."""
        groups = self.precond_ema.shared_history(groups)
        batches = defaultdict(list)
        lazy = not self.precond_ema.on and hasattr(statistic, "stacked_mean")
        for key, stat in groups.items():
            if lazy and hasattr(stat, "stacked_mean"):    # the batch's Sigma at once, below (no per-group ops)
                batches[(type(stat), stat.sums[0].shape, stat.sums[0].dtype, stat.sums[0].device)].append((key, stat, None))
                continue
            mean = self.precond_ema.propose(key, stat)                            # Sigmabar
            batches[(type(stat), mean[0].shape, mean[0].dtype, mean[0].device)].append((key, stat, mean))
        return batches

    def operators(self, batches: list, refresh: bool) -> dict:
        """{group key: operator} of a step's batches; between refreshes over the cached ones."""
        ops = {k: op for keys, _, res in batches if not isinstance(res, solvers.Deferred) for k, op in zip(keys, res)}
        ops.update({k: op for keys, _, res in batches if isinstance(res, solvers.Deferred)
                    for k, op in zip(keys, res.ops())})
        return ops if refresh else {**self.cache, **ops}

    def settle(self, ops: dict, batches: list, grads: dict, collected: bool, refresh: bool, gathered: set,
               attached_now: set, step: int = 0, stats: dict = None) -> None:
        """After the step's solve (a caching policy): the new factors cached and told to the policy; then idle (a
        gradient but no statistics on a collecting step: they wait for the next refresh) and unfactored (a gradient
        and no factor: the next step gathers for them)."""
        if not self.policy.caches:
            return
        if collected:   # new factors replace their layers' old ones only
            fresh = solvers.cached({k: ops[k] for keys, _, _ in batches for k in keys if k in ops})
            self.store(fresh)
            self.policy.refreshed(step, fresh, stats or {})   # the policy's new factors (drift: its probes)
        if refresh:
            self.idle = set()
        if collected:
            self.idle = self.idle | {n for n in grads if n not in gathered and n not in attached_now}
        covered = {n for key in self.cache for n in key}
        self.unfactored = {n for n in (self.unfactored | grads.keys()) if n not in covered and n not in self.idle}

    def begin(self, step: int, options, helpers: dict) -> None:
        """A step starts: a raised step's proposals dropped, a scheduled rate read, the factors cast to their layers."""
        self.precond_ema.pending.clear()
        if self.precond_ema.scheduled:
            self.precond_ema.beta = options.at("precond_ema", step)
        self.cache = cache_on_layers(self.cache, helpers)

    def snapshot(self) -> tuple:
        return defaultdict(int, self.counts), self.damping.copy(), self.cache, dict(self.precond_ema.buffers), self.empty

    def restore(self, saved: tuple) -> None:
        self.counts, self.damping, self.cache, self.precond_ema.buffers, self.empty = saved
        self.precond_ema.pending = {}

    def state_dict(self) -> dict:
        """The checkpoint's entries (the damping rule's as ``damping_scale`` and among ``counts``, the old layout)."""
        rule = self.damping.state_dict()
        return {
            "precond_ema": self.precond_ema.state_dict(),
            "cache": {"|".join(k): solvers.operator_state(op) for k, op in self.cache.items()},
            "counts": {**self.counts, **rule["counts"]},
            "damping_scale": rule["damping_scale"],
            "unfactored": sorted(self.unfactored),
            "idle": sorted(self.idle),
            **({"refresh_policy": policy} if (policy := self.policy.state_dict()) else {}),   # a stateful policy's
        }

    def load_state_dict(self, state: dict, helpers: dict, to) -> None:
        """Restore :meth:`state_dict`'s entries, cast to their layers (``to``: a group key's {dtype, device})."""
        self.precond_ema.load_state_dict(state["precond_ema"], to)
        self.cache = cache_on_layers({tuple(k.split("|")): solvers.operator_from_state(s)
                                      for k, s in state["cache"].items()}, helpers)
        # checkpoints written before the step counter was kept once also hold it as counts["steps"]
        self.counts = defaultdict(int, {k: v for k, v in state["counts"].items()
                                        if k != "steps" and k not in self.damping.COUNTERS})
        self.damping.load_state_dict(state)
        self.unfactored, self.idle = set(state.get("unfactored", ())), set(state.get("idle", ()))
        self.policy.load_state_dict(state.get("refresh_policy", {}))
