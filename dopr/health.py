"""How safely the AP can invert a layer's covariance: a per-layer health report.

The AP multiplies each eigen-direction v_i of Sigma (eigenvalue e_i) by 1 / (e_i + lambda). Where the
damping lambda sits far below most of Sigma's spectrum, the directions the data barely excites are
amplified up to (e_mean + lambda) / lambda times more than a typical one, and the update M can end up
mostly in them. Measured on the digits SiT (tests/test_health.py), whose DoPr-AdamW did not train at
damping 1e-4 tr(Sigma) and did at 1e-3: after 20 steps at 1e-4 the attention layers' inputs have an
effective rank of about 2 of 97 and 79-94% of their M lies in directions carrying under 1e-4 of the
variance; at 1e-3 the worst layer holds 22%. The timestep MLP's first layer (a 256-d sinusoid of t, one
dominant direction) holds about 0% there: adaLN-Zero gives it almost no gradient early on. Layers
with such spectra trained elsewhere with a statistics EMA and clipping (the ChiUNet on Lift), so the
report says where the update goes, not that training will fail.

Computed from Sigmabar (dense statistics only) with one eigendecomposition per group, only on the
refresh steps that ``DoPr(health_every=k)`` asks for: the step stays as fast otherwise.

``DoPr(weak_share_bound=b)`` turns the report into a damping rule (issue 48, direction 3): on those
refreshes each dense layer's damping is raised by the smallest power of 2 (:func:`damping_scale`) that
keeps at most the share b of ||M||^2 in the weak directions, and the scale holds until the next report.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

#: a direction carrying under this share of tr(Sigma) is one "the data barely excites"
WEAK_VARIANCE = 1e-4
#: warn when more than this share of M's squared norm lies in such directions
WEAK_SHARE_WARNING = 0.5


def spectrum(sigma: Tensor) -> tuple:
    """(e, v, p): Sigma's eigenvalues (clamped at 0) and eigenvectors in float64, and the eigenvalues' shares
    of tr(Sigma) (uniform for Sigma = 0). One eigendecomposition, shared by a report and the damping rule."""
    e, v = torch.linalg.eigh(sigma.detach().double())
    e = e.clamp_min(0.0)
    total = float(e.sum())
    return e, v, (e / total if total > 0 else torch.full_like(e, 1.0 / e.numel()))


def layer_health(sigma: Tensor, lam, grad: Optional[Tensor] = None, *, spec: Optional[tuple] = None,
                 g2: Optional[Tensor] = None) -> dict:
    """For Sigmabar (d x d) and its damping `lam`, and optionally the gradient matrix G (rows x d):

    - ``dim``: d; ``effective_rank``: exp of the entropy of the normalised eigenvalues (d for an
      isotropic Sigma, 1 for a single direction);
    - ``below_damping``: eigen-directions with e_i < lambda;
    - ``amplification``: (mean eigenvalue + lambda) / (smallest + lambda), how much more the AP scales
      the least excited direction than a typical one;
    - ``weak_share``: the share of ||M||_F^2, M = G (Sigma + lambda I)^-1, in directions carrying under
      WEAK_VARIANCE of the variance (None without G).

    ``spec``: :func:`spectrum` of `sigma`, when already computed; ``g2``: G's energy per eigen-direction
    (:func:`direction_energy`), in place of G (under row sharding, the ranks' sum)."""
    e, v, p = spectrum(sigma) if spec is None else spec
    lam = float(lam)
    nz = p[p > 0]
    out = {
        "dim": int(e.numel()),
        "effective_rank": round(math.exp(float(-(nz * nz.log()).sum())), 2),
        "below_damping": int((e < lam).sum()),
        "amplification": round((float(e.mean()) + lam) / (float(e.min()) + lam), 2) if lam > 0 or float(e.min()) > 0 else math.inf,
        "weak_share": None,
    }
    if g2 is None and grad is not None:
        g2 = (grad.detach().double() @ v).square().sum(0)
    if g2 is not None:
        energy = g2 / (e + lam).square()                      # ||M v_i||^2 = ||G v_i||^2 / (e_i + lambda)^2
        weak = p < WEAK_VARIANCE
        out["weak_share"] = round(float(energy[weak].sum() / energy.sum().clamp_min(1e-300)), 4)
    return out


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


def in_danger(report: dict) -> bool:
    return report.get("weak_share") is not None and report["weak_share"] > WEAK_SHARE_WARNING


def describe(report: dict) -> str:
    """One line for the coverage table."""
    share = "" if report["weak_share"] is None else f", {100 * report['weak_share']:.0f}% of M in weak directions"
    return (f"effective rank {report['effective_rank']:g}/{report['dim']}, {report['below_damping']} below "
            f"damping, amplification x{report['amplification']:g}{share}")


class HealthReports:
    """The latest report of each statistics group, refreshed on the refresh steps that are multiples
    of `every` (0: never)."""

    def __init__(self, every: int) -> None:
        self.every, self.reports = every, {}

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def record(self, key: tuple, stat, mean: tuple, lam, grads: dict, spec: Optional[tuple] = None,
               g2: Optional[Tensor] = None) -> Optional[str]:
        """Report on group `key` (dense statistics only) from Sigmabar `mean` and the members' raw
        gradients (or their energies per direction, `g2`, with Sigmabar's `spec`trum when the damping rule
        already computed them); returns a warning when the group is in the danger regime."""
        if stat.kind != "dense":
            return None
        gs = [grads[n] for n in key if n in grads]
        report = layer_health(mean[0], lam, torch.cat(gs) if gs and g2 is None else None, spec=spec, g2=g2)
        self.reports["|".join(key)] = report
        if in_danger(report):
            return (f"{'|'.join(key)}: {describe(report)}. Over {100 * WEAK_SHARE_WARNING:.0f}% of the update lies in "
                    f"directions carrying under {WEAK_VARIANCE:g} of the input variance: the regime in which the "
                    "digits SiT did not train at damping 1e-4 (dopr/health.py); consider a larger damping, "
                    "a statistics EMA or leaving this layer to the GP")
        return None

    def describe(self, name: str) -> str:
        """The report line of the group holding layer `name`, or ''."""
        key = next((k for k in self.reports if name in k.split("|")), None)
        return describe(self.reports[key]) if key is not None else ""
