"""The sample-count damping rule's arithmetic (issue 67): how many independent rows a layer's Sigma
rests on (N_eff), and lambda from q = d / N_eff by the Marchenko-Pastur lower edge. The rule itself is
:class:`dopr.damping.SampleCountRule` (``damping_rule="sample_count"``); the derivation is in
docs/library.md ("The sample-count damping rule").

* :func:`design_effect`: rows per independent row of a layer input (N, T, ..., d): 1 for one row per
  sample, T for rows constant within a sample, in between for correlated tokens (Kish's design effect of
  the mean, from the traces of the per-sample means' and the rows' covariances: no GEMM, no host sync);
* :func:`independent_rows`, :func:`independent_patches`: a layer's rows over their design effect, N_eff of
  one forward (the capture's statistic's ``samples`` under the rule; a convolution's from its input's pixels);
* :func:`ema_count_factor`: how many batches' worth of rows a bias-corrected EMA of rate beta holds after
  t updates, (1 + beta)(1 - beta^t) / ((1 - beta)(1 + beta^t)), towards (1 + beta) / (1 - beta);
* :func:`sample_count_damping`: lambda = (tr(Sigma) / d) * max(1 / KAPPA - (1 - sqrt(min(q, 1)))^2, d eps).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .quantities import register_quantity

#: the amplification of the inverse the rule tolerates in its weakest direction: lambda stays 0 while the
#: MP lower edge (1 - sqrt q)^2 is above 1 / KAPPA (q <= 1/4), and reaches tr(Sigma) / (KAPPA d) at q >= 1.
#: The rule's one constant, chosen once (not per family).
KAPPA = 4.0


def design_effect(x: Tensor) -> Tensor:
    """Rows per independent row of ``x`` (N, T..., d): N samples, each with T rows (positions, patches) of
    dimension d; a 0-d float32 tensor in [1, T], on x's device (no host sync). 1.0 for a 2-D x (one row per
    sample).

    With rows z_nt = a_n + e_nt (a per-sample part and an independent one), Kish's design effect of the mean
    is 1 + (T - 1) rho, rho = tr(Cov a) / tr(Cov z) (the intra-sample correlation). The centred traces give
    it at once: the per-sample means m_n have tr(Cov m) = tr(Cov a) + tr(Cov e) / T, the rows
    tr(Cov z) = tr(Cov a) + tr(Cov e), so 1 + (T - 1) rho = T tr(Cov m) / tr(Cov z). It bounds the covariance's
    own design effect, 1 + (T - 1) rho^2 per direction, from above (rho^2 <= rho): N_eff errs towards more damping."""
    if x.dim() <= 2:
        return torch.ones((), dtype=torch.float32, device=x.device)
    x = x.detach().reshape(x.shape[0], -1, x.shape[-1])
    t = x.shape[1]
    return (t * _mean_share(x, x.mean(1))).clamp(1.0, float(t))


def _mean_share(x: Tensor, means: Tensor) -> Tensor:
    """tr(Cov m) / tr(Cov z) (0-d float32) for the rows z of x (each entry of x one coordinate of one row) and
    the per-sample means m (N, d); 1 where the rows have no spread. No copy of x: a dot product for
    sum ||z||^2 (the centred square of x took two temporaries of its size, +35% on the capture of a token
    Linear on a 2-core CPU), the small terms in float64. tr(Cov z) = sum ||z||^2 / rows - ||mu||^2 loses to
    cancellation at most the dot product's rounding, rows eps sum ||z||^2 / rows: a spread below that is none."""
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
    """N_eff of the rows z (rows, d) of n samples, sample-major (each sample's rows together, as a layer's
    activations are): rows / design_effect of z as (n, rows / n, d). A 0-d float32 tensor on z's device (no
    host sync); rows itself where each row is a sample (rows <= n) or the rows do not split evenly into n."""
    rows = z.shape[0]
    if n < 1 or rows <= n or rows % n:
        return torch.full((), float(rows), dtype=torch.float32, device=z.device)
    return rows / design_effect(z.reshape(n, rows // n, z.shape[-1]))


def independent_patches(x: Tensor, rows: int) -> Tensor:
    """N_eff of a convolution's ``rows`` patches (L = rows / N per sample) from its batched input x
    (N, C, *spatial), without unfolding it: a patch's coordinates are its pixels at the kernel's k offsets,
    so the patches' tr(Cov z) and tr(Cov m) are, up to the border, k times the pixels' (channel vectors), and
    the patches' design effect is L tr(Cov m) / tr(Cov z) of the pixels, in [1, L]. Exact for one pixel per
    patch (SUA, 1x1 kernels without stride). A 0-d float32 tensor on x's device."""
    n = x.shape[0]
    if rows <= n or rows % n:
        return torch.full((), float(rows), dtype=torch.float32, device=x.device)
    x = x.detach().reshape(n, x.shape[1], -1)
    t = rows // n
    return rows / (t * _mean_share(x, x.mean(-1))).clamp(1.0, float(t))


def ema_count_factor(beta: float, t: int) -> float:
    """N_eff of a bias-corrected EMA of t batch covariances (rate beta, each of N independent rows) over N:
    the EMA's weights w_k = (1 - beta) beta^k / (1 - beta^t), k < t, sum to 1, and its variance is
    sum_k w_k^2 = (1 - beta)(1 + beta^t) / ((1 + beta)(1 - beta^t)) times one batch's; the factor is its
    inverse. 1 at t = 1 or beta = 0, (1 + beta) / (1 - beta) as t grows."""
    if beta <= 0.0 or t <= 1:
        return 1.0
    bt = beta ** t
    return (1.0 + beta) * (1.0 - bt) / ((1.0 - beta) * (1.0 + bt))


def sample_count_damping(trace: Tensor, d: int, n_eff: Tensor, seen: bool = False) -> Tensor:
    """lambda per group (B,) from tr(Sigma) (B,), Sigma's dimension d and N_eff (B,): the mean eigenvalue
    tr(Sigma) / d times max(1 / KAPPA - (1 - sqrt(min(q, 1)))^2, d eps), q = d / N_eff (eps: trace's dtype;
    the d eps floor keeps the Cholesky factor of a singular Sigma finite). At q >= 1 (Sigma rank-deficient,
    the lower edge at 0): tr(Sigma) / (KAPPA d).

    ``seen`` (the rule "sample_count_seen"): at q > 1 times q, i.e. tr(Sigma) / (KAPPA N_eff). There the
    N_eff directions the rows span carry all of tr(Sigma), their mean eigenvalue tr(Sigma) / N_eff (q times
    the mean over d), and the d - N_eff unseen ones none: lambda = (their mean) / KAPPA bounds the unseen
    directions' amplification to KAPPA times the seen ones' mean, as at q = 1 (where both forms agree)."""
    n_eff = n_eff.to(trace.dtype).clamp_min(1.0)
    q = (d / n_eff).clamp_max(1.0)
    edge = (1.0 - q.sqrt()).square()
    share = (1.0 / KAPPA - edge).clamp_min(d * torch.finfo(trace.dtype).eps)
    lam = trace / d * share
    return lam * (d / n_eff).clamp_min(1.0) if seen else lam


#: convolutions by mode: the dimensions of an input without a batch axis (one sample), and whether its
#: patches' count is read from its pixels (:func:`independent_patches`: no unfolded copy)
_CONVOLUTIONS = {"conv1d-full": (2, True), "conv2d-full": (3, True), "conv2d-sua": (3, True),
                 "convtranspose1d-full": (2, False)}


def layer_samples(helper, x: Tensor, rows: int) -> Tensor:
    """N_eff of the `rows` activation rows the layer input x gives (the per-layer quantity ``samples``): x's batch
    axis holds the samples of an (N, T..., d) or (N, C, *spatial) input, each row of a 2-D (N, d) input to a
    Linear is one, and a convolution's unbatched input is one sample (its rows then count as they are)."""
    unbatched, pixels = _CONVOLUTIONS.get(helper.mode, (None, False))
    if x.dim() == unbatched:
        return torch.full((), float(rows), dtype=torch.float32, device=x.device)
    if pixels:
        return independent_patches(x, rows)
    return independent_rows(helper.activations(x), x.shape[0] if x.dim() >= 3 else rows)


#: the sample-count rule's N_eff per layer (``SampleCountRule.reads``): the statistic's ``extras["samples"]``,
#: summed over micro-batches and ranks as ``count`` is, which stands in for a statistic that has none
register_quantity("samples", layer_samples, merge="sum", missing=lambda count: count)
