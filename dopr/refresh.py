"""The refresh: what turns a step's statistics into factors, and when (issue 75 item 1, the first verb).

A :class:`Refresh` owns the refresh state of one DoPr optimizer: the refresh policy (dopr/refresh_policy.py,
when factors are refreshed), the factors it keeps between refreshes (the cache, {group key: operator}), the
layers with a gradient and no factor yet (unfactored) or waiting for the next refresh (idle), the damping rule
(dopr/damping.py, lambda per group), the Sigma EMA (dopr/ema.py) and the counters of DoPr.stats(). It
serialises that state itself (:meth:`Refresh.state_dict`, :meth:`Refresh.load_state_dict`: the entries of the
checkpoint's ``"dopr"`` dict it owns, dopr/checkpoint.py). The other verb, apply (Gbar, the step's solve,
read-back and write-back), is DoPr's (dopr/optimizer.py, dopr/apply.py).
"""
from __future__ import annotations

from collections import defaultdict

from . import damping, refresh_policy, solvers
from .ema import CovarianceEMA
from .statistics import statistics_dtype


def without(cache: dict, names) -> dict:
    """The cached factors but those of `names`: a group that loses members keeps its factor for the rest."""
    out = {}
    for key, op in cache.items():
        rest = tuple(n for n in key if n not in names)
        if rest:
            out[rest if len(rest) < len(key) else key] = op
    return out


def cache_on_layers(cache: dict, helpers: dict) -> dict:
    """The cached factors {group key: operator} in their layers' statistics dtype and on their device (a
    checkpoint from another dtype or device, a model converted between refreshes: cast once, where they
    differ); a float64 sample-space factor keeps its dtype (bit-identical resume). ``helpers``: {name: helper}."""
    out = {}
    for key, op in cache.items():
        w = next((helpers[n].module.weight for n in key if n in helpers), None)
        out[key] = op if w is None else solvers.operator_to(op, statistics_dtype(w.dtype), w.device)
    return out


class Refresh:
    """The refresh state of one DoPr: ``policy``, ``damping``, ``precond_ema``, ``cache``, ``unfactored``,
    ``idle`` and ``counts`` (what DoPr counts, its damping rule's counters apart)."""

    def __init__(self, options) -> None:
        self.policy = refresh_policy.build(options)      # when factors are refreshed
        self.damping = damping.build(options)            # lambda per group, its state and counters
        self.precond_ema = CovarianceEMA(options.precond_ema)
        self.cache: dict = {}        # a caching policy: {group key: its last good factor}, kept until a new one
        self.unfactored: set = set()   # layers with a gradient and no factor: the next step gathers statistics
        self.idle: set = set()         # ... or not, for those with a gradient but no forward on a collecting
                                       # step since the last refresh: they wait for the next refresh
        self.counts = defaultdict(int)

    @classmethod
    def from_pickled(cls, options, state: dict) -> "Refresh":
        """The refresh state of a DoPr copied or pickled before this module, popped from its ``__dict__``."""
        out = cls(options)
        rule, policy = state.pop("_damping", None), state.pop("_policy", None)
        out.damping = damping.from_pickled(options, state) if rule is None else rule
        out.policy = out.policy if policy is None else policy
        out.precond_ema = state.pop("_precond_ema", out.precond_ema)
        out.cache, out.unfactored, out.idle = state.pop("_cache", {}), state.pop("_unfactored", set()), state.pop("_idle", set())
        out.counts = defaultdict(int, state.pop("_counts", {}))
        state.pop("_damping_scale", None)
        return out

    def gathers(self, step: int) -> bool:
        """Whether the forwards of AP step ``step`` gather statistics: when the policy says, and on the steps
        after a layer had a gradient but no factor (it gets one then)."""
        return self.policy.gathers(step) or bool(self.unfactored)

    def counters(self) -> dict:
        return {**self.counts, **self.damping.counters()}

    def forget(self, names, keep: set) -> None:
        """Drop the factors of `names` (their dimension changed) and the unfactored layers not in `keep`."""
        self.cache = without(self.cache, names)
        self.unfactored &= keep

    def store(self, fresh: dict) -> None:
        """New factors {group key: operator} replace their layers' old ones only."""
        self.cache = {**without(self.cache, {n for key in fresh for n in key}), **fresh}

    def after_step(self, grads: dict, collected: bool, refresh: bool, gathered: set, attached_now: set) -> None:
        """precond_every > 1: unfactored and idle after a step. Unfactored: the layers the next step gathers
        statistics for, those with a gradient and no factor (not run on a refresh step yet, added or thawed, a
        first Sigma not finite), until they get one; idle: a layer with a gradient but no statistics on a
        collecting step waits for the next refresh."""
        if refresh:
            self.idle = set()
        if collected:
            self.idle = self.idle | {n for n in grads if n not in gathered and n not in attached_now}
        covered = {n for key in self.cache for n in key}
        self.unfactored = {n for n in (self.unfactored | grads.keys()) if n not in covered and n not in self.idle}

    # ------------------------------------------------------------------ undo (on_nonfinite="raise")
    def snapshot(self) -> tuple:
        return defaultdict(int, self.counts), self.damping.copy(), self.cache, dict(self.precond_ema.buffers)

    def restore(self, saved: tuple) -> None:
        self.counts, self.damping, self.cache, self.precond_ema.buffers = saved
        self.precond_ema.pending = {}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The checkpoint's entries of the refresh state (its damping rule's state as ``damping_scale`` and its
        counters among ``counts``, the layout of checkpoints before dopr/damping.py)."""
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
        """Restore :meth:`state_dict`'s entries; factors and EMA buffers cast to their layers (``helpers``,
        {name: helper}; ``to``: a group key's {dtype, device})."""
        self.precond_ema.load_state_dict(state["precond_ema"], to)
        self.cache = cache_on_layers({tuple(k.split("|")): solvers.operator_from_state(s)
                                      for k, s in state["cache"].items()}, helpers)
        # checkpoints written before the step counter was kept once also hold it as counts["steps"]
        self.counts = defaultdict(int, {k: v for k, v in state["counts"].items()
                                        if k != "steps" and k not in self.damping.COUNTERS})
        self.damping.load_state_dict(state)
        self.unfactored, self.idle = set(state.get("unfactored", ())), set(state.get("idle", ()))
        self.policy.load_state_dict(state.get("refresh_policy", {}))
