"""Solvers: from a batch of same-size covariances and their absolute damping ``lam`` to operators that map
G to G (Sigma + lam I)^-1 (docs/library.md, ``solver``).

* ``cholesky``: cholesky_ex. A failed factor, or one whose smallest pivot is under half the damping, is
  retried with 10x, 100x, 1000x the damping, then falls back to the eigh pseudo-inverse; with damping 0 a
  numerically singular Sigma goes straight to the pseudo-inverse, so the update stays in the inputs' span.
  All counted. The route to M (two triangular solves, potri or dopr.inverse's blocked inverse; issue 61) is
  CHOLESKY_ROUTE_TABLE's for the device within its measured sizes, else the FLOP count's (issue 73).
* ``eigh``: the pseudo-inverse; eigenvalues under rcond * max are exact zeros and their directions stay zero.
* ``rank1_diag``: Sigma ~ diag(E[z*z] - mu*mu) + mu mu^T (the paper's "Rank-1 + Diagonal"), ``rankk_diag``:
  Sigma ~ U diag(s) U^T + diag(residual), top-k eigenvectors U; both by rank-one Cholesky updates, O(k d) a row.
* ``newton_schulz``: X <- X + X (I - A X) from X0 = 2 I / (tr A + lam), GEMMs only, ~log2(tr A / lam) + 6 steps;
  a residual |I - A X|_F over 0.1 (a diverged or singular solve) is counted and solved by Cholesky.
* ``span``: no damping (issue 48): P = U diag(1 / max(e_i, mean(e) / span_cap)) U^T on the directions with
  e_i > max(span_rcond, d eps) e_max (d eps e_max bounds eigh's rounding), 0 elsewhere. Where neither the cap
  nor the floor binds the update is Prop. PrecondInvariance's exactly, also for a rank-deficient Sigma on the
  training inputs; P is scale-equivariant.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from dataclasses import dataclass
from typing import Callable, Optional

from dopr import tables
from dopr.inverse import blocked_inverse

CHOLESKY_RETRIES = 3


class _Operator:
    def cached(self):   # what is reused between refreshes (precond_every > 1): the operator itself
        return self


class _BatchMember(_Operator):
    """An operator of one tensor: its own, or member `index` of a batch (taken out only when needed)."""

    def __init__(self, own: Optional[Tensor] = None, batch: Optional[Tensor] = None, index: int = 0) -> None:
        self._own, self.batch, self.index = own, batch, index

    def _member(self) -> Tensor:
        if self._own is None:
            self._own = self.batch[self.index]
        return self._own

    @staticmethod
    def stacked(ops: list, attr: str) -> Tensor:
        """The batch the operators are members 0, 1, ... of, in order (applied as it is), else theirs stacked."""
        batch = ops[0].batch
        if (batch is not None and len(ops) == len(batch)
                and all(op.batch is batch and op.index == i for i, op in enumerate(ops))):
            return batch
        return torch.stack([getattr(op, attr) for op in ops]) if len(ops) > 1 else getattr(ops[0], attr).unsqueeze(0)


class ExplicitInverse(_BatchMember):
    """M = G P, P the (pseudo-)inverse: one GEMM per apply. Applied in P's dtype, M in G's (a sample-space
    solve's feature-space fallback is float64)."""

    p = property(_BatchMember._member)

    def __init__(self, p: Optional[Tensor] = None, batch: Optional[Tensor] = None, index: int = 0) -> None:
        super().__init__(p, batch, index)

    def apply(self, g: Tensor) -> Tensor:
        return (g.to(self.p.dtype) @ self.p).to(g.dtype)

    @staticmethod
    def apply_stack(ops: list, gs: Tensor) -> Tensor:
        p = _BatchMember.stacked(ops, "p")
        return torch.bmm(gs.to(p.dtype), p).to(gs.dtype)

    def tensors(self) -> dict:
        return {"p": self.p}


#: devices where the Cholesky solve and inverse are LAPACK's cholesky_solve / cholesky_inverse: their status
#: read-back waits for nothing on the CPU; elsewhere solve_triangular and GEMMs, which read nothing back.
LAPACK_DEVICES = {"cpu"}


class CholeskyFactor(_BatchMember):
    """M = G A^-1 by two triangular solves with A = L L^T: ``cholesky_solve`` on LAPACK_DEVICES, elsewhere the
    same two trsm by ``solve_triangular`` (no info check, no host sync). Applied in L's dtype, M in G's."""

    l = property(_BatchMember._member)

    def apply(self, g: Tensor) -> Tensor:
        return self.apply_stack([self], g.unsqueeze(0))[0]

    @staticmethod
    def apply_stack(ops: list, gs: Tensor) -> Tensor:
        l = _BatchMember.stacked(ops, "l")
        g = gs.to(l.dtype)
        if l.device.type in LAPACK_DEVICES:
            return torch.cholesky_solve(g.mT, l).mT.to(gs.dtype)
        y = torch.linalg.solve_triangular(l, g.mT, upper=False)           # L Y = G^T
        m = torch.linalg.solve_triangular(l.mT, y, upper=True).mT          # L^T M^T = Y: cholesky_solve's two trsm
        return m.to(gs.dtype)

    def cached(self):  # reused many times: one matmul per step beats two triangular solves
        return ExplicitInverse(inverse_from_factor(self.l.unsqueeze(0))[0])


def inverse_from_factor(l: Tensor) -> Tensor:
    """A^-1 = L^-T L^-1 for a batch of Cholesky factors: potri on LAPACK_DEVICES, else trsm against I and a GEMM."""
    if l.device.type in LAPACK_DEVICES:
        return torch.cholesky_inverse(l)
    eye = torch.eye(l.shape[-1], dtype=l.dtype, device=l.device).expand_as(l)
    linv = torch.linalg.solve_triangular(l, eye, upper=False)
    return linv.mT @ linv


def cached(ops: dict) -> dict:
    """{key: op.cached()}, the Cholesky factors of one batch inverted in one call. A member whose factor
    failed (solved by a fallback, never applied) is inverted as I: cholesky_inverse raises on it (issue 73).
    The inverses row-major (cholesky_inverse's are column-major): a resume stacks the saved ones, and bmm
    rounds a transposed operand otherwise (issue 73, N6)."""
    whole = {}
    for op in ops.values():
        if isinstance(op, (CholeskyFactor, ExplicitInverse)) and op.batch is not None and id(op.batch) not in whole:
            l = op.batch
            if isinstance(op, ExplicitInverse):
                whole[id(l)] = l.contiguous()
                continue
            diag = l.diagonal(dim1=-2, dim2=-1)
            failed = ~(diag.isfinite() & (diag > 0)).all(-1)
            eye = torch.eye(l.shape[-1], dtype=l.dtype, device=l.device)
            whole[id(l)] = inverse_from_factor(torch.where(failed[:, None, None], eye, l)).contiguous()
    return {key: ExplicitInverse(batch=whole[id(op.batch)], index=op.index)
            if isinstance(op, (CholeskyFactor, ExplicitInverse)) and op.batch is not None else op.cached()
            for key, op in ops.items()}


class DiagonalInverse(_Operator):
    """M = G D^-1 for diagonal D (embeddings): a column scaling."""

    def __init__(self, inv: Tensor) -> None:
        self.inv = inv

    def apply(self, g: Tensor) -> Tensor:
        return g * self.inv

    def restrict(self, columns: slice) -> "DiagonalInverse":   # a rank's shard of a sharded embedding
        return DiagonalInverse(self.inv[columns])

    def tensors(self) -> dict:
        return {"inv": self.inv}


class DiagonalPlusLowRank(_Operator):
    """(D + Z^T Z)^-1, D diagonal, Z (k, d), as k rank-one Cholesky updates (Gill, Golub, Murray and Saunders
    1974, C1): D + z z^T = L diag(D + z^2 / t_prev) L^T with t = 1 + cumsum(z^2 / D), L unit lower, L_ij = z_i z_j
    / (D_j t_j) below the diagonal; each solve is a cumsum, O(k d) a row, and as stable as a Cholesky solve
    (issue 73, N3: Sherman-Morrison's and Woodbury's D^-1 - ... cancelled up to u mu^T D^-1 mu of M). ``z``:
    each update's vector through the earlier factors; ``diag`` (k + 1, d): D before each, and the last."""

    def __init__(self, z: Tensor, diag: Tensor) -> None:
        self.z, self.diag = z, diag

    @classmethod
    def of(cls, diag: Tensor, zs: Tensor) -> "DiagonalPlusLowRank":
        """diag(diag) + zs^T zs; a 0 in diag (a bias's variance at lambda 0) taken as eps^2 of the scale."""
        floor = torch.finfo(diag.dtype).eps ** 2 * (diag.amax() + zs.square().sum(0).amax())
        op = cls(zs[:0], diag.clamp(min=floor)[None])
        for z in zs:
            z = functools.reduce(op._solve, range(len(op.z)), z)     # through the earlier factors
            t = torch.cat([torch.ones_like(z[:1]), 1 + torch.cumsum(z * z / op.diag[-1], -1)[:-1]])
            op = cls(torch.cat([op.z, z[None]]), torch.cat([op.diag, (op.diag[-1] + z * z / t)[None]]))
        return op

    def _solve(self, b: Tensor, i: int, upper: bool = False) -> Tensor:
        """L_i^-1 b, or L_i^-T b (``upper``), along the last dimension: a cumsum each."""
        z, dz = self.z[i], self.z[i] / self.diag[i]
        t = torch.cat([torch.ones_like(z[:1]), 1 + torch.cumsum(z * dz, -1)[:-1]])          # t_{j-1}
        if upper:
            p = torch.flip(torch.cumsum(torch.flip(b * z / t, [-1]), -1), [-1])           # sum over i >= j
            return b - dz * torch.cat([p[..., 1:], torch.zeros_like(p[..., :1])], -1)
        c = torch.cumsum(b * dz, -1)
        return b - z * torch.cat([torch.zeros_like(c[..., :1]), c[..., :-1]], -1) / t

    def apply(self, g: Tensor) -> Tensor:
        g = functools.reduce(self._solve, range(len(self.z)), g) / self.diag[-1]
        return functools.reduce(lambda v, i: self._solve(v, i, upper=True), reversed(range(len(self.z))), g)

    def tensors(self) -> dict:
        return {"z": self.z, "diag": self.diag}


def apply_stack(ops: list, gs: Tensor) -> Tensor:
    """M for a stack ``gs`` (B, rows, d), ``ops[i]`` the operator of ``gs[i]``: batched where the type can."""
    kind = type(ops[0])
    if hasattr(kind, "apply_stack") and all(type(op) is kind for op in ops):
        return kind.apply_stack(ops, gs)
    return torch.stack([op.apply(g) for op, g in zip(ops, gs.unbind(0))])


OPERATORS = {cls.__name__: cls for cls in (ExplicitInverse, DiagonalInverse, DiagonalPlusLowRank)}


def operator_from_state(state: dict):
    t = state["tensors"]
    if state["type"] in ("Rank1Diagonal", "LowRankDiagonal"):   # saved before N3's fix: the inverse they applied
        v, k = (t["u"][:, None], (1 / t["c"]).reshape(1, 1)) if "u" in t else (t["v"], t["k"])
        return ExplicitInverse(torch.diag(t["dinv"]) - v @ k @ v.T)
    return OPERATORS[state["type"]](**t)


def operator_state(op) -> dict:
    return {"type": type(op).__name__, "tensors": op.tensors()}


def operator_to(op, dtype: torch.dtype, device: torch.device):
    """`op` with its tensors in `dtype` on `device` (itself if so); those named in its ``OWN_DTYPE`` keep theirs."""
    own, tensors = getattr(type(op), "OWN_DTYPE", ()), op.tensors()
    if all(t.device == device and (t.dtype == dtype or n in own) for n, t in tensors.items()):
        return op
    return type(op)(**{n: t.to(device=device, dtype=t.dtype if n in own else dtype) for n, t in tensors.items()})


def _damped(sigma: Tensor, lam: Tensor) -> Tensor:
    """sigma + lam I for a batch, in one copy."""
    a = sigma.clone()
    a.diagonal(dim1=-2, dim2=-1).add_(lam[:, None])
    return a


def pseudo_inverse(sigma: Tensor, lam: Tensor, rcond: float) -> Tensor:
    """Batched V diag(1 / (e + lam) on e > rcond * max e, else 0) V^T."""
    e, v = torch.linalg.eigh(sigma)
    keep = e > rcond * e.amax(-1, keepdim=True).clamp(min=0)
    inv = torch.where(keep, 1.0 / (e.clamp(min=0) + lam[:, None]), torch.zeros_like(e))
    return (v * inv[:, None, :]) @ v.transpose(-1, -2)


def span_inverse(sigma: Tensor, rcond: float, cap: float) -> Tensor:
    """The ``span`` solver's P for a batch of undamped Sigma (module docstring)."""
    e, u = torch.linalg.eigh(sigma)
    d = sigma.shape[-1]
    top = e.amax(-1, keepdim=True).clamp(min=0)
    keep = e > max(rcond, d * torch.finfo(sigma.dtype).eps) * top
    mean = e.clamp(min=0).mean(-1, keepdim=True)
    lowest = mean / cap if cap < float("inf") else torch.zeros_like(mean)
    inv = torch.where(keep, 1.0 / torch.maximum(e, lowest).clamp(min=torch.finfo(e.dtype).tiny), torch.zeros_like(e))
    return (u * inv[:, None, :]) @ u.transpose(-1, -2)


def unreliable(diag: Tensor, lam: Tensor) -> Tensor:
    """Factors (``diag``: their L_ii) whose smallest pivot L_ii^2 is under lam / 2: every pivot of Sigma + lam I
    is at least lam in exact arithmetic, so such a factor lost lam to rounding and its solve is not reliable."""
    return (lam > 0) & (diag.square().amin(-1) < 0.5 * lam)


class Deferred:
    """A batch factored without a host sync: ``trouble`` (a device bool per member) flags what :meth:`finish`
    must repair; the optimizer reads every batch's flags in one sync per step. :meth:`ops` when none is set."""

    trouble: Tensor

    def ops(self) -> list:
        raise NotImplementedError

    def finish(self, counts: dict, finite: Optional[Tensor] = None) -> list:
        """The operators after the repair path: members in trouble counted in counts[COUNTER] and replaced by
        ``fallback(idx, counts)``'s (the subclass's); members not `finite` are left (dropped later)."""
        bad = self.trouble if finite is None else self.trouble & finite
        ops, idx = self.ops(), bad.nonzero().flatten()
        if idx.numel():
            counts[self.COUNTER] += idx.numel()
            for j, op in zip(idx.tolist(), self.fallback(idx, counts)):
                ops[j] = op
        return ops


#: per device type, the size from which a batch's members are factored one cholesky_ex call each: cuSOLVER's
#: batched potrf is slower than a loop above d ~ 2k (H100: (6, 4096) 22.1 ms batched vs 11.4 looped; issue 61).
#: None: never (the CPU's LAPACK path loops over the batch itself).
CHOLESKY_LOOP_FROM = {"cuda": 2048, "cpu": None}


def cholesky_by_size(a: Tensor) -> tuple:
    """cholesky_ex of a batch (B, d, d): one call, or one per member from CHOLESKY_LOOP_FROM[device type] on."""
    start = CHOLESKY_LOOP_FROM.get(a.device.type)
    if start is None or len(a) < 2 or a.shape[-1] < start:
        return torch.linalg.cholesky_ex(a)
    l, info = torch.empty_like(a), torch.empty(len(a), dtype=torch.int32, device=a.device)
    for i in range(len(a)):
        torch.linalg.cholesky_ex(a[i], out=(l[i], info[i]))
    return l, info


#: How a Cholesky batch becomes M = G A^-1 (issue 61): two triangular solves per apply (CholeskyFactor), or
#: P = A^-1 by inverse_from_factor or by dopr.inverse.blocked_inverse (GEMMs), then one GEMM per apply
CHOLESKY_ROUTES = ("cholesky_solve", "cholesky_inverse", "blocked_inverse")

#: The route per device type, {(d, rows): route} measured there (dopr/tables/cholesky_routes_<device type>.py,
#: :func:`route_table`), read by :func:`cholesky_route`; one route name instead forces it for every size
CHOLESKY_ROUTE_TABLE: dict = tables.load("cholesky_routes")

#: The rate of each kernel class relative to a GEMM's, where nothing was measured: on an H100 (issue 61) fp32
#: GEMMs run ~50 TFLOP/s, large potrf ~12, trsm 1.2-7.
KERNEL_RATES = {"gemm": 1.0, "potrf": 0.25, "trsm": 0.1}

#: KERNEL_RATES per device type where they differ: on the CPU LAPACK's potrf and trsm run on the GEMMs' BLAS,
#: so the FLOP default is cholesky_solve at every size (issue 73: the blocked inverse at d = 2100 was
#: 2.5-3.5x slower)
DEVICE_KERNEL_RATES = {"cpu": {"gemm": 1.0, "potrf": 1.0, "trsm": 1.0}}


def route_cost(route: str, d: int, rows: int, lapack: bool = False, rates: Optional[dict] = None) -> float:
    """A route's FLOPs for one (d x d) factorisation and one (rows x d) apply, each kernel class's divided by
    its rate (KERNEL_RATES): potrf d^3/3; two trsm 2 d^2 rows; potri (``lapack``) 2 d^3/3, else d^3 trsm
    plus a 2 d^3 GEMM; the blocked inverse 10 d^3 / 3 (dopr.inverse); G P 2 d^2 rows."""
    r = KERNEL_RATES if rates is None else rates
    potrf, gemm_apply = d**3 / 3 / r["potrf"], 2 * d * d * rows / r["gemm"]
    if route == "cholesky_solve":
        return potrf + 2 * d * d * rows / r["trsm"]
    if route == "cholesky_inverse":
        inverse = 2 * d**3 / 3 / r["potrf"] if lapack else d**3 / r["trsm"] + 2 * d**3 / r["gemm"]
        return potrf + inverse + gemm_apply
    return 10 * d**3 / 3 / r["gemm"] + gemm_apply


def flop_route(device_type: str, d: int, rows: int) -> str:
    """The route of least rate-weighted FLOPs (:func:`route_cost`): the default where nothing was measured."""
    rates = DEVICE_KERNEL_RATES.get(device_type, KERNEL_RATES)
    return min(CHOLESKY_ROUTES, key=lambda r: route_cost(r, d, rows, device_type in LAPACK_DEVICES, rates))


def _route_coordinates(point: tuple) -> tuple:
    """(d, rows / d): the grid the route benchmark measures (rows as multiples of d)."""
    d, rows = point
    return d, max(rows, 1) / d


def cholesky_route(device_type: str, d: int, rows: Optional[int] = None) -> str:
    """The route for a (d x d) batch applied to ``rows`` gradient rows per member (default d): CHOLESKY_ROUTE_TABLE's
    nearest point within its measured sizes (dopr.tables.lookup), else :func:`flop_route`."""
    rows = d if rows is None else rows
    table = CHOLESKY_ROUTE_TABLE.get(device_type)
    if isinstance(table, str):
        return table
    default = flop_route(device_type, d, rows)
    return default if table is None else tables.lookup(table, (d, rows), _route_coordinates, default)


def route_table(records: list, device_type: str) -> dict:
    """{(d, rows): route} from timings [{"d", "rows", "ms": {route: [repeats]}}] (dopr.tables.keep)."""
    return {(r["d"], r["rows"]): tables.keep(r["ms"], flop_route(device_type, r["d"], r["rows"])) for r in records}


def _factor_route(a: Tensor, route: str) -> tuple:
    """(L or None, P or None, diag L, info) of a damped batch by a route; a failed member's P is I's (never used)."""
    if route == "blocked_inverse":
        p, diag, info = blocked_inverse(a)
        return None, p, diag, info
    l, info = cholesky_by_size(a)
    if route == "cholesky_solve":
        return l, None, l.diagonal(dim1=-2, dim2=-1), info
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return l, inverse_from_factor(torch.where((info > 0)[:, None, None], eye, l)), l.diagonal(dim1=-2, dim2=-1), info


class CholeskyBatch(Deferred):
    """cholesky_ex of the damped batch by :func:`cholesky_route`'s route unless given. Trouble: a failed or
    ``unreliable`` factor, or with damping 0 a numerically singular Sigma (a pivot under rcond times its largest
    diagonal entry: the pseudo-inverse keeps M in the inputs' span, where a near-zero pivot would blow rounding
    up along directions the batch never saw)."""

    def __init__(self, sigma: Tensor, lam: Tensor, rcond: float, rows: Optional[int] = None,
                 route: Optional[str] = None) -> None:
        self.sigma, self.lam, self.rcond = sigma, lam, rcond   # sigma: damped in place (the caller's copy)
        self.route = route or cholesky_route(sigma.device.type, sigma.shape[-1], rows)
        sigma.diagonal(dim1=-2, dim2=-1).add_(lam[:, None])
        self.l, self.p, diag, info = _factor_route(sigma, self.route)
        pivots = diag.square().amin(-1)
        self.weak = (info == 0) & (lam > 0) & (pivots < 0.5 * lam)
        self.singular = (lam <= 0) & ((info > 0) | (pivots < rcond * sigma.diagonal(dim1=-2, dim2=-1).amax(-1)))
        self.bad = ((info > 0) | self.weak) & ~self.singular
        self.trouble = self.bad | self.singular

    def ops(self) -> list:
        return self._ops(self.l, self.p)

    @staticmethod
    def _ops(l: Optional[Tensor], p: Optional[Tensor]) -> list:
        if p is not None:
            return [ExplicitInverse(batch=p, index=i) for i in range(len(p))]
        return [CholeskyFactor(batch=l, index=i) for i in range(len(l))]

    def finish(self, counts: dict, finite: Optional[Tensor] = None) -> list:
        """Retry with 10x, 100x, 1000x the damping (at least 1e-6 tr(Sigma) / d); what still fails, and the
        singular ones, get the pseudo-inverse. Restores sigma first."""
        bad, singular, weak, lam, sigma, l, p = self.bad, self.singular, self.weak, self.lam, self.sigma, self.l, self.p
        if finite is not None:
            bad, singular, weak = bad & finite, singular & finite, weak & finite
        if not bool((bad | singular).any()):
            return self.ops()
        d = sigma.shape[-1]
        counts["unreliable_factors"] += int(weak.sum())
        sigma.diagonal(dim1=-2, dim2=-1).sub_(lam[:, None])
        floor = 1e-6 * sigma.diagonal(dim1=-2, dim2=-1).sum(-1) / d
        for retry in range(1, CHOLESKY_RETRIES + 1):
            idx = bad.nonzero().flatten()
            if idx.numel() == 0:
                break
            counts["cholesky_retries"] += idx.numel()
            lam_r = torch.maximum(lam[idx], floor[idx]) * 10.0**retry
            l_r, p_r, diag_r, info_r = _factor_route(_damped(sigma[idx], lam_r), self.route)
            l = l.index_copy(0, idx, l_r) if l is not None else None
            p = p.index_copy(0, idx, p_r) if p is not None else None
            bad = bad.index_copy(0, idx, (info_r > 0) | unreliable(diag_r, lam_r))
        idx = (bad | singular).nonzero().flatten()
        counts["eigh_fallbacks"] += idx.numel()
        if idx.numel() and p is not None:                      # explicit inverses: the fallback joins the batch
            return self._ops(None, p.index_copy(0, idx, pseudo_inverse(sigma[idx], lam[idx], self.rcond)))
        ops = self._ops(l, p)
        for i, pinv in zip(idx.tolist(), pseudo_inverse(sigma[idx], lam[idx], self.rcond) if idx.numel() else ()):
            ops[i] = ExplicitInverse(pinv)
        return ops


def factor_cholesky(sigma: Tensor, lam: Tensor, rcond: float, counts: dict) -> list:
    """The operators of :class:`CholeskyBatch` at once (one host sync); damps ``sigma`` in place."""
    return CholeskyBatch(sigma, lam, rcond).finish(counts)


def top_eigenpairs(sigma: Tensor, k: int, iters: int = 8):
    """Top-k eigenpairs of a batch of PSD matrices: eigh for small d, else subspace iteration from a fixed
    start (deterministic, the global RNG left alone)."""
    d = sigma.shape[-1]
    if d <= 4 * k:
        e, v = torch.linalg.eigh(sigma)
        return e[:, -k:], v[:, :, -k:]
    gen = torch.Generator(device=sigma.device).manual_seed(0)
    q = torch.randn(d, k + 8, generator=gen, device=sigma.device, dtype=sigma.dtype)
    q = q.expand(sigma.shape[0], d, k + 8)
    for _ in range(iters):
        q, _ = torch.linalg.qr(sigma @ q)
    e, w = torch.linalg.eigh(q.transpose(-1, -2) @ sigma @ q)  # Rayleigh-Ritz
    return e[:, -k:], (q @ w)[:, :, -k:]


def factor_rankk(sigma: Tensor, lam: Tensor, rank: int) -> list:
    s, u = top_eigenpairs(sigma, min(rank, sigma.shape[-1]))
    z = u * s.clamp(min=0).sqrt()[:, None, :]
    resid = sigma.diagonal(dim1=-2, dim2=-1) - z.square().sum(-1)
    return [DiagonalPlusLowRank.of(r, zi.mT) for r, zi in zip(resid.clamp(min=0) + lam[:, None], z)]


class NewtonSchulzBatch(Deferred):
    """(sigma + lam I)^-1 by X <- X + X (I - A X), one step count for the batch. X = A^-1 (I - R), R = I - A X: M's
    error |G A^-1 R| <= |R| |M|, d u cond as Cholesky's (issue 73, N4: symmetrising X put R on the right, u cond^2).
    Trouble, counted and solved by the Cholesky path: |R|_F > RESIDUAL or not finite."""

    COUNTER, RESIDUAL = "unreliable_factors", 0.1   # RESIDUAL: |I - A X|_F (bounds |dM| / |M|) trusted at most

    def __init__(self, sigma: Tensor, lam: Tensor, rcond: float, max_steps: int = 60) -> None:
        self.sigma, self.lam, self.rcond, a = sigma, lam, rcond, _damped(sigma, lam)
        trace = a.diagonal(dim1=-2, dim2=-1).sum(-1)
        ratio = float((trace / lam.clamp(min=torch.finfo(a.dtype).tiny)).max())
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        self.x = (2.0 / (trace + lam))[:, None, None] * eye
        for _ in range(min(max_steps, int(torch.tensor(ratio).log2().ceil()) + 6)):
            self.x = self.x + self.x @ (eye - a @ self.x)
        self.trouble = ~((eye - a @ self.x).norm(dim=(-2, -1)) <= self.RESIDUAL)   # NaN too

    def ops(self) -> list:
        return [ExplicitInverse(p) for p in self.x]

    def fallback(self, idx: Tensor, counts: dict) -> list:
        return factor_cholesky(self.sigma[idx], self.lam[idx], self.rcond, counts)


def factor_diagonal(diag: Tensor, lam: Tensor) -> DiagonalInverse:
    """The pseudo-inverse: an entry exactly 0 at lambda 0 (a token no row carried, its gradient column 0 too) gets
    0; a non-finite one stays non-finite, for the step's checks to count."""
    a = diag + lam
    return DiagonalInverse(torch.where(a == 0, torch.zeros_like(a), 1.0 / a))


# ------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Solver:
    """A solver by name: the statistic kind it consumes (dopr.statistics.STATISTICS) and, for dense ones, its
    batched ``factor(sigma, lam, counts, **values)``: a list of operators or a :class:`Deferred`. ``values``: the
    DoPr options named in ``options``, and only those. ``finite_inputs``: the factorisation fails on a
    non-finite Sigma (eigh raises), so such a member is replaced by I first; ``takes_rows``: ``factor`` takes the
    gradient rows each operator is applied to (the Cholesky route depends on them)."""

    name: str
    statistic: str
    factor: Optional[Callable] = None
    finite_inputs: bool = True
    options: tuple = ()
    takes_rows: bool = False

    def bind(self, options) -> Optional[Callable]:
        """``factor(sigma, lam, counts)`` with this solver's option values from ``options``."""
        if self.factor is None:
            return None
        return functools.partial(self.factor, **{k: getattr(options, k) for k in self.options})


SOLVERS: dict = {}


def register_solver(name: str, statistic: str, factor: Optional[Callable] = None, finite_inputs: bool = True,
                    options: tuple = (), takes_rows: bool = False) -> None:
    """Add a solver: ``DoPr(..., solver=name)`` then factors with ``factor`` (see :class:`Solver`)."""
    SOLVERS[name] = Solver(name, statistic, factor, finite_inputs, tuple(options), takes_rows)


register_solver("cholesky", "dense",
                lambda sigma, lam, counts, eigh_rcond, rows=None: CholeskyBatch(sigma, lam, eigh_rcond, rows),
                finite_inputs=False, options=("eigh_rcond",), takes_rows=True)
register_solver("eigh", "dense", lambda sigma, lam, counts, eigh_rcond: [
    ExplicitInverse(p) for p in pseudo_inverse(sigma, lam, eigh_rcond)], options=("eigh_rcond",))
register_solver("rank1_diag", "moments")
register_solver("newton_schulz", "dense",
                lambda sigma, lam, counts, eigh_rcond: NewtonSchulzBatch(sigma, lam, eigh_rcond),
                options=("eigh_rcond",))
register_solver("rankk_diag", "dense", lambda sigma, lam, counts, rank: factor_rankk(sigma, lam, rank),
                options=("rank",))
register_solver("span", "dense", lambda sigma, lam, counts, span_rcond, span_cap: [
    ExplicitInverse(p) for p in span_inverse(sigma, span_rcond, span_cap)], options=("span_rcond", "span_cap"))
