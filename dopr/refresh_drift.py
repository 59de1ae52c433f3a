"""A refresh driven by drift (issue 76 item 2): ``refresh_policy="drift"``.

A group's factor P = (Sigma + lambda I)^-1 is refreshed when a cheap estimate of how far its Sigma has moved
since that factor passes ``drift_threshold``, and at the latest on every ``precond_every``-th step (the cap:
every layer refreshes then, as under ``"every"``; k = 1 refreshes every step and the policy does nothing).

The estimate, with no Sigma GEMM on a step that does not refresh:

* at each refresh of a group, r = :data:`PROBES` fixed random vectors u_j (d, drawn from a generator seeded by
  the step and the group's names: reproducible, and kept in the checkpoint) go through the new operator:
  w_j = P u_j (``op.apply`` on the rows u_j^T; P is symmetric). The reference is r_j = w_j^T Sigma w_j, from the
  Sigma just factored (the batch Sigma of that step, copied in :meth:`DriftPolicy.due` before the factorisation
  may normalise it in place), or from the first probe pass where the policy did not see that Sigma (a layer
  DoPr factored between refreshes because it had no factor);
* on a later training forward that gathers nothing, the capture hands the layer's input to
  :meth:`DriftPolicy.observe` (dopr/capture.py's observer), which adds s_j = ||X w_j||^2 over its rows X (the
  homogeneous 1 included): n d r multiply-adds, r / d of the n d^2 of Sigma's GEMM. Layers that share a Sigma
  (one input tensor) share the probes and one pass;
* when the step is over (the first ``gathers`` call for the next step) the drift of each observed group is
  ``max_j |s_j / r_j - 1|``, s_j = (sum of ||X w_j||^2) / (rows), over the step's forwards. The maximum: one
  probe that moved is enough; r_j and s_j are quadratic forms of the same w_j, so the ratio is exactly 1 while
  the inputs' second moment along w_j is what it was, whatever its scale. Weighting by P makes w_j large in
  Sigma's weak directions, where a stale factor amplifies the gradient most. A group whose drift passed the
  threshold is refreshed on the next step: ``gathers`` says so, that step's forwards gather statistics, and
  ``due`` names the group (with any group a probe or the cap names, and, on such a step, any group whose drift
  measured on the gathered Sigma itself, w_j^T Sigma w_j at d^2 r, passed the threshold).

Noise: for n independent rows, s_j / r_j of another batch of the same distribution scatters by about
sqrt(2 / n) (Gaussian rows); a threshold well above that (0.1 for a few hundred rows and more) reacts to the
inputs, not to sampling.

Cost and reads: one host read-back per step that does not gather (the groups' drift, one small tensor), and
an all-reduce of the probe sums under data parallelism (so that every rank decides the same). Statistics kinds
other than dense and sample rows (rank1_diag's moments, an embedding's diagonal) and forwards under
torch.compile or a torch.func transform are not probed: those layers keep the cap's cadence, EveryK's.

Counters: refreshes and steps per layer, ``DoPr.stats()["refresh_fraction"]`` (per layer, and
``"refresh_fraction_all"``: all layers' refreshes over all their steps), also shown in the health report.
"""
from __future__ import annotations

import math
import weakref
import zlib
from typing import Mapping, Optional

import torch
from torch import Tensor

from .refresh_policy import RefreshPolicy, register_policy

#: r, the probe vectors per group
PROBES = 4
#: the probes' base seed (the step and the group's names are mixed in)
SEED = 76


def _label(key: tuple) -> str:
    return "|".join(key)


def _seed(step: int, key: tuple) -> int:
    return (SEED * 1_000_003 + step * 7_919 + zlib.crc32(_label(key).encode())) % (2 ** 62)


def _reference(stat) -> Optional[tuple]:
    """What a quadratic form w^T Sigma w is read from: ("dense", Sigma) (a copy: the factorisation may turn the
    sums into Sigma in place) or ("samples", rows, n); None for other kinds or no samples."""
    kind = getattr(stat, "kind", None)
    if stat is None or not stat.count or kind not in ("dense", "samples"):
        return None
    if kind == "dense":
        return ("dense", stat.sums[0] / stat.count)
    return ("samples", stat.sums[0], stat.count)   # rows are never changed in place


def _quadratic(ref: tuple, wt: Tensor) -> Tensor:
    """(w_j^T Sigma w_j)_j for the rows w_j^T of `wt` (r, d)."""
    if ref[0] == "dense":
        sigma = ref[1]
        w = wt.to(sigma.dtype)
        return ((w @ sigma) * w).sum(1).to(wt.dtype)
    rows, n = ref[1], ref[2]
    return (rows @ wt.to(rows.dtype).T).square().sum(0).div(n).to(wt.dtype)


