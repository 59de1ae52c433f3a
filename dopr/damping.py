"""The damping rules: how each statistics group's lambda in (Sigmabar + lambda I)^-1 is chosen.

A :class:`DampingRule` gives lambda for a batch of same-size groups (:meth:`DampingRule.lam`, a (B,) tensor)
and keeps its own state and counters; DoPr builds one from its options (:func:`build`) and calls it once per
batch in ``dopr.refresh.Refresh.factor``. The rules: ``"trace"`` (the paper's, :func:`trace_damping`);
``"spectrum"`` and ``"filter"`` (``weak_share_bound``: the trace lambda raised by the smallest power of 2 that
keeps at most that share of ||M||^2 in weakly excited directions; issue 48); ``"sample_count"`` (the
Marchenko-Pastur lower edge at q = d / N_eff, dopr/sample_count.py; issue 67). A new rule is one class here,
registered with :func:`register_rule` under the option value that chooses it (:func:`rule_name`).
"""
from __future__ import annotations

import copy
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch
from torch import Tensor

from .health import WEAK_VARIANCE, spectrum
from .sample_count import ema_count_factor, sample_count_damping

#: damping_mode's values: the trace rule's scales (:func:`trace_damping`)
TRACE_MODES = ("trace", "trace_per_dim", "absolute", "trace_activations")
#: the modes that read whether a statistic's last coordinate is the homogeneous 1
HOMOGENEOUS_MODES = ("trace_activations",)


def trace_floor(gamma: float, mode: str):
    """The trace rule's lambda as a function of a batch of Sigma's diagonals (and the homogeneous flags)."""
    return functools.partial(trace_damping, gamma, mode)


def trace_damping(gamma: float, mode: str, diag: Tensor, homogeneous=None) -> Tensor:
    """The absolute damping lambda for Sigma's diagonal ``diag`` (or a batch of them on the last axis):
    gamma * tr(Sigma) ("trace"), gamma * tr(Sigma) / d ("trace_per_dim"), gamma ("absolute") or
    gamma * (tr(Sigma) - Sigma_hh) ("trace_activations"; ``homogeneous``, a bool or one per member: the last
    coordinate is the homogeneous 1, left out of the trace; issue 48: on SiT-S/2's attn.proj inputs the 1
    dominated tr(Sigma)).

    Prop. PrecondInvariance is for the undamped Sigma^-1: an affine map z -> Q z + c is A = [[Q, c], [0, 1]]
    on [z; 1], and a damping D keeps the update invariant exactly when D' = A D A^T, which lambda I does only
    for orthogonal Q, c = 0, in both trace modes. What "trace_activations" keeps is the scale part: under
    z -> a z its lambda scales as a^2, like the activations' eigenvalues, so the scaled update differs only in
    the bias coordinate's damping (a^2 lambda instead of lambda); under "trace", lambda = gamma (a^2 tr(Sigma_zz)
    + 1) is set by the 1 for small activations."""
    if mode == "trace":
        return gamma * diag.sum(-1)
    if mode == "trace_per_dim":
        return gamma * diag.sum(-1) / diag.shape[-1]
    if mode == "trace_activations":
        trace = diag.sum(-1)
        if homogeneous is None or homogeneous is False:
            return gamma * trace
        if homogeneous is True:
            return gamma * (trace - diag[..., -1])
        h = torch.as_tensor(homogeneous, dtype=torch.bool, device=diag.device)
        return gamma * (trace - torch.where(h, diag[..., -1], torch.zeros_like(trace)))
    return torch.full(diag.shape[:-1], gamma, dtype=diag.dtype, device=diag.device)


#: how far damping_scale may raise lambda: 2^20 ~ 1e6 (from 1e-6 * tr(Sigma) up to tr(Sigma))
MAX_DOUBLINGS = 20


