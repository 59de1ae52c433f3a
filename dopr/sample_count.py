"""The sample-count damping rule's arithmetic (issue 67): how many independent rows a layer's Sigma rests on
(N_eff, by Kish's design effect), and lambda from q = d / N_eff by the Marchenko-Pastur lower edge. The rule
is :class:`dopr.damping.SampleCountRule`; the derivation is in docs/library.md ("The sample-count damping rule").
"""
from __future__ import annotations

import torch
from torch import Tensor

from .quantities import register_quantity

#: the amplification of the inverse the rule tolerates in its weakest direction: lambda stays 0 while the MP
#: lower edge (1 - sqrt q)^2 is above 1 / KAPPA (q <= 1/4), and reaches tr(Sigma) / (KAPPA d) at q >= 1
KAPPA = 4.0


def design_effect(x: Tensor) -> Tensor:
    """Rows per independent row of ``x`` (N, T..., d), N samples of T rows each: a 0-d float32 tensor in [1, T]
    (1.0 for a 2-D x), no host sync. Kish's design effect of the mean, 1 + (T - 1) rho = T tr(Cov m) / tr(Cov z)
    with m the per-sample means; it bounds the covariance's own, 1 + (T - 1) rho^2, from above (more damping)."""
    if x.dim() <= 2:
        return torch.ones((), dtype=torch.float32, device=x.device)
    x = x.detach().reshape(x.shape[0], -1, x.shape[-1])
    t = x.shape[1]
    return (t * _mean_share(x, x.mean(1))).clamp(1.0, float(t))


def _mean_share(x: Tensor, means: Tensor) -> Tensor:
    """tr(Cov m) / tr(Cov z) (0-d float32) for the rows z of x and the per-sample means m (N, d); 1 where the rows
    have no spread. No copy of x (a dot product for sum ||z||^2), the small terms in float64: the cancellation in
    sum ||z||^2 / rows - ||mu||^2 loses at most rows eps sum ||z||^2 / rows, so a spread below that is none."""
    if x.dtype not in (torch.float32, torch.float64):
        x, means = x.float(), means.float()
    flat = x.reshape(-1)
    rows = flat.numel() // means.shape[-1]
    m = means.double()
    mu = m.mean(0)
    second = torch.dot(flat, flat).double() / rows
    spread = second - mu.square().sum()
    share = (m - mu).square().sum(-1).mean() / spread.clamp_min(torch.finfo(torch.float64).tiny)
    noise = rows * torch.finfo(x.dtype).eps * second
    return torch.where(spread > noise, share, torch.ones_like(share)).float()


def independent_rows(z: Tensor, n: int) -> Tensor:
    """N_eff of the sample-major rows z (rows, d) of n samples: rows / design_effect (0-d float32); rows itself
    where rows <= n or they do not split evenly into n."""
    rows = z.shape[0]
    if n < 1 or rows <= n or rows % n:
        return torch.full((), float(rows), dtype=torch.float32, device=z.device)
    return rows / design_effect(z.reshape(n, rows // n, z.shape[-1]))


def independent_patches(x: Tensor, rows: int) -> Tensor:
    """N_eff of a convolution's ``rows`` patches from its input x (N, C, *spatial) without unfolding it: the
    patches' traces are, up to the border, k times the pixels', so their design effect is the pixels'."""
    n = x.shape[0]
    if rows <= n or rows % n:
        return torch.full((), float(rows), dtype=torch.float32, device=x.device)
    x = x.detach().reshape(n, x.shape[1], -1)
    t = rows // n
    return rows / (t * _mean_share(x, x.mean(-1))).clamp(1.0, float(t))


def ema_count_factor(beta: float, t: int) -> float:
    """N_eff of a bias-corrected EMA of t batches (rate beta) over one batch's: 1 / sum_k w_k^2 =
    (1 + beta)(1 - beta^t) / ((1 - beta)(1 + beta^t)), towards (1 + beta) / (1 - beta)."""
    if beta <= 0.0 or t <= 1:
        return 1.0
    bt = beta ** t
    return (1.0 + beta) * (1.0 - bt) / ((1.0 - beta) * (1.0 + bt))


def sample_count_damping(trace: Tensor, d: int, n_eff: Tensor, seen: bool = False) -> Tensor:
    """lambda (B,) = tr(Sigma) / d * max(1 / KAPPA - (1 - sqrt(min(q, 1)))^2, d eps), q = d / N_eff (the d eps
    floor keeps a singular Sigma's factor finite). ``seen``: times q at q > 1, tr(Sigma) / (KAPPA N_eff), the
    mean over KAPPA of the N_eff directions the rows span."""
    n_eff = n_eff.to(trace.dtype).clamp_min(1.0)
    q = (d / n_eff).clamp_max(1.0)
    edge = (1.0 - q.sqrt()).square()
    share = (1.0 / KAPPA - edge).clamp_min(d * torch.finfo(trace.dtype).eps)
    lam = trace / d * share
    return lam * (d / n_eff).clamp_min(1.0) if seen else lam


#: convolutions by mode: an unbatched input's dimensions, and whether N_eff is read from its pixels
_CONVOLUTIONS = {"conv1d-full": (2, True), "conv2d-full": (3, True), "conv2d-sua": (3, True),
                 "convtranspose1d-full": (2, False)}


def layer_samples(helper, x: Tensor, rows: int) -> Tensor:
    """N_eff of the `rows` activation rows of layer input x (the quantity ``samples``): x's batch axis holds the
    samples; each row of a 2-D input is one; an unbatched convolution input's rows count as they are."""
    unbatched, pixels = _CONVOLUTIONS.get(helper.mode, (None, False))
    if x.dim() == unbatched:
        return torch.full((), float(rows), dtype=torch.float32, device=x.device)
    if pixels:
        return independent_patches(x, rows)
    return independent_rows(helper.activations(x), x.shape[0] if x.dim() >= 3 else rows)


register_quantity("samples", layer_samples, merge="sum", missing=lambda count: count)
