"""Activation statistics: the sums behind Sigma = mean over samples (and positions) of z z^T, kept with their
sample count so that micro-batches and data-parallel ranks combine by addition; float32 for float32 and
half-precision activations, float64 for float64. One kind per type: :class:`DenseCovariance` (every dense
solver), :class:`Moments` (z and z*z, the rank-1 + diagonal solver) and :class:`Diagonal` (embeddings).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import quantities
from .solvers import DiagonalPlusLowRank, factor_diagonal


class ActivationStatistics:
    """The sums behind one input's Sigma and their sample count; a subclass is one kind of statistic, which
    gathers itself from activations, gives its Sigma's diagonal and factors a batch of its kind."""

    kind = "?"
    symmetric = False  # a dense symmetric matrix: its EMA stores the upper triangle only
    extras: dict = {}  # the per-layer quantities the damping rule reads (dopr/quantities.py), set by the capture

    def __init__(self, sums: tuple, count: float) -> None:
        self.sums, self.count = tuple(sums), float(count)

    def add_(self, other: "ActivationStatistics") -> "ActivationStatistics":
        for a, b in zip(self.sums, other.sums):
            a.add_(b)
        extras = quantities.merged(self.extras, self.count, other.extras, other.count)
        self.count += other.count
        if extras:
            self.extras = extras
        return self

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        """The shapes of ``sums`` for activation vectors of dimension ``dim``."""
        raise NotImplementedError

    def clone(self) -> "ActivationStatistics":
        out = type(self)(tuple(s.clone() for s in self.sums), self.count)
        if self.extras:
            out.extras = dict(self.extras)
        return out

    def mean(self) -> tuple:
        """The normalised statistics: Sigma (dense), (mu, E[z*z]) (moments) or diag(Sigma)."""
        return tuple(s / self.count for s in self.sums)

    def mean_(self) -> tuple:
        """:meth:`mean` in place (statistics used once). The count as a CPU scalar tensor of the sums' dtype: the
        same division as by the float, two ops instead of five."""
        return tuple(s.div_(torch.scalar_tensor(self.count, dtype=s.dtype)) for s in self.sums)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        raise NotImplementedError

    @classmethod
    def prepare(cls, means: list, floor, finite_inputs: bool = True, homogeneous=None) -> tuple:
        """(batch, lam, finite) for a batch of this kind's means: what :meth:`factor` takes, each member's damping
        ``floor(diags, homogeneous)`` (dopr.damping.trace_floor) and whether its Sigma is finite (a finite
        diagonal bounds every entry: O(d) to check). No host sync."""
        diags = torch.stack([cls.diagonal(m) for m in means])
        return means, floor(diags, homogeneous), diags.isfinite().all(-1)

    @classmethod
    def factor(cls, batch, lam: Tensor, factor, counts: dict):
        """Operators M = G (Sigma + lam I)^-1 for a prepared batch, or a dopr.solvers.Deferred of them; `factor`:
        the solver's bound factorisation (dense statistics only); retries and fallbacks are added to `counts`."""
        raise NotImplementedError


def stacked(means) -> Tensor:
    """A batch of one-tensor means (B, ...): as it is if stacked already (stacked_mean), else one stack (a copy;
    a lone mean is the step's own)."""
    if isinstance(means, Tensor):
        return means
    return torch.stack([m[0] for m in means]) if len(means) > 1 else means[0][0].unsqueeze(0)


