"""The damping rules: how each statistics group's lambda in (Sigmabar + lambda I)^-1 is chosen.

A rule is a :class:`DampingRule`: one method, :meth:`DampingRule.lam`, gives lambda for each group of a
batch of same-size groups (a (B,) tensor, no host sync where the rule needs none), and the rule keeps
its own state (``state_dict`` / ``load_state_dict``) and counters (``stats()``). DoPr builds one from
its options (:func:`build`) and calls it once per batch in ``dopr.refresh.Refresh.factor``. The rules:

* ``"trace"`` (:class:`TraceRule`): lambda = ``damping_mode``'s scale times ``damping``
  (:func:`trace_damping`; the statistic kind evaluates it batched, in its ``prepare``), as the paper
  writes it;
* ``"spectrum"`` (:class:`WeakShareBySpectrum`, ``weak_share_bound=b``): on each health report, each
  dense group's trace lambda raised by the smallest power of 2 (:func:`damping_scale`) that keeps at most
  the share b of ||M||^2 in the directions carrying under WEAK_VARIANCE of the variance, held until the
  next report (issue 48, direction 3);
* ``"filter"`` (:class:`WeakShareByFilter`, ``weak_share_bound=b, weak_share_estimate="filter"``): the
  same bound from a soft indicator, batched Cholesky solves on every refresh (:func:`filtered_damping_scale`);
* ``"sample_count"`` (:class:`SampleCountRule`, ``damping_rule="sample_count"``): lambda from each dense
  group's q = d / N_eff by the Marchenko-Pastur lower edge (dopr/sample_count.py; issue 67).

A new rule is one class here, registered with :func:`register_rule` under the option value that chooses
it (:func:`rule_name`): a new way to measure the weak share is a new ``weak_share_estimate`` value, which
DoPrOptions accepts once the class is registered; dopr/optimizer.py does not change.
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
    """The trace rule's lambda as a function of a batch of Sigma's diagonals (and the homogeneous flags):
    what a statistic kind's ``prepare`` takes (dopr.statistics.ActivationStatistics.prepare), which thereby
    needs nothing of this module."""
    return functools.partial(trace_damping, gamma, mode)


def trace_damping(gamma: float, mode: str, diag: Tensor, homogeneous=None) -> Tensor:
    """The absolute damping lambda added to Sigma's diagonal (``diag``, or a batch of diagonals on its
    last axis): gamma * tr(Sigma) ("trace"), gamma * tr(Sigma) / d ("trace_per_dim"), gamma ("absolute")
    or gamma * (tr(Sigma) - Sigma_hh) ("trace_activations").

    ``homogeneous`` (a bool, or a bool per member of the batch): the statistic carries the homogeneous
    coordinate, the constant 1 a layer with a bias appends to its input, as its LAST coordinate
    (DenseCovariance.from_activations, Moments.from_activations). Only "trace_activations" reads it: it
    leaves that entry (E[1 * 1] = 1) out of the trace, so lambda is the activations' own scale; without the
    coordinate it is "trace". Why (issue 48): on SiT-S/2's attn.proj inputs the constant 1 dominated
    tr(Sigma), so "trace" set lambda by the 1, not by the activations.

    What Prop. PrecondInvariance requires of the bias coordinate: the proposition is for the undamped
    Sigma^-1. With homogeneous coordinates an affine input map z -> Q z + c is the linear map
    A = [[Q, c], [0, 1]] of [z; 1]: A must keep the last coordinate (the constant stays 1), and the
    proof then goes through unchanged (A Sigma A^T, G A^T), shifts included. Any damping D changes the
    update by (A Sigma A^T + D')^-1 versus A^-T (Sigma + D)^-1 A^-1: invariant exactly when D' = A D A^T.
    With D = lambda I that holds only for orthogonal Q, c = 0 (then both traces are unchanged), for
    "trace" and "trace_activations" alike: neither restores the full invariance, only lambda = 0 (or the
    "span" solver, dopr/solvers.py, where its cap and floor do not bind) does. What "trace_activations" keeps and "trace" does not is the scale
    part: under z -> a z (A = diag(a I, 1)) its lambda scales as a^2, like the activation block's
    eigenvalues: A^-1 (A Sigma A^T + a^2 lambda I) A^-T = Sigma + diag(lambda I, a^2 lambda), so the
    scaled model's update is the unscaled one's except that the bias coordinate is damped by a^2 lambda
    instead of lambda (against its unscaled E[1 * 1] = 1). Under
    "trace", lambda = gamma (a^2 tr(Sigma_zz) + 1): for small activations it is set by the 1 and the
    activations' shrinkage depends on their scale. (Exact invariance under scaled rotations would need a
    block damping diag(gamma tr(Sigma_zz) I, gamma Sigma_hh): D' = A D A^T; not built.)"""
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


#: how far damping_scale may raise lambda: 2^20 ~ 1e6 (from gamma = 1e-6 * tr(Sigma) up to tr(Sigma))
MAX_DOUBLINGS = 20


def direction_energy(sigma: Tensor, grad: Tensor, spec: Optional[tuple] = None) -> tuple:
    """(e, p, g2): Sigma's eigenvalues (clamped at 0, float64), their shares of tr(Sigma), and the energy of
    G along each eigen-direction, ||G v_i||^2 (a sum over G's rows: under row sharding the ranks' g2 add).
    ``spec``: :func:`spectrum` of `sigma`, when already computed."""
    e, v, p = spectrum(sigma) if spec is None else spec
    return e, p, (grad.detach().double() @ v).square().sum(0)


def damping_scale(e: Tensor, p: Tensor, g2: Tensor, lam, bound: float, max_doublings: int = MAX_DOUBLINGS) -> float:
    """The smallest f = 2^j, j = 0..max_doublings, for which M = G (Sigma + f lam I)^-1 keeps at most the share
    ``bound`` of ||M||_F^2 in directions carrying under WEAK_VARIANCE of the variance (e, p, g2: see
    :func:`direction_energy`). The share falls as f grows, towards G's own share in those directions; where
    even 2^max_doublings does not bring it under the bound, that largest f. 1.0 when nothing is weak or G is 0."""
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
    """``weak_share_estimate="filter"``: :func:`damping_scale` without an eigendecomposition or a host sync,
    for a batch of B same-size covariances ``sigma`` (B, d, d), the members' gradients ``grads`` (B, r, d),
    zero rows padding the shorter ones, and their floors ``lam`` (B,). Returns the factors (B,) on the device.

    The weak share's indicator [e_i < tau], tau = WEAK_VARIANCE tr(Sigma), is replaced by the rational filter
    phi(e) = tau^2 / (e^2 + tau^2) (1/2 at tau, as the step is halfway there): the soft share of f is
    tau^2 tr(M (Sigma^2 + tau^2 I)^-1 M^T) / ||M||^2 with M = G (Sigma + f lam I)^-1, i.e.
    sum_i g2_i w_i phi_i / sum_i g2_i w_i, w_i = (e_i + f lam)^-2. Raising f moves the weights w towards the
    larger e_i, where phi is smaller, so the soft share falls monotonically in f and a bisection over
    j = 0..max_doublings finds the smallest f = 2^j meeting the bound in ceil(log2(max_doublings + 1))
    batched Cholesky factorisations (float64), plus one of Sigma^2 + tau^2 I. On a spectrum with a gap around
    tau the two shares agree: a direction at e <= tau/100 counts at least 1/(1 + 1e-4) of its energy, one at
    e >= 100 tau at most 1e-4. Where even 2^max_doublings misses the bound, that factor; 1 where G, lam or
    Sigma is zero. ``reduce``: sums the (B, 2) energies over ranks (row sharding), so that every rank chooses
    the same. With more rows than d, G is replaced by the R of its QR factorisation (every norm ||G X|| is
    ||R X||), so each solve has d right-hand sides, not r."""
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
    """One batch of same-kind, same-size statistics groups, as a rule sees it in ``dopr.refresh.Refresh.factor``."""

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
    """The rule of a DoPr copied or pickled before this module: its ``__dict__`` held the held factors
    (``_damping_scale``, {group key tuple: factor}) and the counters among its own (``_counts``)."""
    return build(options, {"damping_scale": state.get("_damping_scale", {}), "counts": state.get("_counts", {})})


def estimates() -> tuple:
    """``weak_share_estimate``'s values: the registered weak-share rules."""
    return tuple(n for n, cls in RULES.items() if issubclass(cls, WeakShareRule))


def rules() -> tuple:
    """``damping_rule``'s values: "trace" and the registered rules chosen by ``damping_rule`` itself."""
    return ("trace",) + tuple(n for n, cls in RULES.items() if n != "trace" and not issubclass(cls, WeakShareRule))


class DampingRule:
    """lambda per group. ``COUNTERS``: what the rule counts (in ``DoPr.stats()`` and the checkpoint's
    counts); ``scale``: {group key: the factor on its floor} held between choices (the checkpoint's
    ``damping_scale``); ``reads_homogeneous``: the floor's mode needs each group's homogeneous flags."""

    name = "?"
    COUNTERS: tuple = ()
    #: the per-layer quantities the rule reads (dopr/quantities.py): the capture computes them into each
    #: statistic's ``extras``, merged and all-reduced with its sums
    reads: tuple = ()

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
        """``damping_scale`` and the counters, as the AP's state dict has held them."""
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
    """``weak_share_bound``: the floor raised per dense group by a power of 2 that bounds the weak share;
    counts the choices and those that raised lambda (did the bound ever bind: raises / choices)."""

    COUNTERS = ("damping_choices", "damping_raises")

    def __init__(self, options) -> None:
        super().__init__(options)
        self.bound = options.weak_share_bound


@register_rule("spectrum")
class WeakShareBySpectrum(WeakShareRule):
    """On a health report, each finite dense group's factor (:func:`damping_scale`) from Sigmabar's
    eigen-directions and the members' raw gradients (under row sharding the ranks' energies per
    direction are summed: every rank chooses the same factor), held until the next report. The
    spectra go to the report, which then needs no eigendecomposition of its own."""

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
    """Every refresh, each dense group's factor (:func:`filtered_damping_scale`) from the stacked
    Sigmabar and the members' raw gradients, zero rows padding each group to the longest; 1 for a
    non-finite member. Under row sharding the ranks' energies are summed. Tallies choices and raises on
    the device (read back by :meth:`counters`): no host sync."""

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
    """lambda per dense group from q = d / N_eff (:func:`dopr.sample_count.sample_count_damping`), never below
    the trace rule's floor (``damping``; 0 for the rule alone). N_eff: the statistic's ``extras["samples"]``, which the
    capture sets for this rule (``reads``; its rows over :func:`dopr.sample_count.design_effect`, a
    device tensor summed as ``count`` is), else its ``count``: its rows, summed over micro-batches and
    data-parallel ranks as Sigma's sums are (the same on every rank), each row a sample; times
    :func:`dopr.sample_count.ema_count_factor` under a constant ``precond_ema`` (a scheduled rate counts one
    batch). ``scale`` holds, per group, the EMA updates its
    Sigmabar has had (the checkpoint's ``damping_scale``). Dense groups and those solved in sample space (the
    same lambda, from tr(Sigma) = ||Xs||^2); other statistic kinds: the floor. One (B,) tensor
    built from host floats, the ``samples`` tensors and a batched trace: no eigendecomposition, no host sync."""

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
    """:class:`SampleCountRule` with the lift at q > 1 scaled to the directions the rows span: lambda =
    tr(Sigma) / (KAPPA N_eff) there (:func:`dopr.sample_count.sample_count_damping`'s ``seen``), the same
    below q = 1. A layer that sees few samples for its width (SiT's timestep and adaLN inputs, q ~ 1.5-4)
    is damped towards its GP as q grows."""

    seen = True
