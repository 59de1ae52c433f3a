"""How safely the AP can invert a layer's covariance: a per-layer health report, from Sigmabar (dense statistics)
with one eigendecomposition per group on the refreshes ``DoPr(health_every=k)`` asks for.

The AP scales each eigen-direction of Sigma by 1 / (e_i + lambda): with lambda far below most of the spectrum,
barely excited directions are amplified up to (e_mean + lambda) / lambda times more, and M can end up mostly in
them. On the digits SiT (tests/suite/test_health.py), which did not train at damping 1e-4 tr(Sigma) and did at
1e-3, 79-94% of the attention layers' M lay in directions carrying under 1e-4 of the variance after 20 steps at
1e-4, 22% at most at 1e-3. Such spectra trained elsewhere (the ChiUNet on Lift): the report says where the
update goes, not that training will fail. ``weak_share_bound`` makes it a damping rule (dopr/damping.py).
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
    """(e, v, p): Sigma's eigenvalues (clamped at 0) and eigenvectors in float64, and the eigenvalues' shares of
    tr(Sigma) (uniform for Sigma = 0)."""
    e, v = torch.linalg.eigh(sigma.detach().double())
    e = e.clamp_min(0.0)
    total = float(e.sum())
    return e, v, (e / total if total > 0 else torch.full_like(e, 1.0 / e.numel()))


def layer_health(sigma: Tensor, lam, grad: Optional[Tensor] = None, *, spec: Optional[tuple] = None,
                 g2: Optional[Tensor] = None) -> dict:
    """For Sigmabar (d x d), its damping `lam` and optionally G (rows x d): ``dim``; ``effective_rank`` (exp of the
    normalised eigenvalues' entropy); ``below_damping`` (directions with e_i < lambda); ``amplification``
    ((mean eigenvalue + lambda) / (smallest + lambda)); ``weak_share`` (the share of ||M||_F^2 in directions
    carrying under WEAK_VARIANCE of the variance; None without G). ``spec``: :func:`spectrum` of `sigma`, if
    computed; ``g2``: G's energy per eigen-direction, in place of G."""
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


def describe(report: dict) -> str:
    """One line for the coverage table."""
    share = "" if report["weak_share"] is None else f", {100 * report['weak_share']:.0f}% of M in weak directions"
    fraction = report.get("refresh_fraction")
    refreshed = "" if fraction is None else f", refreshed on {100 * fraction:.0f}% of steps"
    return (f"effective rank {report['effective_rank']:g}/{report['dim']}, {report['below_damping']} below "
            f"damping, amplification x{report['amplification']:g}{share}{refreshed}")


def label(key: tuple) -> str:
    """A statistics group's layers as a warning names them: a model that is itself the layer is `<root>`."""
    return "|".join(name or "<root>" for name in key)


class HealthReports:
    """The latest report of each statistics group, on the refresh steps that are multiples of `every` (0: never)."""

    def __init__(self, every: int) -> None:
        self.every, self.reports = every, {}
        self.fractions = None   # () -> {layer name: share of its steps that refreshed it} (the drift refresh policy)

    def refresh_fraction(self, key) -> Optional[float]:
        """The mean refresh fraction of group `key`'s layers, where the refresh policy counts them."""
        fractions = getattr(self, "fractions", None)
        values = [f for n in key if (f := (fractions() if fractions else {}).get(n)) is not None]
        return round(sum(values) / len(values), 4) if values else None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def snapshot(self) -> dict:   # undo (on_nonfinite="raise"): the reports as before a step that raised
        return {k: dict(v) for k, v in self.reports.items()}

    def restore(self, saved: dict) -> None:
        self.reports = saved

    def record(self, key: tuple, stat, mean: tuple, lam, grads: dict, spec: Optional[tuple] = None,
               g2: Optional[Tensor] = None) -> Optional[str]:
        """Report on group `key` (dense only) from Sigmabar `mean` and the members' raw gradients (or `spec` and
        `g2` from the damping rule); returns a warning in the danger regime."""
        if stat.kind != "dense":
            return None
        gs = [grads[n] for n in key if n in grads]
        report = layer_health(mean[0], lam, torch.cat(gs) if gs and g2 is None else None, spec=spec, g2=g2)
        if (fraction := self.refresh_fraction(key)) is not None:
            report["refresh_fraction"] = fraction
        self.reports["|".join(key)] = report
        if report["weak_share"] is not None and report["weak_share"] > WEAK_SHARE_WARNING:
            return (f"{label(key)}: {describe(report)}. Over {100 * WEAK_SHARE_WARNING:.0f}% of the update lies in "
                    f"directions carrying under {WEAK_VARIANCE:g} of the input variance: the regime in which the "
                    "digits SiT did not train at damping 1e-4 (dopr/health.py); consider a larger damping, "
                    "a statistics EMA or leaving this layer to the GP")
        return None

    def record_batch(self, groups, lam: Tensor) -> list:
        """Reports on a batch's finite groups (a dopr.damping.Groups) at their damping `lam`, with the damping
        rule's ``damping_scale`` where it chose one; returns the warnings."""
        out = []
        for i, (key, stat, mean) in enumerate(groups.items):
            spec, g2 = groups.spectra.get(key, (None, None))
            if bool(groups.finite[i]) and (warning := self.record(key, stat, mean, lam[i], groups.grad_matrices,
                                                                   spec, g2)):
                out.append(warning)
            if key in groups.chosen and "|".join(key) in self.reports:
                self.reports["|".join(key)]["damping_scale"] = groups.chosen[key]
        return out

    def describe(self, name: str) -> str:
        """The report line of the group holding layer `name`, or ''."""
        key = next((k for k in self.reports if name in k.split("|")), None)
        if key is None:
            return ""
        fraction = self.refresh_fraction(key.split("|"))   # now, not at the report's refresh
        return describe({**self.reports[key], **({} if fraction is None else {"refresh_fraction": fraction})})