def direction_energy(sigma: Tensor, grad: Tensor, spec: Optional[tuple] = None) -> tuple:
    """(e, p, g2): Sigma's eigenvalues (float64, clamped at 0), their shares of tr(Sigma) and ||G v_i||^2 (a sum
    over G's rows: under row sharding the ranks' g2 add). ``spec``: :func:`spectrum` of `sigma`, if computed."""
    e, v, p = spectrum(sigma) if spec is None else spec
    return e, p, (grad.detach().double() @ v).square().sum(0)


def damping_scale(e: Tensor, p: Tensor, g2: Tensor, lam, bound: float, max_doublings: int = MAX_DOUBLINGS) -> float:
    """The smallest f = 2^j, j <= max_doublings, for which M = G (Sigma + f lam I)^-1 keeps at most the share
    ``bound`` of ||M||_F^2 in directions carrying under WEAK_VARIANCE of the variance (:func:`direction_energy`);
    else the largest f. 1.0 when nothing is weak or G is 0."""
    weak = p < WEAK_VARIANCE
    lam = float(lam)
    if not bool(weak.any()) or float(g2.sum()) <= 0.0 or lam <= 0.0:
        return 1.0
    f = 2.0 ** torch.arange(max_doublings + 1, dtype=e.dtype, device=e.device)
    energy = g2 / (e + lam * f[:, None]).square()                       # (doublings, d)
    share = energy[:, weak].sum(1) / energy.sum(1).clamp_min(1e-300)
    ok = (share <= bound).nonzero()
    return float(f[ok[0, 0]]) if ok.numel() else float(f[-1])


def filtered_damping_scale(sigma: Tensor, grads: Tensor, lam: Tensor, bound: float,
                           max_doublings: int = MAX_DOUBLINGS, reduce=None) -> Tensor:
    """``weak_share_estimate="filter"``: :func:`damping_scale` without an eigendecomposition or a host sync, for
    covariances ``sigma`` (B, d, d), gradients ``grads`` (B, r, d; zero rows pad) and floors ``lam`` (B,).

    The indicator [e_i < tau], tau = WEAK_VARIANCE tr(Sigma), becomes phi(e) = tau^2 / (e^2 + tau^2): the soft
    share tau^2 tr(M (Sigma^2 + tau^2 I)^-1 M^T) / ||M||^2 falls monotonically in f, so a bisection over j finds
    the smallest f = 2^j meeting the bound in ceil(log2(max_doublings + 1)) float64 Cholesky factorisations. On
    a spectrum with a gap around tau the two shares agree (to 1e-4 beyond a factor 100). 1 where G, lam or Sigma
    is zero. ``reduce``: sums the (B, 2) energies over ranks. With more rows than d, G becomes the R of its QR
    (||G X|| = ||R X||)."""
    s, g, lam = sigma.double(), grads.double(), lam.to(device=sigma.device, dtype=torch.float64)
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
    tau = WEAK_VARIANCE * s.diagonal(dim1=-2, dim2=-1).sum(-1)                 # (B,)
    usable = (tau > 0) & (lam > 0)
    tau2 = torch.where(usable, tau, torch.ones_like(tau)).square()[:, None, None]
    lk, _ = torch.linalg.cholesky_ex(s @ s + tau2 * eye)                       # Sigma^2 + tau^2 I
    kinv = torch.cholesky_inverse(lk)          # explicit (cond <= 1 + (e_max / tau)^2 <= 1e8): a GEMM per step
    if g.shape[-2] > g.shape[-1]:        # ||G X|| = ||R X|| for G = QR: d right-hand sides instead of r
        g = torch.linalg.qr(g, mode="r").R
    gt = g.transpose(-1, -2)                                                   # M^T = A^-1 G^T
    lo = torch.full_like(lam, -1.0)                                            # not ok (by convention)
    hi = torch.full_like(lam, float(max_doublings))                            # ok, or the largest tried
    for _ in range(max(max_doublings, 1).bit_length()):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        la, info = torch.linalg.cholesky_ex(s + (lam * torch.pow(2.0, mid))[:, None, None] * eye)
        x = torch.cholesky_solve(gt, la)
        weak = (x * (kinv @ x)).sum((-2, -1)) * tau2[:, 0, 0]
        energy = torch.stack([x.square().sum((-2, -1)), weak], -1)
        if reduce is not None:
            energy = reduce(energy)
        share = torch.where(energy[:, 0] > 0, energy[:, 1] / energy[:, 0].clamp_min(1e-300), torch.zeros_like(lam))
        ok = (share <= bound) & (info == 0)                                    # a failed factor: raise lambda
        step = hi - lo > 1
        hi = torch.where(step & ok, mid, hi)
        lo = torch.where(step & ~ok, mid, lo)
    return torch.where(usable, torch.pow(2.0, hi), torch.ones_like(hi))


