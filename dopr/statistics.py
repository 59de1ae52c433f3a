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

from . import quantities
from .solvers import factor_diagonal, factor_rank1


class ActivationStatistics:
    """The sums behind one input's Sigma and their sample count. A subclass is one kind of statistic:
    it knows how to gather itself from activation vectors, the diagonal of its Sigma (what the trace
    damping reads), and how to factor a batch of its kind into operators that apply the AP."""

    kind = "?"
    symmetric = False  # a dense symmetric matrix: its EMA stores the upper triangle only
    #: the per-layer quantities the damping rule reads ({name: 0-d device tensor}, dopr/quantities.py), set by
    #: the capture for the names the rule declares (``DampingRule.reads``); a statistic's own dict once set
    extras: dict = {}

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
        """:meth:`mean` in place: the sums become the means (for statistics used once, at a step). The
        count goes in as a CPU scalar tensor of the sums' dtype: the same division as by the float, two
        ops instead of five (a Python scalar is wrapped and converted on every call)."""
        return tuple(s.div_(torch.scalar_tensor(self.count, dtype=s.dtype)) for s in self.sums)

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        raise NotImplementedError

    @classmethod
    def prepare(cls, means: list, floor, finite_inputs: bool = True, homogeneous=None) -> tuple:
        """(batch, lam, finite) for a batch of this kind's means (same shape and device): what
        :meth:`factor` takes, the damping of each member (a (B,) tensor, ``floor(diags, homogeneous)``: the
        trace rule's, dopr.damping.trace_floor, from the stacked diagonals) and whether its Sigma is finite
        (a non-finite activation makes its own diagonal entry non-finite, and a finite diagonal bounds
        every entry: O(d) to check). ``homogeneous``: per member, whether its last coordinate is the
        homogeneous 1 (only damping_mode "trace_activations" reads it). No host sync."""
        diags = torch.stack([cls.diagonal(m) for m in means])
        return means, floor(diags, homogeneous), diags.isfinite().all(-1)

    @classmethod
    def factor(cls, batch, lam: Tensor, factor, counts: dict):
        """Operators M = G (Sigma + lam I)^-1 for a prepared batch, or a dopr.solvers.Deferred of them;
        `factor` is the chosen solver's factorisation with its options bound (dopr.solvers.Solver.bind;
        dense statistics only), retries and fallbacks are added to `counts`."""
        raise NotImplementedError


def added_extras(a: ActivationStatistics, b: ActivationStatistics) -> dict:
    """The per-layer quantities of a + b, each by its merge (dopr.quantities.merged); empty when neither has any."""
    return quantities.merged(a.extras, a.count, b.extras, b.count)


class DenseCovariance(ActivationStatistics):
    """The (d, d) sum of z z^T: what every dense solver factors (one batched call per size)."""

    kind = "dense"
    symmetric = True

    @staticmethod
    def sum_shapes(dim: int) -> tuple:
        return ((dim, dim),)

    @classmethod
    def from_activations(cls, z: Tensor, homogeneous: bool) -> "DenseCovariance":
        """Sum of [z; 1][z; 1]^T, one GEMM of z with a column of ones appended (a cached one per row count:
        this runs per layer per forward, and the copy of z is n * d against the GEMM's n * d^2).
        Half-precision z is not copied to float32 where the GEMM can accumulate it in float32
        (:func:`gram`): exact on the inputs."""
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
        """Sigma of float32 z whose entries are ``scale`` times values of the half-precision dtype ``source``:
        a layer that casts its half-precision input up before multiplying it, through a dropout's 1 / (1 - p)
        (peft's float32 LoRA adapters on a bf16 base, dopr/layers/lora.py). Where the device's GEMM
        accumulates ``source`` in float32 (:func:`gram`), Sigma = scale^2 b^T b is formed from those values,
        b = z / scale rounded to ``source``: exact, since z / scale is within a few units of float32 roundoff of
        a ``source`` value and rounds back to it. The float32 z^T z up to float32 rounding. Elsewhere, and with
        the homogeneous 1 (whose entries are not scaled), :meth:`from_activations` of z."""
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
        """One stack (a copy the solver may damp in place; a lone mean is the step's own) and batched
        damping. For a solver that needs finite input (``finite_inputs``, Solver.finite_inputs: eigh raises) a
        non-finite member is replaced by the identity (damping 1), decided on the host; the optimizer
        leaves that member out after the step's read-back either way."""
        if isinstance(means, Tensor):    # stacked already (stacked_mean)
            sigma = means
        else:
            sigma = torch.stack([m[0] for m in means]) if len(means) > 1 else means[0][0].unsqueeze(0)
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
        """The Sigma of each of `stats` (same size), stacked (B, d, d): one stack and one division by
        their counts held as a tensor, where :meth:`mean_` per member takes two ops each (the same
        division, bit for bit). A lone member's sums become its mean in place, as with mean_."""
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
        return [factor_rank1(m[0], m[1], x) for m, x in zip(means, lam.unbind(0))]


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
    """float32 for half-precision activations, float64 stays float64 (a table: this runs per layer)."""
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


#: devices whose GEMM takes half-precision inputs with a float32 output and accumulator (``out_dtype``):
#: Sigma is formed there from the autocast activations as they are, on the tensor cores, with no
#: float32 copy. Exact on the inputs (their products are exact in float32); elsewhere z is upcast. On an H200
#: (issue 77, benchmarks/bench_gram.py, results/bench/gpu_nvidia_h200_77.md) the bf16 batched GEMM with a float32
#: output was the fastest of three ways (0.27 ms at 65536 x 385 against 0.75 for the float32 GEMM of the upcast),
#: and SiT-S/2 b256's DoPr-AdamW step with the upcast took 217 ms against 128 ms.
LOW_PRECISION_GRAM_DEVICES = {"cuda"}


def _low_precision_gram(z: Tensor, dtype: torch.dtype = None) -> bool:
    """Whether z's device forms Sigma from half-precision activations (z's own dtype, or ``dtype``) directly."""
    return ((dtype or z.dtype) in (torch.bfloat16, torch.float16) and z.device.type in LOW_PRECISION_GRAM_DEVICES
            and not torch.compiler.is_compiling())


#: columns of ones by (rows, dtype, device), appended to a layer's inputs for the homogeneous 1 (few
#: distinct row counts in a run; the cache is emptied if it ever holds many)
_ONES: dict = {}


def ones_column(n: int, like: Tensor) -> Tensor:
    """A cached (n, 1) column of ones like `like` (dtype, device): the homogeneous 1 of n activation rows."""
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
    """z^T z for z of shape (n, d): with b > 1 block rows, the blocks on and above the diagonal (one
    GEMM per block row, (b + 1) / 2b of the FLOPs), the rest mirrored. ``blocks=0``: by gram_blocks.
    ``out``: a (d, d) view to write into (the top-left block of the homogeneous statistics: no copy).
    More than GRAM_CHUNK_ROWS rows are summed chunk by chunk (see there). Off the CPU: one GEMM, or one
    batched GEMM over the chunks (:func:`_gram_device`)."""
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
    """z^T z on an accelerator: the CPU's block rows and chunk loop (tuned for a 2-core CPU) become one
    GEMM, or for n > GRAM_CHUNK_ROWS one batched GEMM over the full chunks (the same roundoff bound:
    each chunk's sum, then c partials) plus one for the remainder. Half-precision z goes in as it is
    where the device accumulates it in float32 (:func:`_low_precision_gram`)."""
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

