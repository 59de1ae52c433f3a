"""A^-1 for a batch of SPD matrices by a blocked Cholesky whose work is GEMMs (issue 61, item 2).

Split A = [[A11, A21^T], [A21, A22]] at h. With A11 = L11 L11^T and its inverse factor L11^-1:

    L21 = A21 L11^-T,    S = A22 - L21 L21^T = L22 L22^T  (the Schur complement, recursed on),
    L^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]],    A^-1 = L^-T L^-1.

Blocks of d <= ``BLOCK`` are factored by ``cholesky_ex`` and inverted by one triangular solve; above, GEMMs: L^-1
costs 4/3 d^3 FLOPs and A^-1 = L^-T L^-1 2 d^3 more, 10x potrf's d^3/3 at GEMM rate. ``info`` is as cholesky_ex's
(the first failing pivot's 1-based column), and the pivots L_ii are returned for the damping checks. No host sync.
"""
from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256


def _split(d: int) -> int:
    """Half of d, rounded down to a multiple of 64 where d allows (GEMM tiles)."""
    h = d // 2
    return h - h % 64 if h >= 128 else h


def inverse_cholesky_factor(a: Tensor, block: int = BLOCK) -> tuple:
    """(L^-1, diag L, info) for a batch (B, d, d) of symmetric A = L L^T; only the lower triangle is read."""
    d = a.shape[-1]
    if d <= block:
        l, info = torch.linalg.cholesky_ex(a)
        eye = torch.eye(d, dtype=a.dtype, device=a.device).expand_as(l)
        return torch.linalg.solve_triangular(l, eye, upper=False), l.diagonal(dim1=-2, dim2=-1), info
    h = _split(d)
    linv11, diag1, info1 = inverse_cholesky_factor(a[..., :h, :h], block)
    l21 = a[..., h:, :h] @ linv11.mT
    linv22, diag2, info2 = inverse_cholesky_factor(torch.baddbmm(a[..., h:, h:], l21, l21.mT, alpha=-1), block)
    linv = torch.zeros_like(a)
    linv[..., :h, :h] = linv11
    linv[..., h:, h:] = linv22
    linv[..., h:, :h] = -(linv22 @ (l21 @ linv11))
    info = torch.where(info1 > 0, info1, torch.where(info2 > 0, info2 + h, info2))
    return linv, torch.cat([diag1, diag2], -1), info


def blocked_inverse(a: Tensor, block: int = BLOCK) -> tuple:
    """(A^-1 = L^-T L^-1, diag L, info) for a batch (B, d, d) of SPD matrices, GEMM-bound (module docstring)."""
    linv, diag, info = inverse_cholesky_factor(a, block)
    return linv.mT @ linv, diag, info