@dataclass
class Groups:
    """One batch of same-kind, same-size statistics groups, as a rule sees it."""

    keys: tuple            # the group keys (tuples of layer names)
    kind: type             # their statistic kind (dopr.statistics: .kind "dense", "moments", "diagonal", ...)
    items: list            # [(key, statistic, Sigmabar's mean tuple)]
    sigma: Tensor          # the prepared batch (dense: Sigmabar stacked, (B, d, d))
    floor: Tensor          # the trace rule's lambda per group (B,): damping_mode's scale times damping
    finite: Tensor         # per group, whether its Sigmabar is finite (on the device)
    grads: dict            # {layer name: its layer helper}, the layers with a gradient this step
    report: bool = False   # a health report is due: the rule may sync, and says what it chose
    collective: bool = False   # row sharding: the ranks sum their energies, so that all choose the same
    spectra: dict = field(default_factory=dict)   # {key: (spectrum, g2)} the rule computed (the report reuses them)
    chosen: dict = field(default_factory=dict)    # {key: the factor on its floor} for the report

    @cached_property
    def grad_matrices(self) -> dict:
        return {n: h.grad_matrix() for n, h in self.grads.items()}


#: the rules by name (:func:`register_rule`)
RULES: dict = {}


def register_rule(name: str):
    """Class decorator: the rule ``name``, chosen as :func:`rule_name` says."""
    def add(cls):
        cls.name = name
        RULES[name] = cls
        return cls
    return add


def rule_name(options) -> str:
    """The rule DoPrOptions choose: ``damping_rule`` where it is not "trace"; else "trace" without
    ``weak_share_bound``, else ``weak_share_estimate``."""
    if getattr(options, "damping_rule", "trace") != "trace":
        return options.damping_rule
    return "trace" if options.weak_share_bound is None else options.weak_share_estimate


def build(options, state: Optional[dict] = None) -> "DampingRule":
    """The rule `options` choose, with `state` (:meth:`DampingRule.state_dict`'s) loaded where given."""
    rule = RULES[rule_name(options)](options)
    if state is not None:
        rule.load_state_dict(state)
    return rule


def from_pickled(options, state: dict) -> "DampingRule":
    """The rule of a DoPr pickled before this module (its ``__dict__`` held ``_damping_scale`` and ``_counts``)."""
    return build(options, {"damping_scale": state.get("_damping_scale", {}), "counts": state.get("_counts", {})})


def estimates() -> tuple:
    """``weak_share_estimate``'s values: the registered weak-share rules."""
    return tuple(n for n, cls in RULES.items() if issubclass(cls, WeakShareRule))


def rules() -> tuple:
    """``damping_rule``'s values: "trace" and the registered rules chosen by ``damping_rule`` itself."""
    return ("trace",) + tuple(n for n, cls in RULES.items() if n != "trace" and not issubclass(cls, WeakShareRule))