class DenseCovariance(ActivationStatistics):
    """The (d, d) sum of z z^T: what every dense solver factors (one batched call per size)."""

    kind = "dense"
    symmetric = True

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        return ((dim, dim),)

    @classmethod
    def from_activations(cls, z: Tensor, homogeneous: bool) -> "DenseCovariance":
        """Sum of [z; 1][z; 1]^T, one GEMM of z with a cached column of ones appended (the copy is n * d against
        the GEMM's n * d^2). Half-precision z stays so where the GEMM accumulates it in float32 (:func:`gram`)."""
        n, d = z.shape
        dtype = statistics_dtype(z.dtype)
        if z.dtype != dtype and not _low_precision_gram(z):
            z = z.to(dtype)
        if not homogeneous:
            return cls((gram(z),), n)
        if torch.compiler.is_compiling():   # a traced graph keeps to plain slices
            s = torch.empty(d + 1, d + 1, dtype=dtype, device=z.device)
            gram(z, out=s[:d, :d])
            s[:d, d] = s[d, :d] = z.sum(0, dtype=dtype)
            s[d, d] = n
            return cls((s,), n)
        za = torch.cat([z, ones_column(n, z)], dim=1)   # [z, 1]: its gram is the whole matrix, ones' sums and n included
        return cls((gram(za, zt=_transposed(za)),), n)

    @classmethod
    def from_scaled_activations(cls, z: Tensor, homogeneous: bool, source: torch.dtype,
                                scale: float) -> "DenseCovariance":
        """Sigma of float32 z whose entries are ``scale`` times values of the half-precision dtype ``source`` (peft's
        float32 LoRA adapters on a bf16 base, through a dropout's 1 / (1 - p)). Where the GEMM accumulates ``source``
        in float32, scale^2 b^T b with b = z / scale rounded to ``source`` (exact: it rounds back to the value);
        elsewhere, and with the homogeneous 1, :meth:`from_activations` of z."""
        if homogeneous or z.dtype is not torch.float32 or not _low_precision_gram(z, source):
            return cls.from_activations(z, homogeneous)
        b = torch.div(z, scale, out=torch.empty(z.shape, dtype=source, device=z.device))
        stat = cls.from_activations(b, False)
        if scale != 1:
            stat.sums[0].mul_(scale * scale)
        return stat

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        return mean[0].diagonal()

    @classmethod
    def prepare(cls, means: list, floor, finite_inputs: bool = True, homogeneous=None) -> tuple:
        """:func:`stacked` (the solver may damp it in place) and batched damping. For a solver that needs finite
        input (Solver.finite_inputs) a non-finite member is replaced by I (damping 1)."""
        sigma = stacked(means)
        diag = sigma.diagonal(dim1=-2, dim2=-1)
        finite = diag.isfinite().all(-1)
        lam = floor(diag, homogeneous)
        if finite_inputs and not bool(finite.all()):
            bad = ~finite
            sigma.masked_fill_(bad[:, None, None], 0.0)
            diag.add_(bad[:, None].to(sigma.dtype))
            lam = torch.where(finite, lam, torch.ones_like(lam))
        return sigma, lam, finite

    @staticmethod
    def stacked_mean(stats: list) -> Tensor:
        """The Sigma of each of `stats` stacked (B, d, d): one division by their counts, bit for bit :meth:`mean_`'s
        (a lone member's sums become its mean in place)."""
        sums = torch.stack([s.sums[0] for s in stats]) if len(stats) > 1 else stats[0].sums[0].unsqueeze(0)
        counts = torch.tensor([s.count for s in stats], dtype=sums.dtype).to(sums.device, non_blocking=True)
        return sums.div_(counts[:, None, None])

    @classmethod
    def factor(cls, sigma, lam: Tensor, factor, counts: dict):
        return factor(sigma, lam.to(sigma.dtype), counts)


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
    def factor(cls, means, lam: Tensor, factor, counts: dict) -> list:
        return [DiagonalPlusLowRank.of((m[1] - m[0] * m[0]).clamp(min=0) + x, m[0][None])   # diag(var) + mu mu^T
                for m, x in zip(means, lam.unbind(0))]


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
    def factor(cls, means, lam: Tensor, factor, counts: dict) -> list:
        return [factor_diagonal(m[0], x) for m, x in zip(means, lam.unbind(0))]


#: the statistic kinds by the name a solver gives (dopr.solvers.Solver.statistic)
STATISTICS = {cls.kind: cls for cls in (DenseCovariance, Moments, Diagonal)}


