"""The AP in sample space, for layers that see fewer activation rows in a step than their dimension.

With this step's rows X (n x d, the homogeneous 1 column included for a layer with a bias) and no
statistics EMA, Sigma = X^T X / n. Write Xs = X / sqrt(n), so Sigma = Xs^T Xs, and K = Xs Xs^T (n x n).
Woodbury gives, for lam > 0,

    M = G (Sigma + lam I)^-1 = (1/lam) (G - (G Xs^T) (K + lam I)^-1 Xs)

at n^2 d + n^3/3 + rows (2 n d + n^2) instead of n d^2 + d^3/3 + 2 rows d^2: smaller for n < d. Xs, K, its
factor and the apply run in float64, M in G's dtype: the subtraction is lam M, so it cancels all but
~lam / (e + lam) of G along each eigen-direction and costs ~eps cond(Sigma + lam I) of M's digits; in float32
that was 57-1000x the feature-space error on badly scaled inputs (issue 73). Which groups (``solve_space``,
dopr/solve_space.py) and the costs: docs/library.md. The capture keeps a forward's rows while they are fewer
than d (:class:`RowsOrCovariance`), micro-batches append, and rows that reach d become Sigma's sums. Under
data parallelism :func:`gather_rows` all-gathers every rank's rows.

Trouble (flagged on the device with the other trouble flags): a factor of K + lam I that failed or lost lam
to rounding, an apply whose cancellation would cost more than APPLY_LOSS of M (eps64 tr(K) / lam bounds
eps64 cond(Sigma + lam I)), lam <= 0, and for rows forced there (:class:`ForcedRows`) a K + lam I whose pivots
spread over more than n + d (issue 73, N5: the apply's rounding is the feature space's times cond(K + lam I),
which nearly collinear rows, or n >= d, make large). Those are solved in feature space from Sigma = Xs^T Xs (float64).
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import solvers
from .distributed import is_distributed
from .statistics import ActivationStatistics, DenseCovariance, gram, ones_column, stacked, statistics_dtype

#: the precision of the solve: Xs, K, its Cholesky factor and the apply (module docstring)
SAMPLE_SPACE_DTYPE = torch.float64
#: the share of M's digits the apply's cancellation may cost (bound: eps64 * tr(K) / lam) before the solve
#: is trouble: solved in feature space, counted in sample_space_fallbacks (1e-2: lam down to ~2e-14 tr(Sigma))
APPLY_LOSS = 1e-2


class SampleRows(ActivationStatistics):
    """The activation rows (n, d) in the statistics dtype, the homogeneous 1 appended. ``auto``: they become
    Sigma's sums (:meth:`to_dense`) once they reach d."""

    kind = "samples"

    def __init__(self, sums: tuple, count: float, auto: bool = True) -> None:
        super().__init__(sums, count)
        self.auto = auto

    @property
    def rows(self) -> Tensor:
        return self.sums[0]

    @classmethod
    def from_activations(cls, z: Tensor, homogeneous: bool, auto: bool = False) -> "SampleRows":
        """A copy of z in the statistics dtype (the model's activations are not kept), [z, 1] with a bias."""
        n = z.shape[0]
        dtype = statistics_dtype(z.dtype)
        if not homogeneous:
            return cls((z.to(dtype, copy=True),), n, auto)
        z = z if z.dtype == dtype else z.to(dtype)
        return cls((torch.cat([z, ones_column(n, z)], dim=1),), n, auto)   # one op (per layer, per forward)

    def clone(self) -> "SampleRows":
        return type(self)(self.sums, self.count, self.auto)   # the rows are never changed in place

    def to_dense(self) -> DenseCovariance:
        return DenseCovariance((gram(self.rows),), self.count)

    def full(self) -> bool:
        """Whether the rows reached d under "auto"."""
        return self.auto and self.rows.shape[0] >= self.rows.shape[1]

    def mean(self) -> tuple:
        """(Xs,) = X / sqrt(n) in SAMPLE_SPACE_DTYPE (float32 rounding would move the rows' span), a new tensor."""
        scale = torch.scalar_tensor(self.count ** -0.5, dtype=SAMPLE_SPACE_DTYPE)
        return (torch.mul(self.rows.to(SAMPLE_SPACE_DTYPE), scale),)

    mean_ = mean

    @staticmethod
    def stacked_mean(stats: list) -> Tensor:
        """The Xs of each of `stats` stacked (B, n, d): bit for bit :meth:`mean`'s, in one product (on a copy)."""
        rows = torch.stack([s.rows for s in stats]).to(SAMPLE_SPACE_DTYPE)
        scale = torch.tensor([s.count ** -0.5 for s in stats], dtype=rows.dtype).to(rows.device, non_blocking=True)
        return rows.mul_(scale[:, None, None])

    @staticmethod
    def diagonal(mean: tuple) -> Tensor:
        return mean[0].square().sum(-2)

    @classmethod
    def prepare(cls, means: list, floor, finite_inputs: bool = True, homogeneous=None) -> tuple:
        xs = stacked(means)
        diag = cls.diagonal((xs,))
        return xs, floor(diag, homogeneous), diag.isfinite().all(-1)

    @classmethod
    def factor(cls, xs: Tensor, lam: Tensor, factor, counts: dict) -> "SampleSpaceBatch":
        counts["sample_space_solves"] += len(xs)
        return SampleSpaceBatch(xs, lam.to(xs.dtype), factor, cls is ForcedRows)


