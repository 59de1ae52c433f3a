"""The EMAs of Algorithm 2: Gbar = EMA_{beta_g}(G) per layer and Sigmabar = EMA_{beta_Sigma}(Sigma) per
statistics group, zero-initialised and bias-corrected as Adam's moments are (beta = 0: the batch value). A dense
Sigma's EMA keeps its upper triangle only. A rate scheduled by step is set on ``beta`` before each step; its bias
correction is 1 - prod_i beta_i, the product kept in each buffer as ``decay``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def pack_upper(m: Tensor) -> Tensor:
    """Upper triangle of a symmetric matrix: d(d+1)/2 floats."""
    i, j = torch.triu_indices(m.shape[0], m.shape[0], device=m.device)
    return m[i, j]


def unpack_upper(p: Tensor, d: int) -> Tensor:
    i, j = torch.triu_indices(d, d, device=p.device)
    m = torch.zeros(d, d, dtype=p.dtype, device=p.device)
    m[i, j] = p
    m[j, i] = p
    return m


def _history(ema, entry: Optional[dict]) -> tuple:
    """(t, what the buffer keeps besides t and the sums, the bias correction) for this step's update of ``entry``
    (None: a new history; one saved without ``decay`` had the rate it has now)."""
    t = entry["t"] + 1 if entry else 1
    if not ema.scheduled:
        return t, {}, 1.0 - ema.beta ** t
    decay = (entry.get("decay", ema.beta ** entry["t"]) if entry else 1.0) * ema.beta
    return t, {"decay": decay}, 1.0 - decay


class _EMA:
    """The rate: a constant ``beta``, or (``scheduled``) one the optimizer sets before each step."""

    FIELD = "g"   # the buffer's entry besides "t"

    def __init__(self, beta) -> None:
        self.scheduled = callable(beta)
        self.beta, self.buffers, self.pending = 0.0 if self.scheduled else beta, {}, {}

    @property
    def on(self) -> bool:
        """Whether there is an EMA at all (a constant rate 0 passes the batch value through)."""
        return self.scheduled or self.beta != 0.0

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("scheduled", False)   # pickled before rates could be scheduled

    def commit(self, skip=()) -> None:
        """Keep the proposals but those of the keys in `skip`."""
        for name, (t, new, extra) in self.pending.items():
            if name not in skip:
                self.buffers[name] = {"t": t, self.FIELD: new, **extra}
        self.pending = {}

    def __call__(self, key, x):
        """propose and commit at once (an EMA outside a step's batch)."""
        out = self.propose(key, x)
        self.commit()
        return out


class GradientEMA(_EMA):
    """Gbar per layer name, ``buffers`` {name: {"t", "g"}}. Two phases, so that the step decides what to keep after
    its one host sync: :meth:`propose` returns the EMA with this step's G, :meth:`commit` keeps the proposals."""

    def propose(self, name: str, g: Tensor) -> Tensor:
        if not self.on:
            return g
        entry = self.buffers.get(name)
        if entry is not None and entry["g"].shape != g.shape:   # the layer's dim changed: a new history
            entry = None
        t, extra, corr = _history(self, entry)
        # the buffer in G's dtype and device before the product (model.double(), .cuda() since it was made): as a
        # resume casts it (checkpoint.load_ap_state), so that a resumed run multiplies the same values (issue 73, N1)
        old = entry["g"].to(dtype=g.dtype, device=g.device) if entry else torch.zeros_like(g)
        new = torch.add(old * self.beta, g, alpha=1.0 - self.beta)
        self.pending[name] = (t, new, extra)
        return new / corr

    def state_dict(self, helpers: dict) -> dict:
        """The buffers, each gathered to its whole layer's matrix by its helper (a collective under FSDP2)."""
        return {k: {**v, "g": (helpers[k].whole_matrix(v["g"]) if k in helpers else v["g"]).clone()}
                for k, v in self.buffers.items()}

    def load_state_dict(self, state: dict, helpers: Optional[dict] = None, to=None) -> None:
        """Load buffers saved whole; with `helpers`, each keeps this rank's part; `to`: names -> dtype and device."""
        def mine(k, g):
            g = g.to(**to((k,))) if to else g
            return helpers[k].local_matrix(g).clone() if helpers and k in helpers else g.clone()

        self.buffers = {k: {**v, "g": mine(k, v["g"])} for k, v in state.items()}


class CovarianceEMA(_EMA):
    """Sigmabar per statistics group (its member names joined by "|"). ``buffers``: {name: {"t", "sums"}}."""

    FIELD = "sums"

    def propose(self, key: tuple, stat) -> tuple:
        """The EMA of `stat`'s mean (an ActivationStatistics of any kind); `stat` is used up (its sums
        become the batch mean in place). Kept by :meth:`commit` (as GradientEMA's)."""
        mean = stat.mean_()
        if not self.on:
            return mean
        name = "|".join(key)
        entry = self.buffers.get(name)
        packed = [pack_upper(t) if stat.symmetric else t for t in mean]
        if entry is not None and [b.shape for b in entry["sums"]] != [p.shape for p in packed]:
            entry = None                                        # the group's dim changed: a new history
        t, extra, corr = _history(self, entry)
        old = ([b.to(dtype=p.dtype, device=p.device) for b, p in zip(entry["sums"], packed)] if entry   # as GradientEMA
               else [torch.zeros_like(p) for p in packed])
        new = [torch.add(b * self.beta, p, alpha=1.0 - self.beta) for b, p in zip(old, packed)]
        self.pending[name] = (t, new, extra)
        return tuple(unpack_upper(b / corr, m.shape[0]) if stat.symmetric else b / corr for b, m in zip(new, mean))

    def commit(self, skip=()) -> None:
        """Keep the proposals but those of the groups in `skip` (tuples of names)."""
        super().commit({"|".join(k) for k in skip})

    def shared_history(self, groups: dict) -> dict:
        """Layers keep one Sigmabar only while they have shared Sigma on every step: this step's groups are cut by
        the groups whose EMA the layers carry, and a layer that leaves a group takes a copy of its buffer (so a
        group formed by equal inputs on one step changes no result). Returns the refined {names: statistics}."""
        if not self.on or not self.buffers:
            return groups
        carried = {n: k for k in self.buffers for n in k.split("|")}
        out = {}
        for key, stat in groups.items():
            parts = {}
            for name in key:
                parts.setdefault(carried.get(name), []).append(name)
            for i, members in enumerate(parts.values()):
                out[tuple(members)] = stat if i == 0 else stat.clone()
        present = {n for key in out for n in key}
        new_keys = {"|".join(key): carried.get(key[0]) for key in out}
        for old in {carried[n] for n in present if n in carried}:
            stay = [n for n in old.split("|") if n not in present]
            if stay:
                new_keys["|".join(stay)] = old
        for new, old in new_keys.items():
            if old is not None and new != old and new not in self.buffers:
                self.buffers[new] = {**self.buffers[old], "sums": [b.clone() for b in self.buffers[old]["sums"]]}
        for old in {carried[n] for n in present if n in carried}:
            if old not in new_keys:
                del self.buffers[old]
        return out

    def state_dict(self) -> dict:
        return {k: {**v, "sums": [s.clone() for s in v["sums"]]} for k, v in self.buffers.items()}

    def load_state_dict(self, state: dict, to=None) -> None:
        """`to`: as GradientEMA's, for the group's names."""
        def mine(k, s):
            return s.to(**to(tuple(k.split("|"))), copy=True) if to else s.clone()

        self.buffers = {k: {**v, "sums": [mine(k, s) for s in v["sums"]]} for k, v in state.items()}