_STATISTICS_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32,
                      torch.float64: torch.float64}


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision activations, float64 stays float64."""
    out = _STATISTICS_DTYPES.get(dtype)
    return out if out is not None else torch.promote_types(dtype, torch.float32)


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


#: devices whose GEMM takes half-precision inputs with a float32 output and accumulator (``out_dtype``): Sigma is
#: formed there from the activations as they are (exact: their products are exact in float32); elsewhere z is
#: upcast. On an H200 (issue 77) 0.27 ms at 65536 x 385 against 0.75 for the upcast's float32 GEMM.
LOW_PRECISION_GRAM_DEVICES = {"cuda"}


def _low_precision_gram(z: Tensor, dtype: torch.dtype = None) -> bool:
    """Whether z's device forms Sigma from half-precision activations (z's own dtype, or ``dtype``) directly."""
    return ((dtype or z.dtype) in (torch.bfloat16, torch.float16) and z.device.type in LOW_PRECISION_GRAM_DEVICES
            and not torch.compiler.is_compiling())


_ONES: dict = {}   # (rows, dtype, device): a column of ones (emptied if it ever holds many)


def ones_column(n: int, like: Tensor) -> Tensor:
    """A cached (n, 1) column of ones like `like`: the homogeneous 1 of n activation rows."""
    key = (n, like.dtype, like.device)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) >= 16:
            _ONES.clear()
        ones = _ONES[key] = torch.ones(n, 1, dtype=like.dtype, device=like.device)
    return ones


def _transposed(z: Tensor) -> Tensor:
    """z^T: one as_strided op for a row-major z (``z.T`` costs three)."""
    n, d = z.shape
    return z.as_strided((d, n), (1, d), z.storage_offset()) if z.stride() == (d, 1) else z.mT


def gram(z: Tensor, blocks: int = 0, out: Tensor = None, zt: Tensor = None) -> Tensor:
    """z^T z for z (n, d): with b > 1 block rows (``blocks=0``: gram_blocks) the blocks on and above the diagonal,
    the rest mirrored; ``out``: a (d, d) view to write into; chunks of GRAM_CHUNK_ROWS rows. Off the CPU:
    :func:`_gram_device`."""
    n, d = z.shape
    if z.device.type != "cpu" or _low_precision_gram(z):
        return _gram_device(z, out)
    if isinstance(n, int) and n > GRAM_CHUNK_ROWS:
        return _gram_chunked(z, blocks or gram_blocks(GRAM_CHUNK_ROWS, d), out)
    b = blocks or gram_blocks(n, d)
    if torch.compiler.is_compiling():  # out= into views breaks dynamo's graph: assemble the blocks
        full = _gram_assembled(z, b)
        return full if out is None else out.copy_(full)
    if b == 1:
        zt = _transposed(z) if zt is None else zt
        return torch.mm(zt, z) if out is None else torch.mm(zt, z, out=out)
    if out is None:
        out = torch.empty(d, d, dtype=z.dtype, device=z.device)
    h = -(-d // b)
    zt = z.T
    for i in range(0, d, h):
        torch.mm(zt[i:i + h], z[:, i:], out=out[i:i + h, i:])
    for i in range(0, d - h, h):
        out[i + h:, i:i + h] = out[i:i + h, i + h:].T
    return out


#: the batched GEMM of _gram_device holds one (d, d) float32 partial per chunk: at most this many floats
DEVICE_GRAM_MAX_PARTIALS = 2**26


def _gram_device(z: Tensor, out: Tensor = None) -> Tensor:
    """z^T z on an accelerator: one GEMM, or for n > GRAM_CHUNK_ROWS one batched GEMM over the full chunks (the
    same roundoff bound) plus one for the remainder."""
    n, d = z.shape
    kw = {"out_dtype": torch.float32} if _low_precision_gram(z) else {}
    c = n // GRAM_CHUNK_ROWS if isinstance(n, int) else 0
    if c == 0 or n == GRAM_CHUNK_ROWS:
        full = torch.mm(z.mT, z, **kw)
    elif c * d * d <= DEVICE_GRAM_MAX_PARTIALS:
        head = z[:c * GRAM_CHUNK_ROWS].reshape(c, GRAM_CHUNK_ROWS, d)
        full = torch.bmm(head.mT, head, **kw).sum(0)
        if n > c * GRAM_CHUNK_ROWS:
            tail = z[c * GRAM_CHUNK_ROWS:]
            full += torch.mm(tail.mT, tail, **kw)
    else:
        chunks = z.split(GRAM_CHUNK_ROWS)
        full = torch.mm(chunks[0].mT, chunks[0], **kw)
        for ch in chunks[1:]:
            full += torch.mm(ch.mT, ch, **kw)
    return full if out is None else out.copy_(full)


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
    """:func:`gram` without ``out=``, concatenated (what a compiled graph can hold)."""
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