class ForcedRows(SampleRows):
    """solve_space "samples": rows that did not choose the sample space; :class:`SampleSpaceBatch` gives back to
    feature space those it would solve less accurately (issue 73, N5)."""


class RowsOrCovariance:
    """solve_space "auto": a forward's rows when they are fewer than d, else Sigma's sums."""

    @staticmethod
    def from_activations(z: Tensor, homogeneous: bool) -> ActivationStatistics:
        if z.shape[0] < z.shape[1] + int(homogeneous):
            return SampleRows.from_activations(z, homogeneous, auto=True)
        return DenseCovariance.from_activations(z, homogeneous)


class AlwaysRows:
    """solve_space "samples": the rows, whatever their number."""

    @staticmethod
    def from_activations(z: Tensor, homogeneous: bool) -> SampleRows:
        return ForcedRows.from_activations(z, homogeneous, auto=False)


def sample_space_blocker(options) -> Optional[str]:
    """None when the sample-space solve can run under `options`, else why not."""
    if options.solver != "cholesky":
        return f"solver={options.solver!r} factors Sigma itself, sample space needs 'cholesky'"
    if callable(options.precond_ema) or options.precond_ema != 0:
        return "precond_ema keeps an EMA of Sigma itself"
    if options.health_every or options.weak_share_bound is not None:
        return "health_every and weak_share_bound read Sigma's spectrum"
    if not callable(options.damping) and options.damping == 0:
        return "damping 0: the Woodbury identity needs lambda > 0"
    return None


def row_statistic(options) -> Optional[type]:
    """What the capture gathers for dense layers instead of DenseCovariance: None (feature space),
    :class:`RowsOrCovariance` ("auto", where allowed) or :class:`AlwaysRows` ("samples")."""
    if options.solve_space == "samples":
        return AlwaysRows
    if options.solve_space == "features" or sample_space_blocker(options) is not None:
        return None
    return RowsOrCovariance


def accumulate(a: ActivationStatistics, b: ActivationStatistics) -> ActivationStatistics:
    """a + b for micro-batch accumulation (a may be changed): rows append (sums once full); rows meeting sums
    become sums."""
    rows_a, rows_b = isinstance(a, SampleRows), isinstance(b, SampleRows)
    if rows_a and rows_b:
        out = type(a)((torch.cat([a.rows, b.rows]),), a.count + b.count, a.auto and b.auto)
        return out.to_dense() if out.full() else out
    if rows_a or rows_b:
        return (a.to_dense() if rows_a else a).add_(b.to_dense() if rows_b else b)
    return a.add_(b)


# ------------------------------------------------------------------------------ the solve
class SampleSpaceBatch(solvers.Deferred):
    """The float64 Cholesky factors of K + lam I = Xs Xs^T + lam I for a batch; :meth:`finish` solves the
    trouble (module docstring) in feature space, counted in sample_space_fallbacks."""

    COUNTER = "sample_space_fallbacks"

    def __init__(self, xs: Tensor, lam: Tensor, factor, forced: bool = False) -> None:
        self.xs, self.lam, self.factor = xs, lam, factor
        x = xs.to(SAMPLE_SPACE_DTYPE)
        k = torch.matmul(x, x.mT)
        lam64 = lam.to(SAMPLE_SPACE_DTYPE)
        lossy = torch.finfo(k.dtype).eps * k.diagonal(dim1=-2, dim2=-1).sum(-1) > APPLY_LOSS * lam64
        k.diagonal(dim1=-2, dim2=-1).add_(lam64[:, None])
        l, info = torch.linalg.cholesky_ex(k)
        pivots = l.diagonal(dim1=-2, dim2=-1)
        ill = forced & (pivots.amax(-1) ** 2 > sum(xs.shape[-2:]) * pivots.amin(-1) ** 2)   # cond(K + lam I) > n + d
        self.trouble = (info > 0) | (lam <= 0) | lossy | ill | solvers.unreliable(pivots, lam64)
        self.whole = (xs, l, lam)    # what the operators share: a batch applies in one call

    def ops(self) -> list:
        return [SampleSpaceInverse(whole=self.whole, index=i) for i in range(len(self.xs))]

    def fallback(self, idx: Tensor, counts: dict) -> list:
        x = self.xs[idx]
        res = self.factor(torch.matmul(x.mT, x), self.lam[idx], counts)     # Sigma, the feature-space solver (float64)
        return res.finish(counts) if isinstance(res, solvers.Deferred) else res