class DampingRule:
    """lambda per group. ``COUNTERS``: what the rule counts (in ``DoPr.stats()``); ``scale``: {group key: the
    factor on its floor} held between choices; ``reads_homogeneous``: the floor needs the homogeneous flags."""

    name = "?"
    COUNTERS: tuple = ()
    reads: tuple = ()   # the per-layer quantities the rule reads (dopr/quantities.py), in each statistic's extras

    def __init__(self, options) -> None:
        self.options = options
        self.reads_homogeneous = options.damping_mode in HOMOGENEOUS_MODES
        self.counts = defaultdict(int)
        self.scale: dict = {}

    def lam(self, groups: Groups) -> Tensor:
        """Each group's lambda (B,), on the device."""
        raise NotImplementedError

    def counters(self) -> dict:
        """The rule's counters (a rule tallying on the device reads them back here)."""
        return dict(self.counts)

    def state_dict(self) -> dict:
        """``damping_scale`` and the counters."""
        return {"damping_scale": {"|".join(k): f for k, f in self.scale.items()}, "counts": self.counters()}

    def load_state_dict(self, state: dict) -> None:
        self.scale = {k if isinstance(k, tuple) else tuple(k.split("|")): f
                      for k, f in state.get("damping_scale", {}).items()}
        self.counts = defaultdict(int, {k: v for k, v in state.get("counts", {}).items() if k in self.COUNTERS})

    def copy(self) -> "DampingRule":
        """A copy whose state changes apart from this one's (on_nonfinite="raise" puts it back)."""
        out = copy.copy(self)
        out.counts, out.scale = defaultdict(int, self.counts), dict(self.scale)
        return out


@register_rule("trace")
class TraceRule(DampingRule):
    """lambda = ``damping_mode``'s scale times ``damping`` (:func:`trace_damping`), the floor itself."""

    def lam(self, groups: Groups) -> Tensor:
        return groups.floor


class WeakShareRule(DampingRule):
    """``weak_share_bound``: the floor raised per dense group by a power of 2 that bounds the weak share."""

    COUNTERS = ("damping_choices", "damping_raises")
    bound = property(lambda self: self.options.weak_share_bound)


@register_rule("spectrum")
class WeakShareBySpectrum(WeakShareRule):
    """On a health report, each finite dense group's factor (:func:`damping_scale`), held until the next; the
    spectra go to the report."""

    def lam(self, groups: Groups) -> Tensor:
        if groups.report:
            self._choose(groups)
            groups.chosen = self.scale
        lam = groups.floor
        if self.scale:
            lam = lam * torch.tensor([self.scale.get(key, 1.0) for key in groups.keys],
                                     dtype=lam.dtype).to(lam.device, non_blocking=True)
        return lam

    def _choose(self, groups: Groups) -> None:
        gm = groups.grad_matrices
        for i, (key, stat, mean) in enumerate(groups.items):
            gs = [gm[n] for n in key if gm.get(n) is not None]
            if stat.kind != "dense" or not bool(groups.finite[i]) or not (gs or groups.collective):
                continue   # finite: agreed by all ranks; a rank holding no rows still joins, with zero energy
            spec = spectrum(mean[0])
            e, p, g2 = direction_energy(mean[0], torch.cat(gs) if gs else mean[0].new_zeros(0, mean[0].shape[-1]), spec)
            if groups.collective:
                torch.distributed.all_reduce(g2)
            self.scale[key] = damping_scale(e, p, g2, groups.floor[i], self.bound)
            self.counts["damping_choices"] += 1
            self.counts["damping_raises"] += int(self.scale[key] > 1.0)
            groups.spectra[key] = (spec, g2)


