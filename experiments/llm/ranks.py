"""Rank measures of a layer's optimizer and model quantities (appendix "Stable Ranks of Optimizer and
Model Quantities", after Davis & Drusvyatskiy 2025, "When do spectral gradient updates help in deep
learning?").

With singular values s_1 >= s_2 >= ... of a matrix A:

- ``stable_rank(A) = ||A||_F^2 / ||A||_2^2 = sum s_i^2 / s_1^2``;
- ``nuclear_rank(A) = ||A||_*^2 / ||A||_F^2 = (sum s_i)^2 / sum s_i^2``, the quantity of a gradient G
  (or of the AP gradient M = G (Sigma + lambda I)^-1) that Davis & Drusvyatskiy compare with the
  stable rank of the layer's activations: a spectral update (Muon) gains where the gradient's nuclear
  rank exceeds it;
- ``activation_stable_rank(Sigma) = tr(Sigma) / ||Sigma||_2``, the stable rank of the activation matrix
  X (d x b) whose second moment is Sigma = X X^T / b, computed from Sigma alone.

All three lie in [1, rank(A)] and equal r for a matrix with r equal nonzero singular values. The paper
plots "the stable rank of the batch activation covariances": ``stable_rank(Sigma)`` is that as printed,
``activation_stable_rank(Sigma)`` the activation matrix's, which Davis & Drusvyatskiy's comparison uses;
a report says which it shows. Computed in float64 on the matrix's device.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _singular_values(a: Tensor) -> Tensor:
    if a.dim() != 2:
        raise ValueError(f"a rank measure needs a matrix, got a tensor of shape {tuple(a.shape)}")
    a = a.detach().to(torch.float64)
    if not torch.isfinite(a).all():
        raise ValueError("a rank measure of a matrix with non-finite entries")
    return torch.linalg.svdvals(a)


def stable_rank(a: Tensor) -> float:
    """||A||_F^2 / ||A||_2^2 (0 for the zero matrix)."""
    s = _singular_values(a)
    top = float(s.max()) if s.numel() else 0.0
    return float((s**2).sum()) / top**2 if top > 0 else 0.0


def nuclear_rank(a: Tensor) -> float:
    """||A||_*^2 / ||A||_F^2 (0 for the zero matrix)."""
    s = _singular_values(a)
    fro2 = float((s**2).sum())
    return float(s.sum()) ** 2 / fro2 if fro2 > 0 else 0.0


def activation_stable_rank(sigma: Tensor) -> float:
    """tr(Sigma) / ||Sigma||_2 for a second-moment matrix Sigma = X X^T / b: the stable rank of X."""
    if sigma.dim() != 2 or sigma.shape[0] != sigma.shape[1]:
        raise ValueError(f"a covariance must be square, got shape {tuple(sigma.shape)}")
    sigma = sigma.detach().to(torch.float64)
    if not torch.isfinite(sigma).all():
        raise ValueError("a rank measure of a matrix with non-finite entries")
    e = torch.linalg.eigvalsh(sigma)
    top = float(e.max())
    return float(e.clamp_min(0).sum()) / top if top > 0 else 0.0
