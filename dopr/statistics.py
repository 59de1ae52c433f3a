"""Activation statistics: the sums behind Sigma = mean over samples (and positions) of z z^T.

Three kinds, one type each, chosen by the solver and the layer type; each knows its diagonal (for
the trace damping) and how to factor itself:

* :class:`DenseCovariance`: the (d, d) sum of z z^T (every dense solver);
* :class:`Moments`: the sums of z and of z*z, all that the rank-1 + diagonal solver needs (O(d));
* :class:`Diagonal`: the diagonal of the sum of z z^T, exact for one-hot inputs (embeddings).

Sums are float32 for float32 and half-precision activations (float64 for float64), and are kept with their sample count so that
micro-batches, checkpoint recomputation and data-parallel ranks combine by plain addition.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .solvers import factor_diagonal, factor_rank1


class ActivationStatistics:
    """The sums behind one input's Sigma and their sample count. A subclass is one kind of statistic:
    it knows how to gather itself from activation vectors, the diagonal of its Sigma (what the trace
    damping reads), and how to factor a batch of its kind into operators that apply the AP."""

    kind = "?"
    symmetric = False  # a dense symmetric matrix: its EMA stores the upper triangle only

    def __init__(self, sums: tuple, count: float) -> None:
        self.sums, self.count = tuple(sums), float(count)

    def add_(self, other: "ActivationStatistics") -> "ActivationStatistics":
        for a, b in zip(self.sums, other.sums):
            a.add_(b)
        self.count += other.count
        return self

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        """The shapes of ``sums`` for activation vectors of dimension ``dim``."""
        raise NotImplementedError

    def clone(self) -> "ActivationStatistics":
        return type(self)(tuple(s.clone() for s in self.sums), self.count)

    def mean(self) -> tuple:
        """The normalised statistics: Sigma (dense), (mu, E[z*z]) (moments) or diag(Sigma)."""
        return tuple(s / self.count for s in self.sums)

    def mean_(self) -> tuple:
        """:meth:`mean` in place: the sums become the means (for statistics used once, at a step)."""
        return tuple(s.div_(self.count) for s in self.sums)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        raise NotImplementedError

    @classmethod
    def factor(cls, means: list, lams: list, solver, options: dict, counts: dict) -> list:
        """Operators M = G (Sigma + lam I)^-1 for a batch of this kind's means (same shape and device);
        `solver` is the dopr.solvers.Solver chosen, retries and fallbacks are added to `counts`."""
        raise NotImplementedError


class DenseCovariance(ActivationStatistics):
    """The (d, d) sum of z z^T: what every dense solver factors (one batched call per size)."""

    kind = "dense"
    symmetric = True

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        return ((dim, dim),)

    @classmethod
    def from_activations(cls, z: Tensor, homogeneous: bool) -> "DenseCovariance":
        """Sum of [z; 1][z; 1]^T without materialising the column of ones."""
        z = z.to(statistics_dtype(z.dtype))
        n, d = z.shape
        if not homogeneous:
            return cls((gram(z),), n)
        s = torch.empty(d + 1, d + 1, dtype=z.dtype, device=z.device)
        gram(z, out=s[:d, :d])
        colsum = z.sum(0)
        s[:d, d] = colsum
        s[d, :d] = colsum
        s[d, d] = n
        return cls((s,), n)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        return mean[0].diagonal()

    @classmethod
    def factor(cls, means: list, lams: list, solver, options: dict, counts: dict) -> list:
        # the solver may damp the batch in place: a stack is a copy, a lone mean is the step's own
        sigma = torch.stack([m[0] for m in means]) if len(means) > 1 else means[0][0].unsqueeze(0)
        lam = torch.stack([lam.reshape(()) for lam in lams]).to(sigma.dtype)
        return solver.factor(sigma, lam, options, counts)


class Moments(ActivationStatistics):
    """The sums of z and of z*z: all that the rank-1 + diagonal solver needs (O(d))."""

    kind = "moments"

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        return ((dim,), (dim,))

    @classmethod
    def from_activations(cls, z: Tensor, homogeneous: bool) -> "Moments":
        z = z.to(statistics_dtype(z.dtype))
        n = z.shape[0]
        s1, s2 = z.sum(0), (z * z).sum(0)
        if homogeneous:
            one = torch.full((1,), float(n), dtype=z.dtype, device=z.device)
            s1, s2 = torch.cat([s1, one]), torch.cat([s2, one])
        return cls((s1, s2), n)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        return mean[1]

    @classmethod
    def factor(cls, means: list, lams: list, solver, options: dict, counts: dict) -> list:
        return [factor_rank1(m[0], m[1], lam) for m, lam in zip(means, lams)]


class Diagonal(ActivationStatistics):
    """The diagonal of the sum of z z^T, exact for one-hot inputs (embeddings: token counts)."""

    kind = "diagonal"

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        return ((dim,),)

    @classmethod
    def from_counts(cls, counts: Tensor, n: int, dtype: torch.dtype) -> "Diagonal":
        return cls((counts.to(statistics_dtype(dtype)),), n)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        return mean[0]

    @classmethod
    def factor(cls, means: list, lams: list, solver, options: dict, counts: dict) -> list:
        return [factor_diagonal(m[0], lam) for m, lam in zip(means, lams)]


#: the statistic kinds by the name a solver gives (dopr.solvers.Solver.statistic)
STATISTICS = {cls.kind: cls for cls in (DenseCovariance, Moments, Diagonal)}


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision activations, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


#: z^T z is formed block row by block row above the diagonal and mirrored (a symmetric rank-n update
#: from GEMMs) once it has this much work, n * d^2: 17% faster than one GEMM at n = 4096, d = 257 and
#: 26% at d = 1025 on a 2-core CPU; below it (a 256-sample batch) the single GEMM is faster.
SYMMETRIC_GRAM_MIN_WORK = 2**26


def gram_blocks(n: int, d: int) -> int:
    """Block rows of the symmetric gram: 1 (one GEMM), 2 (3/4 of its FLOPs) or 4 (5/8)."""
    if n * d * d < SYMMETRIC_GRAM_MIN_WORK or d < 128:
        return 1
    return 4 if d >= 768 else 2


#: rows one GEMM sums. A BLAS may accumulate a long inner dimension in float32 with a few running sums,
#: an error growing like n units of roundoff: z^T z over the 369664 RGB pixels of a robomimic batch
#: (SUA's 3 x 3 covariance) came out 1e-3 off, relative, with a negative eigenvalue ten times the
#: damping. Chunks of this many rows, their grams summed, bound it by (chunk + n / chunk) units.
GRAM_CHUNK_ROWS = 4096


def gram(z: Tensor, blocks: int = 0, out: Tensor = None) -> Tensor:
    """z^T z for z of shape (n, d): with b > 1 block rows, the blocks on and above the diagonal (one
    GEMM per block row, (b + 1) / 2b of the FLOPs), the rest mirrored. ``blocks=0``: by gram_blocks.
    ``out``: a (d, d) view to write into (the top-left block of the homogeneous statistics: no copy).
    More than GRAM_CHUNK_ROWS rows are summed chunk by chunk (see there)."""
    n, d = z.shape
    if isinstance(n, int) and n > GRAM_CHUNK_ROWS:
        return _gram_chunked(z, blocks or gram_blocks(GRAM_CHUNK_ROWS, d), out)
    b = blocks or gram_blocks(n, d)
    if torch.compiler.is_compiling():  # out= into views breaks dynamo's graph: assemble the blocks
        full = _gram_assembled(z, b)
        return full if out is None else out.copy_(full)
    if out is None:
        out = torch.empty(d, d, dtype=z.dtype, device=z.device)
    if b == 1:
        return torch.mm(z.T, z, out=out)
    h = -(-d // b)
    zt = z.T
    for i in range(0, d, h):
        torch.mm(zt[i:i + h], z[:, i:], out=out[i:i + h, i:])
    for i in range(0, d - h, h):
        out[i + h:, i:i + h] = out[i:i + h, i + h:].T
    return out


def _gram_chunked(z: Tensor, b: int, out: Tensor = None) -> Tensor:
    chunks = z.split(GRAM_CHUNK_ROWS)
    if torch.compiler.is_compiling():
        full = sum(_gram_assembled(c, b) for c in chunks)
        return full if out is None else out.copy_(full)
    out = gram(chunks[0], b, out=out)
    part = torch.empty_like(out)
    for c in chunks[1:]:
        out.add_(gram(c, b, out=part))
    return out


def _gram_assembled(z: Tensor, b: int) -> Tensor:
    """:func:`gram` without ``out=``: the block rows on and above the diagonal, the rest their
    transposes, concatenated (what a compiled graph can hold)."""
    d = z.shape[1]
    if b == 1:
        return z.T @ z
    h = -(-d // b)
    starts = list(range(0, d, h))
    upper = [z[:, i:i + h].T @ z[:, i:] for i in starts]   # block row i: columns i..d-1
    rows = []
    for bi, i in enumerate(starts):
        hi = upper[bi].shape[0]
        left = [upper[bj][:, i - j:i - j + hi].T for bj, j in enumerate(starts[:bi])]
        rows.append(torch.cat(left + [upper[bi]], dim=1))
    return torch.cat(rows, dim=0)


def dense_statistics(z: Tensor, homogeneous: bool) -> DenseCovariance:
    return DenseCovariance.from_activations(z, homogeneous)


def moment_statistics(z: Tensor, homogeneous: bool) -> Moments:
    return Moments.from_activations(z, homogeneous)


def diagonal_statistics(counts: Tensor, n: int, dtype: torch.dtype) -> Diagonal:
    return Diagonal.from_counts(counts, n, dtype)