@register_rule("filter")
class WeakShareByFilter(WeakShareRule):
    """Every refresh, each dense group's factor (:func:`filtered_damping_scale`); 1 for a non-finite member.
    Tallies on the device (read back by :meth:`counters`): no host sync."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.tally: Optional[Tensor] = None   # [choices, raises] since the last read-back

    def lam(self, groups: Groups) -> Tensor:
        if groups.kind.kind != "dense":
            return groups.floor
        f = self._factors(groups)
        if groups.report:
            groups.chosen = {key: float(x) for key, x in zip(groups.keys, f.tolist())}
        return groups.floor * f

    def _factors(self, groups: Groups) -> Tensor:
        sigma, lam, finite, grads = groups.sigma, groups.floor, groups.finite, groups.grads
        blocks = [[g for n in key if (g := grads[n].grad_matrix() if n in grads else None) is not None]
                  for key in groups.keys]
        rows = max((sum(g.shape[0] for g in gs) for gs in blocks), default=0)
        stacked = sigma.new_zeros(len(groups.keys), rows, sigma.shape[-1], dtype=torch.float64)
        for i, gs in enumerate(blocks):
            if gs:
                g = torch.cat(gs) if len(gs) > 1 else gs[0]
                stacked[i, :g.shape[0]] = g

        def reduce(energy):
            torch.distributed.all_reduce(energy)
            return energy

        f = filtered_damping_scale(sigma, stacked, lam, self.bound, reduce=reduce if groups.collective else None)
        f = torch.where(finite, f, torch.ones_like(f)).to(lam.dtype)
        tally = torch.stack([finite.sum(), (finite & (f > 1)).sum()])
        self.tally = tally if self.tally is None else self.tally + tally
        return f

    def counters(self) -> dict:
        if self.tally is not None:
            choices, raises = self.tally.tolist()
            self.counts["damping_choices"] += int(choices)
            self.counts["damping_raises"] += int(raises)
            self.tally = None
        return dict(self.counts)


@register_rule("sample_count")
class SampleCountRule(DampingRule):
    """lambda per dense (or sample-space) group from q = d / N_eff (:func:`dopr.sample_count.sample_count_damping`),
    never below the trace rule's floor. N_eff: the statistic's ``extras["samples"]`` (else its ``count``), times
    :func:`dopr.sample_count.ema_count_factor` under a constant ``precond_ema``; ``scale`` holds each group's EMA
    updates. No host sync."""

    reads = ("samples",)
    #: at q > 1, lambda = tr(Sigma) / (KAPPA N_eff) (the seen directions' mean over KAPPA), not tr / (KAPPA d)
    seen = False

    def lam(self, groups: Groups) -> Tensor:
        if groups.kind.kind not in ("dense", "samples"):
            return groups.floor
        beta = self.options.precond_ema
        beta = 0.0 if callable(beta) else float(beta)
        n, factors = [], []
        for key, stat, _ in groups.items:
            t = self.scale.get(key, 0) + 1 if beta > 0 else 1
            if beta > 0:
                self.scale[key] = t
            factors.append(ema_count_factor(beta, t))
            n.append(float(stat.count) * factors[-1])
        sigma = groups.sigma     # dense: Sigmabar (B, d, d); samples: Xs (B, n, d), Sigma = Xs^T Xs
        trace = (sigma.square().sum((-2, -1)) if groups.kind.kind == "samples"
                 else sigma.diagonal(dim1=-2, dim2=-1).sum(-1))
        n_eff = torch.tensor(n, dtype=trace.dtype).to(trace.device, non_blocking=True)
        samples = [stat.extras.get("samples") for _, stat, _ in groups.items]
        if any(s is not None for s in samples):   # device tensors: stacked, no sync
            n_eff = torch.stack([s.to(trace.dtype) * f if s is not None else n_eff[i]
                                 for i, (s, f) in enumerate(zip(samples, factors))])
        return torch.maximum(groups.floor.to(trace.dtype),
                             sample_count_damping(trace, sigma.shape[-1], n_eff, self.seen))


@register_rule("sample_count_seen")
class SampleCountSeenRule(SampleCountRule):
    """:class:`SampleCountRule` with lambda = tr(Sigma) / (KAPPA N_eff) at q > 1 (``seen``)."""

    seen = True