def _drift(s: list, ref: list) -> float:
    """max_j |s_j / r_j - 1| (a reference of 0: the probe's direction carried nothing, any change is drift; a
    non-finite s_j or r_j: infinite drift)."""
    out = 0.0
    for a, b in zip(s, ref):
        v = abs(a / b - 1.0) if b > 0 else (0.0 if a == 0 else math.inf)
        out = max(out, v if math.isfinite(v) else math.inf)
    return out


def _dim(stat) -> Optional[int]:
    kind = getattr(stat, "kind", None)
    if kind not in ("dense", "samples"):
        return None
    return stat.sums[0].shape[-1]


@register_policy("drift")
class DriftPolicy(RefreshPolicy):
    """Refresh a group when its probes say its Sigma moved by more than ``drift_threshold``, and every group on
    every ``precond_every``-th step (see the module's docstring)."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.k = options.precond_every
        self.threshold = float(options.drift_threshold)
        self.caches = self.k > 1
        self._probes: dict = {}      # {group key: [w^T (r, d), reference (r,) or None: from the first probe pass]}
        self._group: dict = {}       # {layer name: the group key it was last refreshed in}
        self._acc: dict = {}         # {group key: [sum of ||X w_j||^2 (r,), rows]}: this step's probe passes
        self._seen: dict = {}        # {group key: weakref of the input it last probed} (transient)
        self._sigma: dict = {}       # {group key: _reference}: the Sigma of a due group, until it is refreshed
        self._pending: set = set()   # layers whose drift passed the threshold: refreshed on the next step
        self._now = -1               # the step whose forwards run now (the last one ``gathers`` was asked about)
        self._first: dict = {}       # {layer name: the step of its first refresh}
        self._refreshes: dict = {}   # {layer name: its refreshes}
        self.drift: dict = {}        # {group label: its last drift estimate}

    # ------------------------------------------------------------------ the seam
    def gathers(self, step: int) -> bool:
        if step > self._now:   # the forwards of the steps before `step` are over: their probes are read
            self._fold()
            self._now = step
        return step % self.k == 0 or bool(self._pending)

    def due(self, step: int, keys) -> set:
        stats = keys if isinstance(keys, Mapping) else {}
        if step % self.k == 0:
            out = set(keys)
        else:
            out = {key for key in keys if any(n in self._pending or self._group.get(n) != key for n in key)}
            out |= self._measured(stats, [key for key in keys if key not in out])
        self._pending = set()   # a flagged layer without statistics this step waits for the cap
        self._sigma = {key: ref for key in out if (ref := _reference(stats.get(key))) is not None}
        return out

    def refreshed(self, step: int, ops: dict, stats=None) -> None:
        """The groups `ops` ({group key: operator}) got new factors at `step`: new probes, new references."""
        stats = stats if isinstance(stats, Mapping) else {}
        for key, op in ops.items():
            for name in key:
                old = self._group.get(name)
                if old is not None and old != key:   # the group changed: its old probes describe another Sigma
                    self._probes.pop(old, None)
                    self._acc.pop(old, None)
                self._group[name] = key
                self._first.setdefault(name, step)
                self._refreshes[name] = self._refreshes.get(name, 0) + 1
            ref = self._sigma.get(key)
            d = ref[1].shape[-1] if ref is not None else _dim(stats.get(key))
            if d is None:                            # not probed: the cap's cadence
                self._probes.pop(key, None)
                continue
            like = ref[1] if ref is not None else stats[key].sums[0]
            u = torch.randn(PROBES, d, dtype=torch.float64, generator=torch.Generator().manual_seed(_seed(step, key)))
            u = u.to(dtype=like.dtype if like.is_floating_point() else torch.float32, device=like.device)
            wt = op.apply(u)                         # rows w_j^T = u_j^T P: w_j = P u_j
            self._probes[key] = [wt, None if ref is None else _quadratic(ref, wt)]
            self._acc.pop(key, None)
        self._sigma = {}

    def observe(self, helper, x: Tensor) -> None:
        """A training forward that gathers nothing read `x`: add ||X w_j||^2 over its rows for the layer's group."""
        key = self._group.get(helper.name)
        probe = self._probes.get(key) if key is not None else None
        if probe is None:
            return
        seen = self._seen.get(key)
        if seen is not None and seen() is x:         # another member of the group on the same input
            return
        self._seen[key] = weakref.ref(x)
        with torch.autocast(x.device.type, enabled=False):
            z = helper.activations(x)
            wt = probe[0]
            d_in = z.shape[1]
            if wt.shape[1] not in (d_in, d_in + 1) or wt.shape[1] != helper.dim:
                return
            if wt.device != z.device:
                wt = probe[0] = wt.to(z.device)
                probe[1] = None if probe[1] is None else probe[1].to(z.device)
            z = z.to(wt.dtype)
            xw = (torch.addmm(wt[:, d_in], z, wt[:, :d_in].T) if wt.shape[1] == d_in + 1   # [z, 1] w: (n, r), n d r
                  else z @ wt.T)
            s = xw.square().sum(0)
        acc = self._acc.get(key)
        if acc is None:
            self._acc[key] = [s, z.shape[0]]
        else:
            acc[0] = acc[0] + s
            acc[1] += z.shape[0]

    # ------------------------------------------------------------------ the estimate
    def _fold(self) -> None:
        """Read the drift of every group probed since the last fold (one read-back); flag those past the threshold."""
        from .distributed import is_distributed

        self._seen = {}
        distributed = is_distributed()
        keys = sorted(self._probes) if distributed else sorted(k for k in self._acc if k in self._probes)
        acc, self._acc = self._acc, {}
        if not keys:
            return
        device = self._probes[keys[0]][0].device
        sums = torch.zeros(len(keys), PROBES + 1, dtype=torch.float64, device=device)   # [sum ||X w_j||^2, rows]
        for i, key in enumerate(keys):
            if key in acc:
                sums[i, :PROBES] = acc[key][0].to(device, torch.float64)
                sums[i, PROBES] = float(acc[key][1])
        if distributed:   # every rank decides the same (gathers() says whether the next step all-reduces Sigma)
            import torch.distributed as dist
            dist.all_reduce(sums)
        host = self._read(keys, sums[:, :PROBES] / sums[:, PROBES:], sums[:, PROBES] > 0)
        drifts = {}
        for key, (s, ref, seen) in zip(keys, host):
            if not seen:
                continue
            probe = self._probes[key]
            if probe[1] is None:                       # the first probe pass is the reference
                probe[1] = torch.tensor(s, dtype=probe[0].dtype).to(probe[0].device)
            else:
                drifts[key] = _drift(s, ref)
        self._flag(drifts)

    def _read(self, keys: list, s: Tensor, seen: Tensor) -> list:
        """[(s_j as floats, the reference's as floats or None, seen)] per group: one read-back of the device's numbers."""
        device = s.device
        refs = torch.stack([self._probes[k][1].to(device, torch.float64) if self._probes[k][1] is not None
                            else torch.full((PROBES,), float("nan"), dtype=torch.float64, device=device) for k in keys])
        host = torch.cat([s, refs, seen[:, None].to(torch.float64)], 1).tolist()
        return [(row[:PROBES], None if self._probes[k][1] is None else row[PROBES:2 * PROBES], bool(row[-1]))
                for k, row in zip(keys, host)]

    def _flag(self, drifts: dict) -> set:
        out = set()
        for key, v in drifts.items():
            self.drift[_label(key)] = v
            if v > self.threshold:
                out.add(key)
                self._pending.update(key)
        return out

    def _measured(self, stats: Mapping, keys: list) -> set:
        """Of `keys` (probed, not due), those whose drift measured on this step's gathered Sigma passed the
        threshold: w_j^T Sigma w_j, d^2 r, no new GEMM of the inputs."""
        keys = [k for k in keys if k in self._probes and self._probes[k][1] is not None
                and _reference(stats.get(k)) is not None]
        if not keys:
            return set()
        device = self._probes[keys[0]][0].device
        s = torch.stack([_quadratic(_reference(stats[k]), self._probes[k][0].to(stats[k].sums[0].device))
                         .to(device, torch.float64) for k in keys])
        host = self._read(keys, s, torch.ones(len(keys), dtype=torch.bool, device=device))
        return self._flag({k: _drift(si, ref) for k, (si, ref, _) in zip(keys, host)})

    # ------------------------------------------------------------------ counters and state
    def refresh_fractions(self) -> dict:
        """{layer name: its refreshes / the steps since its first}: 1 / k under the cap alone."""
        return {n: self._refreshes[n] / max(1, self._now - first) for n, first in self._first.items()}

    def stats(self) -> dict:
        steps = sum(max(1, self._now - first) for first in self._first.values())
        return {"refresh_fraction": self.refresh_fractions(),
                "refresh_fraction_all": sum(self._refreshes.values()) / steps if steps else 0.0}

    def state_dict(self) -> dict:
        return {"probes": {_label(k): {"wt": wt, "ref": ref} for k, (wt, ref) in self._probes.items()},
                "group": {n: _label(k) for n, k in self._group.items()},
                "pending": sorted(self._pending), "now": self._now, "first": dict(self._first),
                "refreshes": dict(self._refreshes), "drift": dict(self.drift)}

    def load_state_dict(self, state: dict) -> None:
        if not state:   # a checkpoint of another policy: start afresh
            return
        split = lambda label: tuple(label.split("|"))   # noqa: E731
        self._probes = {split(k): [v["wt"], v["ref"]] for k, v in state["probes"].items()}
        self._group = {n: split(k) for n, k in state["group"].items()}
        self._pending = set(state["pending"])
        self._now = state["now"]
        self._first, self._refreshes = dict(state["first"]), dict(state["refreshes"])
        self.drift = dict(state.get("drift", {}))
        self._acc, self._seen, self._sigma = {}, {}, {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_seen": {}}
