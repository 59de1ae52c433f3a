"""A refresh driven by drift (issue 76 item 2): ``refresh_policy="drift"``.

A group's factor P = (Sigma + lambda I)^-1 is refreshed when an estimate of how far its Sigma has moved since
that factor passes ``drift_threshold``, and at the latest on every ``precond_every``-th step (the cap: every layer
refreshes then, as under ``"every"``). The estimate needs no Sigma GEMM on a step that does not refresh:

* at each refresh of a group, :data:`PROBES` random vectors u_j (seeded by the step and the group's names) go
  through the new operator, w_j = P u_j; the reference is r_j = w_j^T Sigma w_j, from the Sigma just factored
  (copied in :meth:`DriftPolicy.due` before the factorisation may normalise it in place), or from the first probe
  pass where the policy did not see that Sigma;
* a later training forward that gathers nothing hands the layer's input to :meth:`DriftPolicy.observe`, which
  adds s_j = ||X w_j||^2 over its rows X (n d r multiply-adds, r / d of Sigma's GEMM; layers sharing an input
  share the probes and one pass);
* when the step is over, the drift of each observed group is ``max_j |s_j / r_j - 1|`` (s_j per row): exactly 0
  while the inputs' second moment along w_j is unchanged, whatever its scale; weighting by P makes w_j large in
  Sigma's weak directions, where a stale factor amplifies the gradient most. A group past the threshold is
  refreshed on the next step (``gathers``, ``due``), as is one whose drift measured on a Sigma gathered anyway
  passes it.

Noise: s_j / r_j of another batch of the same distribution scatters by about sqrt(2 / n) for n Gaussian rows, and
r_j read from the very Sigma P was inverted from is biased low (measured: results/staleness/README.md). ``drift_test="noise"``
takes r_j out of sample (s_j of the first probe pass after the refresh) and flags a group when, for some probe,
|s_j / r_j - 1| - Z (s_j / r_j) sqrt(v_s + v_r) > drift_threshold: v the relative variances of s_j and r_j from
the per-sample totals T_b (a sample's rows one block), (B sum T_b^2 / (sum T_b)^2 - 1) / (B - 1), by the delta
method; Z = 3 standard errors, a convention. It cannot see a stale factor whose inputs do not move.

Cost: one host read-back per step that does not gather, and an all-reduce of the probe sums under data
parallelism. Statistics kinds other than dense and sample rows, and compiled or torch.func forwards, are not
probed: those layers keep the cap's cadence. ``DoPr.stats()["refresh_fraction"]`` (per layer) and
``"refresh_fraction_all"`` count the refreshes.
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
#: ``drift_test``: plain (the threshold on max_j |s_j / r_j - 1|) or noise (past the threshold by Z standard errors)
TESTS = ("plain", "noise")
#: the noise test's margin in standard errors of s_j / r_j: a convention (a one-sided tail of 0.13%), not tuned
Z = 3.0


def _label(key: tuple) -> str:
    return "|".join(key)


def _seed(step: int, key: tuple) -> int:
    return (SEED * 1_000_003 + step * 7_919 + zlib.crc32(_label(key).encode())) % (2 ** 62)


def _reference(stat) -> Optional[tuple]:
    """What w^T Sigma w is read from: ("dense", a copy of Sigma) or ("samples", rows, n); None for other kinds."""
    kind = getattr(stat, "kind", None)
    if stat is None or not stat.count or kind not in ("dense", "samples"):
        return None
    if kind == "dense":
        return ("dense", stat.sums[0] / stat.count)
    return ("samples", stat.sums[0], stat.count)   # rows are never changed in place


def _quadratic(ref: tuple, wt: Tensor) -> Tensor:
    """(w_j^T Sigma w_j)_j for the rows w_j^T of `wt` (r, d)."""
    if ref[0] == "dense":
        w = wt.to(ref[1].dtype)
        return ((w @ ref[1]) * w).sum(1).to(wt.dtype)
    rows, n = ref[1], ref[2]
    return (rows @ wt.to(rows.dtype).T).square().sum(0).div(n).to(wt.dtype)


def _drift(s: list, ref: list) -> float:
    """max_j |s_j / r_j - 1| (r_j = 0: any change is drift; a non-finite s_j or r_j: infinite drift)."""
    out = 0.0
    for a, b in zip(s, ref):
        v = abs(a / b - 1.0) if b > 0 else (0.0 if a == 0 else math.inf)
        out = max(out, v if math.isfinite(v) else math.inf)
    return out


def _relvar(total: Tensor, squares: Tensor, samples: Tensor) -> Tensor:
    """The relative variance of s_j from B samples' totals T_b: (B sum T_b^2 / (sum T_b)^2 - 1) / (B - 1); inf for
    fewer than 2 samples."""
    b = samples.to(total.dtype)
    rv = (b * squares / total.square() - 1).clamp_min(0) / (b - 1)
    return torch.where(b > 1, rv, torch.full_like(rv, math.inf))


def _noisy(s: list, ref: list, rv: list, rv_ref: list) -> float:
    """max_j of |s_j / r_j - 1| less Z (s_j / r_j) sqrt(rv_j + rv_ref_j), at least 0 (a non-finite s_j or r_j, or
    r_j = 0 < s_j: infinite; a probe without an error estimate: 0)."""
    out = 0.0
    for a, b, va, vb in zip(s, ref, rv, rv_ref):
        if not (math.isfinite(a) and math.isfinite(b)) or (b <= 0 and a != 0):
            return math.inf
        if b <= 0 or not (math.isfinite(va) and math.isfinite(vb)):
            continue
        q = a / b
        out = max(out, abs(q - 1.0) - Z * q * math.sqrt(va + vb))
    return out


def _dim(stat) -> Optional[int]:
    return stat.sums[0].shape[-1] if getattr(stat, "kind", None) in ("dense", "samples") else None


@register_policy("drift")
class DriftPolicy(RefreshPolicy):
    """Refresh a group when its probes say its Sigma moved by more than ``drift_threshold``, and every group on
    every ``precond_every``-th step."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.k = options.precond_every
        self.threshold = float(options.drift_threshold)
        self.caches = self.k > 1
        self.noise = getattr(options, "drift_test", "plain") == "noise"
        self._probes: dict = {}      # {group key: [w^T (r, d), reference or None (noise: + its variances, rows)]}
        self._group: dict = {}       # {layer name: the group key it was last refreshed in}
        self._acc: dict = {}         # {group key: [sum of ||X w_j||^2, rows] (noise: + [sum of T_b^2, samples])}
        self._seen: dict = {}        # {group key: weakref of the input it last probed} (transient)
        self._sigma: dict = {}       # {group key: _reference}: the Sigma of a due group, until it is refreshed
        self._pending: set = set()   # layers whose drift passed the threshold: refreshed on the next step
        self._now = -1               # the step whose forwards run now (the last one ``gathers`` was asked about)
        self._first: dict = {}       # {layer name: the step of its first refresh}
        self._refreshes: dict = {}   # {layer name: its refreshes}
        self.drift: dict = {}        # {group label: its last drift estimate}

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
        self._sigma = {} if self.noise else {key: ref for key in out if (ref := _reference(stats.get(key))) is not None}
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
            self._probes[key] = ([wt, None if ref is None else _quadratic(ref, wt)]
                                 + ([None, None] if self.noise else []))
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
            q = xw.square()
            s = q.sum(0)
            n = z.shape[0]
            if self.noise:   # per-sample totals T_b: the rows of one sample (patches, positions) are one block
                b = x.shape[0] if x.dim() > 2 and x.shape[0] and n % x.shape[0] == 0 else n
                sq = q.reshape(b, n // b, -1).sum(1).square().sum(0)   # n r more
        new, acc = [s, n] + ([sq, b] if self.noise else []), self._acc.get(key)
        self._acc[key] = new if acc is None else [a + v for a, v in zip(acc, new)]

    def _fold(self) -> None:
        """Read the drift of every group probed since the last fold (one read-back) and flag them."""
        from .distributed import is_distributed

        self._seen = {}
        distributed = is_distributed()
        keys = sorted(self._probes) if distributed else sorted(k for k in self._acc if k in self._probes)
        acc, self._acc = self._acc, {}
        if not keys:
            return
        device = self._probes[keys[0]][0].device
        r = PROBES
        # [sum ||X w_j||^2, rows] (and under the noise test [sum of T_b^2, samples])
        sums = torch.zeros(len(keys), 2 * r + 2 if self.noise else r + 1, dtype=torch.float64, device=device)
        for i, key in enumerate(keys):
            if key in acc:
                sums[i, :r] = acc[key][0].to(device, torch.float64)
                sums[i, r] = float(acc[key][1])
                if self.noise:
                    sums[i, r + 1:2 * r + 1] = acc[key][2].to(device, torch.float64)
                    sums[i, 2 * r + 1] = float(acc[key][3])
        if distributed:   # every rank decides the same (gathers() says whether the next step all-reduces Sigma)
            import torch.distributed as dist
            dist.all_reduce(sums)
        rv = (_relvar(sums[:, :r], sums[:, r + 1:2 * r + 1], sums[:, 2 * r + 1:]) if self.noise else None)
        host = self._read(keys, sums[:, :r] / sums[:, r:r + 1], sums[:, r] > 0, rv, sums[:, r])
        drifts = {}
        for key, (s, ref, seen, rvs, rv_ref, rows) in zip(keys, host):
            if not seen:
                continue
            probe = self._probes[key]
            if probe[1] is None:                       # the first probe pass is the reference
                probe[1] = torch.tensor(s, dtype=probe[0].dtype).to(probe[0].device)
                if self.noise:
                    probe[2], probe[3] = torch.tensor(rvs, dtype=torch.float64).to(probe[0].device), rows
            else:
                drifts[key] = _noisy(s, ref, rvs, rv_ref) if self.noise else _drift(s, ref)
        self._flag(drifts)

    def _read(self, keys: list, s: Tensor, seen: Tensor, rv: Optional[Tensor] = None,
              rows: Optional[Tensor] = None) -> list:
        """[(s_j, the reference or None, seen, s_j's relative variances, the reference's, the rows)] per group as
        floats (the last three None but under the noise test): one read-back."""
        device = s.device
        r = PROBES
        nan = torch.full((r,), float("nan"), dtype=torch.float64, device=device)
        cols = [s, torch.stack([self._probes[k][1].to(device, torch.float64) if self._probes[k][1] is not None
                                else nan for k in keys])]
        if self.noise:
            cols += [rv.to(device, torch.float64),
                     torch.stack([self._probes[k][2].to(device, torch.float64) if self._probes[k][2] is not None
                                  else nan for k in keys]), rows.to(device, torch.float64)[:, None]]
        host = torch.cat([*cols, seen[:, None].to(torch.float64)], 1).tolist()
        return [(row[:r], None if self._probes[k][1] is None else row[r:2 * r], bool(row[-1]),
                 row[2 * r:3 * r] if self.noise else None, row[3 * r:4 * r] if self.noise else None,
                 row[4 * r] if self.noise else None)
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
        threshold (w_j^T Sigma w_j, d^2 r)."""
        keys = [k for k in keys if k in self._probes and self._probes[k][1] is not None
                and _reference(stats.get(k)) is not None]
        if not keys:
            return set()
        device = self._probes[keys[0]][0].device
        s = torch.stack([_quadratic(_reference(stats[k]), self._probes[k][0].to(stats[k].sums[0].device))
                         .to(device, torch.float64) for k in keys])
        rv = rows = None
        if self.noise:   # no rows here: the reference's spread scaled to this Sigma's rows (the null: the same inputs)
            nan = torch.full((PROBES,), float("nan"), dtype=torch.float64, device=device)   # none kept: not tested
            rv = torch.stack([nan if self._probes[k][2] is None else
                              self._probes[k][2].to(device, torch.float64) * (self._probes[k][3] / stats[k].count)
                              for k in keys])
            rows = torch.tensor([stats[k].count for k in keys], dtype=torch.float64)
        host = self._read(keys, s, torch.ones(len(keys), dtype=torch.bool, device=device), rv, rows)
        return self._flag({k: _noisy(si, ref, rvs, rvr) if self.noise else _drift(si, ref)
                           for k, (si, ref, _, rvs, rvr, _) in zip(keys, host)})

    def refresh_fractions(self) -> dict:
        """{layer name: its refreshes / the steps since its first}: 1 / k under the cap alone."""
        return {n: self._refreshes[n] / max(1, self._now - first) for n, first in self._first.items()}

    def stats(self) -> dict:
        steps = sum(max(1, self._now - first) for first in self._first.values())
        return {"refresh_fraction": self.refresh_fractions(),
                "refresh_fraction_all": sum(self._refreshes.values()) / steps if steps else 0.0}

    def state_dict(self) -> dict:
        return {"probes": {_label(k): dict(zip(("wt", "ref", "rv", "rows"), p)) for k, p in self._probes.items()},
                "group": {n: _label(k) for n, k in self._group.items()},
                "pending": sorted(self._pending), "now": self._now, "first": dict(self._first),
                "refreshes": dict(self._refreshes), "drift": dict(self.drift)}

    def load_state_dict(self, state: dict) -> None:
        if not state:   # a checkpoint of another policy: start afresh
            return
        split = lambda label: tuple(label.split("|"))   # noqa: E731
        self._probes = {split(k): [v["wt"], v["ref"]] + ([v.get("rv"), v.get("rows")] if self.noise else [])
                        for k, v in state["probes"].items()}
        self._group = {n: split(k) for n, k in state["group"].items()}
        self._pending = set(state["pending"])
        self._now = state["now"]
        self._first, self._refreshes = dict(state["first"]), dict(state["refreshes"])
        self.drift = dict(state.get("drift", {}))
        self._acc, self._seen, self._sigma = {}, {}, {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_seen": {}}