class SampleSpaceInverse:
    """M = (1/lam) (G - (G Xs^T) (K + lam I)^-1 Xs) with K + lam I = L L^T, in float64, M in G's dtype."""

    OWN_DTYPE = ("x", "l")   # Xs and L stay float64 (SAMPLE_SPACE_DTYPE) in a checkpoint and a dtype change

    def __init__(self, x: Optional[Tensor] = None, l: Optional[Tensor] = None, lam: Optional[Tensor] = None,
                 whole: Optional[tuple] = None, index: int = 0) -> None:
        # its own (x, l, lam), or member `index` of a batch's, taken out only when needed
        self._own, self.whole, self.index = (x, l, lam) if whole is None else None, whole, index

    def _part(self, k: int) -> Tensor:
        return self._own[k] if self._own is not None else self.whole[k][self.index]

    x, l, lam = (property(lambda self, k=k: self._part(k)) for k in range(3))

    def apply(self, g: Tensor) -> Tensor:
        return self.apply_stack([self], g.unsqueeze(0))[0]

    @staticmethod
    def apply_stack(ops: list, gs: Tensor) -> Tensor:
        whole = ops[0].whole
        if (whole is not None and len(ops) == len(whole[0])
                and all(op.whole is whole and op.index == i for i, op in enumerate(ops))):
            x, l, lam = whole                                 # the factor batch as it is: no stack
        elif any(op.x.shape != ops[0].x.shape for op in ops):   # same G shape, other row counts
            return torch.stack([op.apply(g) for op, g in zip(ops, gs.unbind(0))])
        else:
            x, l, lam = (torch.stack([getattr(op, a) for op in ops]) for a in ("x", "l", "lam"))
        f = SAMPLE_SPACE_DTYPE
        g, x, l = gs.to(f), x.to(f), l.to(f)
        w = torch.matmul(g, x.mT)                                              # G Xs^T (B, rows, n)
        y = solvers.CholeskyFactor.apply_stack([solvers.CholeskyFactor(batch=l, index=i) for i in range(len(l))], w)
        m = torch.baddbmm(g, y, x, alpha=-1.0)                                 # G - Y Xs, lam M: the cancellation
        return m.div_(lam.to(f)[:, None, None]).to(gs.dtype)

    def cached(self) -> "SampleSpaceInverse":
        """Reused until the next refresh: the rows and the n x n factor (cheaper to apply than an explicit
        inverse), without a reference to the batch."""
        return SampleSpaceInverse(self.x, self.l, self.lam)

    def tensors(self) -> dict:
        return {"x": self.x, "l": self.l, "lam": self.lam}


solvers.OPERATORS[SampleSpaceInverse.__name__] = SampleSpaceInverse   # cached operators in a checkpoint


# ------------------------------------------------------------------------------ data parallel
def gather_rows(groups: "OrderedDict", rows: Optional[type]) -> "OrderedDict":
    """Under data parallelism, each group's rows from every rank in rank order, as :class:`SampleRows` of the
    global batch: one all-gather of the row counts, one of the rows padded to the longest. A group some rank
    holds as sums, or whose global rows reach d under "auto", becomes sums on every rank. ``rows``: the
    capture's row statistic (None: nothing to do); a rank that ran none of a group's layers holds zero sums."""
    if rows is None or not groups or not is_distributed():
        return groups
    keys, stats = list(groups), list(groups.values())
    device = stats[0].sums[0].device
    world = dist.get_world_size()
    # per group: this rank's row count, 0 for empty sums, -1 for sums with samples
    mine = torch.tensor([float(s.rows.shape[0]) if isinstance(s, SampleRows) else (0.0 if s.count == 0 else -1.0)
                         for s in stats], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    table = torch.stack(parts).T.tolist()            # [group][rank]
    out, gathered = OrderedDict(), []
    for key, stat, counts in zip(keys, stats, table):
        d = stat.rows.shape[1] if isinstance(stat, SampleRows) else stat.sums[0].shape[-1]
        total = sum(counts)
        if min(counts) < 0 or total == 0 or (rows is RowsOrCovariance and total >= d):
            out[key] = stat.to_dense() if isinstance(stat, SampleRows) else stat
        else:
            out[key] = stat
            gathered.append((key, stat, [int(c) for c in counts], d))
    if not gathered:
        return out
    dtype = functools.reduce(torch.promote_types, [s.sums[0].dtype for _, s, _, _ in gathered])   # one buffer
    width = [max(c) * d for _, _, c, d in gathered]
    buf = torch.zeros(sum(width), dtype=dtype, device=device)
    offset = 0
    for (_, stat, _, _), w in zip(gathered, width):
        if isinstance(stat, SampleRows):
            buf[offset:offset + stat.rows.numel()] = stat.rows.reshape(-1)
        offset += w
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    offset = 0
    for (key, stat, counts, d), w in zip(gathered, width):
        x = torch.cat([b[offset:offset + c * d].view(c, d) for b, c in zip(bufs, counts)])
        kind = SampleRows if rows is RowsOrCovariance else ForcedRows
        out[key] = kind((x.to(stat.sums[0].dtype),), float(sum(counts)), rows is RowsOrCovariance)
        offset += w
    return out
