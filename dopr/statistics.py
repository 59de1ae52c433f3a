"""Activation statistics: the sums behind Sigma = mean over samples (and positions) of z z^T.

Three kinds, chosen by the solver and the layer type:

* ``dense``: the (d, d) sum of z z^T (every dense solver);
* ``moments``: the sums of z and of z*z, all that the rank-1 + diagonal solver needs (O(d));
* ``diagonal``: the diagonal of the sum of z z^T, exact for one-hot inputs (embeddings).

Sums are float32 for float32 and half-precision activations (float64 for float64), and are kept with their sample count so that
micro-batches, checkpoint recomputation and data-parallel ranks combine by plain addition.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ActivationStatistics:
    kind: str
    sums: tuple  # tensors, float32
    count: float

    def add_(self, other: "ActivationStatistics") -> "ActivationStatistics":
        for a, b in zip(self.sums, other.sums):
            a.add_(b)
        self.count += other.count
        return self

    def clone(self) -> "ActivationStatistics":
        return ActivationStatistics(self.kind, tuple(s.clone() for s in self.sums), self.count)

    def mean(self) -> tuple:
        """The normalised statistics: Sigma (dense), (mu, E[z*z]) (moments) or diag(Sigma)."""
        return tuple(s / self.count for s in self.sums)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision activations, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


#: from this width on, z^T z is formed from its upper half-rows and lower-right block (3/4 of the
#: GEMM FLOPs, mirrored): 30% faster than one GEMM at d = 1024 on a 2-core CPU (results/bench)
SYMMETRIC_GRAM_MIN_DIM = 512


def gram(z: Tensor) -> Tensor:
    """z^T z for z of shape (n, d), using its symmetry for wide z."""
    d = z.shape[1]
    if d < SYMMETRIC_GRAM_MIN_DIM:
        return z.T @ z
    h = d // 2
    out = torch.empty(d, d, dtype=z.dtype, device=z.device)
    torch.mm(z[:, :h].T, z, out=out[:h])  # rows 0..h-1, all columns
    out[h:, h:] = z[:, h:].T @ z[:, h:]
    out[h:, :h] = out[:h, h:].T
    return out


def dense_statistics(z: Tensor, homogeneous: bool) -> ActivationStatistics:
    """Sum of [z; 1][z; 1]^T without materialising the column of ones."""
    z = z.to(statistics_dtype(z.dtype))
    n, d = z.shape
    if not homogeneous:
        return ActivationStatistics("dense", (gram(z),), float(n))
    s = torch.empty(d + 1, d + 1, dtype=z.dtype, device=z.device)
    s[:d, :d] = gram(z)
    colsum = z.sum(0)
    s[:d, d] = colsum
    s[d, :d] = colsum
    s[d, d] = n
    return ActivationStatistics("dense", (s,), float(n))


def moment_statistics(z: Tensor, homogeneous: bool) -> ActivationStatistics:
    z = z.to(statistics_dtype(z.dtype))
    n = z.shape[0]
    s1, s2 = z.sum(0), (z * z).sum(0)
    if homogeneous:
        one = torch.full((1,), float(n), dtype=z.dtype, device=z.device)
        s1, s2 = torch.cat([s1, one]), torch.cat([s2, one])
    return ActivationStatistics("moments", (s1, s2), float(n))


def diagonal_statistics(counts: Tensor, n: int, dtype: torch.dtype) -> ActivationStatistics:
    return ActivationStatistics("diagonal", (counts.to(statistics_dtype(dtype)),), float(n))
