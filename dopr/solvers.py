"""Solvers: from a damped activation covariance to an operator that maps G to G (Sigma + lam I)^-1.

``lam`` is the absolute damping (the optimizer turns ``damping`` into it as ``damping_mode`` says:
gamma * tr(Sigma) by default, as Algorithms 1-2 print it). Every solver takes a batch of same-size covariances and factors them in one call.

* ``cholesky``: cholesky_ex, then two triangular solves. A failed factor, or one whose smallest pivot is
  under half the damping (``unreliable``: rounding ate the damping), is retried with 10x, 100x,
  1000x the damping (at least 1e-6 * tr(Sigma) / d), and what still fails falls back to the
  eigendecomposition pseudo-inverse. With damping 0, a numerically singular Sigma (a pivot under
  rcond times its largest diagonal entry) goes straight to the pseudo-inverse, so the update stays in
  the span of the inputs. Every retry and fallback is counted. By size (issue 61): a batch's members are
  factored one call each from CHOLESKY_LOOP_FROM on, and the route to M (two triangular solves per apply,
  or an explicit inverse by potri or by the GEMM-bound blocked Cholesky of dopr.inverse, applied by one
  GEMM) is CHOLESKY_ROUTE_TABLE's for the device at the batch's gradient rows, within its measured sizes only,
  else the rate-weighted FLOP count's (:func:`cholesky_route`, issue 73).
* ``eigh``: the pseudo-inverse with a relative eigenvalue cutoff: eigenvalues below
  rcond * max eigenvalue are treated as exact zeros and their directions stay zero (damping boosts
  only the directions the activations do span), the open problem the paper names.
* ``rank1_diag``: Sigma ~ diag(E[z*z] - mu*mu) + mu mu^T, inverted by Sherman-Morrison in O(d)
  (the paper's "Rank-1 + Diagonal"; needs only the first and second moments of z).
* ``rankk_diag``: Sigma ~ U diag(s) U^T + diag(residual), U the top-k eigenvectors, inverted with
  the Woodbury identity; applying it costs O(rows * d * k) instead of O(rows * d^2).
* ``newton_schulz``: the inverse of A = Sigma + lam I by the Newton-Schulz iteration
  X <- X (2I - A X) from X0 = 2 I / (tr A + lam), GEMMs only (for GPUs where Cholesky is slow).
  The eigenvalues of X0 A lie in (0, 2), so it converges; the error falls as (1 - 2 lam / (tr A + lam))^(2^k),
  which needs about log2(tr A / lam) + 6 steps (20 at the default damping 1e-4 tr); run in the
  statistics' dtype, it is as accurate as that dtype allows for cond(A) (float32: ~cond * 1e-7).
* ``span``: no damping (``lam`` is ignored; issue 48, the appendix paragraph "Damping"'s future work).
  Sigma = U diag(e) U^T, undamped; a direction is *supported* when e_i > floor, floor =
  max(span_rcond, d * eps(dtype)) * e_max (d * eps * e_max bounds eigh's rounding error, so a direction
  under it is indistinguishable from a zero one), and P = U diag(1 / max(e_i, mean(e) / span_cap) on the
  supported directions, 0 elsewhere) U^T, mean(e) = tr(Sigma) / d. So Sigma is inverted exactly on the
  span of the batch's inputs (P Sigma P = P, Sigma P the projector onto the span) where no eigenvalue is
  under mean(e) / span_cap; a weakly excited direction is amplified at most span_cap / mean(e); a null
  direction gets exactly 0 (a gradient, which lies in the inputs' row space, has nothing there). Where
  neither the cap nor the floor binds, the update is Prop. PrecondInvariance's exactly: invariant under
  any invertible (affine, in homogeneous coordinates) input map, and for a rank-deficient Sigma its
  outputs on the training inputs still are (G A^T (A Sigma A^T)^+ A Z = G Sigma^+ Z for G = D Z^T / N,
  Sigma = Z Z^T / N: both are D times the projector onto Z's row space). The cap and the floor are set
  relative to the spectrum, so P is scale-equivariant (Sigma -> a^2 Sigma gives P / a^2). Not built: the
  Marchenko-Pastur edge e_noise (1 + sqrt(d / N))^2 as a floor; N is the statistic's ``count`` (samples
  times positions, correlated), which the solver is not given, and the noise level e_noise is unknown.
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


class ExplicitInverse:
    """M = G P with P the (pseudo-)inverse, formed once: one GEMM per apply, the cheapest to reuse between
    refreshes. P itself, or member `index` of a batch of them (applied to a whole batch without a stack).
    Applied in P's dtype, M in G's (a sample-space solve's feature-space fallback is float64)."""

    def __init__(self, p: Optional[Tensor] = None, batch: Optional[Tensor] = None, index: int = 0) -> None:
        self._p, self.batch, self.index = p, batch, index

    @property
    def p(self) -> Tensor:
        if self._p is None:
            self._p = self.batch[self.index]
        return self._p

    def apply(self, g: Tensor) -> Tensor:
        return (g.to(self.p.dtype) @ self.p).to(g.dtype)

    @staticmethod
    def apply_stack(ops: list, gs: Tensor) -> Tensor:
        p = _whole_batch(ops)
        if p is None:
            p = torch.stack([op.p for op in ops]) if len(ops) > 1 else ops[0].p.unsqueeze(0)
        return torch.bmm(gs.to(p.dtype), p).to(gs.dtype)

    def cached(self):
        return self

    def tensors(self) -> dict:
        return {"p": self.p}


def _whole_batch(ops: list) -> Optional[Tensor]:
    """The batch the operators are members 0, 1, ... of, in order (to apply as it is), else None."""
    batch = ops[0].batch
    if (batch is not None and len(ops) == len(batch)
            and all(op.batch is batch and op.index == i for i, op in enumerate(ops))):
        return batch
    return None


#: devices where the Cholesky solve and inverse are LAPACK's cholesky_solve / cholesky_inverse (one call per
#: batch, fewest copies): their status read back to the host waits for nothing on the CPU. Elsewhere the
#: step keeps to solve_triangular and GEMMs, which read nothing back (one host sync per step in all).
LAPACK_DEVICES = {"cpu"}


class CholeskyFactor:
    """M = G A^-1 by two triangular solves with A = L L^T, on G^T: ``cholesky_solve`` on the CPU (see
    LAPACK_DEVICES), elsewhere the same two trsm through ``solve_triangular``, which has no info check,
    so no host sync, where ``cholesky_solve`` reads its status back (bit for bit the same on the CPU).
    Applied in L's dtype, M in G's (as ExplicitInverse)."""

    def __init__(self, l: Optional[Tensor] = None, batch: Optional[Tensor] = None, index: int = 0) -> None:
        self._l, self.batch, self.index = l, batch, index   # L itself, or member `index` of a batch of them

    @property
    def l(self) -> Tensor:
        if self._l is None:
            self._l = self.batch[self.index]
        return self._l

    def apply(self, g: Tensor) -> Tensor:
        return self.apply_stack([self], g.unsqueeze(0))[0]

    @staticmethod
    def apply_stack(ops: list, gs: Tensor) -> Tensor:
        l = _whole_batch(ops)                                    # the factor batch as it is: no stack
        if l is None:
            l = torch.stack([op.l for op in ops]) if len(ops) > 1 else ops[0].l.unsqueeze(0)
        g = gs.to(l.dtype)
        if l.device.type in LAPACK_DEVICES:
            return torch.cholesky_solve(g.mT, l).mT.to(gs.dtype)
        y = torch.linalg.solve_triangular(l, g.mT, upper=False)           # L Y = G^T
        m = torch.linalg.solve_triangular(l.mT, y, upper=True).mT          # L^T M^T = Y: cholesky_solve's two trsm
        return m.to(gs.dtype)

    def cached(self):  # reused many times: one matmul per step beats two triangular solves
        return ExplicitInverse(inverse_from_factor(self.l.unsqueeze(0))[0])


def inverse_from_factor(l: Tensor) -> Tensor:
    """A^-1 = L^-T L^-1 for a batch of Cholesky factors (cholesky_inverse, LAPACK potri, 2 d^3 / 3 FLOPs,
    on LAPACK_DEVICES; elsewhere a triangular solve against I and a GEMM, 3 d^3 FLOPs, no host sync)."""
    if l.device.type in LAPACK_DEVICES:
        return torch.cholesky_inverse(l)
    eye = torch.eye(l.shape[-1], dtype=l.dtype, device=l.device).expand_as(l)
    linv = torch.linalg.solve_triangular(l, eye, upper=False)
    return linv.mT @ linv


def cached(ops: dict) -> dict:
    """{key: op.cached()}, the Cholesky factors of one batch inverted in one batched call. A member whose
    factor failed (a zero or non-finite diagonal: solved by a fallback, never applied) is inverted as I:
    cholesky_inverse raises on it, which crashed a cached step (issue 73's oracle: a LoRA input that
    dropout zeroed, precond_every 2)."""
    whole = {}
    for op in ops.values():
        if isinstance(op, CholeskyFactor) and op.batch is not None and id(op.batch) not in whole:
            l = op.batch
            failed = ~(l.diagonal(dim1=-2, dim2=-1).isfinite() & (l.diagonal(dim1=-2, dim2=-1) > 0)).all(-1)
            eye = torch.eye(l.shape[-1], dtype=l.dtype, device=l.device)
            whole[id(op.batch)] = inverse_from_factor(torch.where(failed[:, None, None], eye, l))
    return {key: ExplicitInverse(batch=whole[id(op.batch)], index=op.index)
            if isinstance(op, CholeskyFactor) and op.batch is not None else op.cached() for key, op in ops.items()}


class DiagonalInverse:
    """M = G D^-1 for diagonal D (embeddings): a column scaling."""

    def __init__(self, inv: Tensor) -> None:
        self.inv = inv

    def apply(self, g: Tensor) -> Tensor:
        return g * self.inv

    def restrict(self, columns: slice) -> "DiagonalInverse":
        """The operator on a slice of the columns (a rank's shard of a sharded embedding)."""
        return DiagonalInverse(self.inv[columns])

    def cached(self):
        return self

    def tensors(self) -> dict:
        return {"inv": self.inv}


class Rank1Diagonal:
    """(D + mu mu^T)^-1 = D^-1 - D^-1 mu mu^T D^-1 / (1 + mu^T D^-1 mu)  (Sherman-Morrison)."""

    def __init__(self, dinv: Tensor, u: Tensor, c: Tensor) -> None:
        self.dinv, self.u, self.c = dinv, u, c  # u = D^-1 mu, c = 1 + mu^T D^-1 mu

    def apply(self, g: Tensor) -> Tensor:
        return g * self.dinv - torch.outer(g @ self.u, self.u) / self.c

    def cached(self):
        return self

    def tensors(self) -> dict:
        return {"dinv": self.dinv, "u": self.u, "c": self.c}


class LowRankDiagonal:
    """(D + U S U^T)^-1 = D^-1 - V K V^T with V = D^-1 U, K = (S^-1 + U^T D^-1 U)^-1 (Woodbury)."""

    def __init__(self, dinv: Tensor, v: Tensor, k: Tensor) -> None:
        self.dinv, self.v, self.k = dinv, v, k

    def apply(self, g: Tensor) -> Tensor:
        return g * self.dinv - (g @ self.v) @ self.k @ self.v.T

    def cached(self):
        return self

    def tensors(self) -> dict:
        return {"dinv": self.dinv, "v": self.v, "k": self.k}


def apply_stack(ops: list, gs: Tensor) -> Tensor:
    """M for a stack of gradient matrices ``gs`` (B, rows, d), ``ops[i]`` the operator of ``gs[i]``: one
    batched call where the operators' type has one (same-size Cholesky factors, explicit inverses)."""
    kind = type(ops[0])
    if hasattr(kind, "apply_stack") and all(type(op) is kind for op in ops):
        return kind.apply_stack(ops, gs)
    return torch.stack([op.apply(g) for op, g in zip(ops, gs.unbind(0))])


OPERATORS = {cls.__name__: cls for cls in (ExplicitInverse, DiagonalInverse, Rank1Diagonal, LowRankDiagonal)}


def operator_from_state(state: dict):
    cls = OPERATORS[state["type"]]
    return cls(**state["tensors"])


def operator_state(op) -> dict:
    return {"type": type(op).__name__, "tensors": op.tensors()}


def operator_to(op, dtype: torch.dtype, device: torch.device):
    """`op` with its tensors in `dtype` (a layer's statistics dtype) on `device`: `op` itself when they are
    already; the tensors its type names in ``OWN_DTYPE`` (a float64 factor by design) keep their dtype."""
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
    """Batched U diag(1 / max(e, mean(e) / cap) on e > floor, else 0) U^T of the undamped Sigma: the
    ``span`` solver's P (see the module docstring; floor = max(rcond, d * eps) * max e)."""
    e, u = torch.linalg.eigh(sigma)
    d = sigma.shape[-1]
    top = e.amax(-1, keepdim=True).clamp(min=0)
    keep = e > max(rcond, d * torch.finfo(sigma.dtype).eps) * top
    mean = e.clamp(min=0).mean(-1, keepdim=True)
    lowest = mean / cap if cap < float("inf") else torch.zeros_like(mean)
    inv = torch.where(keep, 1.0 / torch.maximum(e, lowest).clamp(min=torch.finfo(e.dtype).tiny), torch.zeros_like(e))
    return (u * inv[:, None, :]) @ u.transpose(-1, -2)


def factor_span(sigma: Tensor, rcond: float, cap: float) -> list:
    return [ExplicitInverse(p) for p in span_inverse(sigma, rcond, cap)]


def unreliable(diag: Tensor, lam: Tensor) -> Tensor:
    """Factors Cholesky returned (``diag``: their diagonals L_ii) whose smallest pivot L_ii^2 is under half
    the damping: in exact arithmetic every pivot of Sigma + lam I is at least lam, so such a factor has
    lost lam to rounding (a near-singular Sigma whose entries dwarf lam) and its solve is not reliable."""
    return (lam > 0) & (diag.square().amin(-1) < 0.5 * lam)


class Deferred:
    """A batch factored without a host sync: ``trouble`` (a device bool per member) flags what
    :meth:`finish` must look at. The optimizer reads every batch's flags (and the gradients' finiteness)
    in one sync per step; :meth:`ops` is the answer when none is set."""

    trouble: Tensor

    def ops(self) -> list:
        raise NotImplementedError

    def finish(self, counts: dict, finite: Optional[Tensor] = None) -> list:
        """The operators after the repair path (retries, fallbacks), counted in `counts`; members whose
        Sigma is not `finite` are left as they are (the optimizer drops them)."""
        raise NotImplementedError


#: per device type, the size from which the members of a batch are factored one cholesky_ex call each
#: instead of one batched call: torch sends any batch > 1 to cuSOLVER's batched potrf, slower than a loop
#: above d ~ 2k (H100, cholesky_ex: (2, 14336) 225.6 ms batched vs 64.9 looped, (6, 4096) 22.1 vs 11.4,
#: (8, 2561) 10.3 vs 8.7; issue 61). None: never (the CPU's LAPACK path loops over the batch itself;
#: results/bench/solvers_cpu_routes.md, "batched ... looped").
CHOLESKY_LOOP_FROM = {"cuda": 2048, "cpu": None}


def cholesky_by_size(a: Tensor) -> tuple:
    """cholesky_ex of a batch (B, d, d): one batched call, or one call per member from
    CHOLESKY_LOOP_FROM[device type] on (the same factor and info; no host sync either way)."""
    start = CHOLESKY_LOOP_FROM.get(a.device.type)
    if start is None or len(a) < 2 or a.shape[-1] < start:
        return torch.linalg.cholesky_ex(a)
    l, info = torch.empty_like(a), torch.empty(len(a), dtype=torch.int32, device=a.device)
    for i in range(len(a)):
        torch.linalg.cholesky_ex(a[i], out=(l[i], info[i]))
    return l, info


#: How a Cholesky batch becomes M = G A^-1 (issue 61):
#:   cholesky_solve    potrf, then two triangular solves per apply (CholeskyFactor)
#:   cholesky_inverse  potrf, P = A^-1 by inverse_from_factor (LAPACK potri on the CPU), one GEMM per apply
#:   blocked_inverse   P = A^-1 by dopr.inverse.blocked_inverse (GEMMs), one GEMM per apply
CHOLESKY_ROUTES = ("cholesky_solve", "cholesky_inverse", "blocked_inverse")

#: The route per device type, measured on that device (dopr/tables: the module cholesky_routes_<device type>.py,
#: written by ``python -m benchmarks.bench_solvers --routes --table-out ...``): {(d, rows): route} at the measured
#: points, a route other than the FLOP default kept only where its slowest repeat beat the default's fastest
#: (dopr.tables.keep, :func:`route_table`); read by :func:`cholesky_route` at the nearest point, and never
#: outside the measured sizes. One route name instead of a table forces it for every size
#: (``dopr.solvers.CHOLESKY_ROUTE_TABLE["cuda"] = "blocked_inverse"``). A device type without an entry gets
#: :func:`flop_route`.
CHOLESKY_ROUTE_TABLE: dict = tables.load("cholesky_routes")

#: The rate of each kernel class relative to a GEMM's, for devices without a measured table: on an H100
#: (issue 61) fp32 GEMMs run ~50 TFLOP/s, large potrf ~12 ((6, 4096) looped in 11.4 ms), trsm 1.2-7.
KERNEL_RATES = {"gemm": 1.0, "potrf": 0.25, "trsm": 0.1}

#: KERNEL_RATES per device type where they differ: on the CPU, LAPACK's potrf and trsm are blocked into the
#: same BLAS as the GEMMs, so FLOPs are counted alike and the FLOP default is cholesky_solve at every size (the
#: fewest FLOPs: potri or the blocked inverse only add to them; issue 73: the blocked inverse taken at d >= 2049
#: from a table point measured at d = 1024 was 2.5-3.5x slower than cholesky_solve at d = 2100).
DEVICE_KERNEL_RATES = {"cpu": {"gemm": 1.0, "potrf": 1.0, "trsm": 1.0}}


def route_cost(route: str, d: int, rows: int, lapack: bool = False, rates: Optional[dict] = None) -> float:
    """A route's FLOPs for one (d x d) factorisation and one (rows x d) apply, each kernel class's divided by
    its rate relative to a GEMM's (KERNEL_RATES): potrf d^3/3; two trsm 2 d^2 rows; an explicit inverse
    from the factor 2 d^3/3 by LAPACK's potri (``lapack``, counted at potrf's rate), else d^3 trsm against I
    plus a 2 d^3 GEMM; the blocked inverse 10 d^3 / 3 of GEMMs (dopr.inverse); G P 2 d^2 rows of GEMM."""
    r = KERNEL_RATES if rates is None else rates
    potrf, gemm_apply = d**3 / 3 / r["potrf"], 2 * d * d * rows / r["gemm"]
    if route == "cholesky_solve":
        return potrf + 2 * d * d * rows / r["trsm"]
    if route == "cholesky_inverse":
        inverse = 2 * d**3 / 3 / r["potrf"] if lapack else d**3 / r["trsm"] + 2 * d**3 / r["gemm"]
        return potrf + inverse + gemm_apply
    return 10 * d**3 / 3 / r["gemm"] + gemm_apply


def flop_route(device_type: str, d: int, rows: int) -> str:
    """The route of least rate-weighted FLOPs (:func:`route_cost`, the device type's DEVICE_KERNEL_RATES, else
    KERNEL_RATES): the default where nothing was measured (on the CPU: cholesky_solve)."""
    rates = DEVICE_KERNEL_RATES.get(device_type, KERNEL_RATES)
    return min(CHOLESKY_ROUTES, key=lambda r: route_cost(r, d, rows, device_type in LAPACK_DEVICES, rates))


def _route_coordinates(point: tuple) -> tuple:
    """(d, rows / d): the grid the route benchmark measures (rows as multiples of d)."""
    d, rows = point
    return d, max(rows, 1) / d


def cholesky_route(device_type: str, d: int, rows: Optional[int] = None) -> str:
    """The route for a (d x d) batch applied to ``rows`` gradient rows per member (the rows of the gradients
    each factor is applied to: the layers' d_out summed over a group sharing one Sigma; default d): the
    nearest measured point of CHOLESKY_ROUTE_TABLE for the device type where (d, rows / d) lies within its
    measured sizes (dopr.tables.lookup), else :func:`flop_route`."""
    rows = d if rows is None else rows
    table = CHOLESKY_ROUTE_TABLE.get(device_type)
    if isinstance(table, str):
        return table
    default = flop_route(device_type, d, rows)
    return default if table is None else tables.lookup(table, (d, rows), _route_coordinates, default)


def route_table(records: list, device_type: str) -> dict:
    """The table to keep from route timings: ``records`` [{"d", "rows", "ms": {route: [repeats]}}] ->
    {(d, rows): route}, each point's route the FLOP default unless another beat it beyond the spread of the
    repeats (dopr.tables.keep)."""
    return {(r["d"], r["rows"]): tables.keep(r["ms"], flop_route(device_type, r["d"], r["rows"])) for r in records}


def _factor_route(a: Tensor, route: str) -> tuple:
    """(L or None, P or None, diag L, info) of a damped batch by a route (CHOLESKY_ROUTES). A member whose
    factor failed gets P from the identity's factor (its P is never used: the repair path replaces it)."""
    if route == "blocked_inverse":
        p, diag, info = blocked_inverse(a)
        return None, p, diag, info
    l, info = cholesky_by_size(a)
    if route == "cholesky_solve":
        return l, None, l.diagonal(dim1=-2, dim2=-1), info
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return l, inverse_from_factor(torch.where((info > 0)[:, None, None], eye, l)), l.diagonal(dim1=-2, dim2=-1), info


class CholeskyBatch(Deferred):
    """cholesky_ex of the damped batch. Trouble: a failed factor, one whose smallest pivot is under half
    the damping (``unreliable``), or, with damping 0, a numerically singular Sigma (a pivot under rcond
    times its largest diagonal entry: it gets the pseudo-inverse, so that M stays in the span of the
    inputs, where a near-zero pivot would blow rounding up along directions the batch never saw).
    The route (CHOLESKY_ROUTES) is :func:`cholesky_route`'s for the device, d and ``rows``, unless given;
    every route flags the same trouble."""

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
        """Retry with 10x, 100x, 1000x the damping (at least 1e-6 tr(Sigma) / d); what still fails, and
        the singular ones, get the eigendecomposition pseudo-inverse. Restores sigma first."""
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
            # real writes: the "K[bad] = I on a copy" bug cannot happen
            l = l.index_copy(0, idx, l_r) if l is not None else None
            p = p.index_copy(0, idx, p_r) if p is not None else None
            bad = bad.index_copy(0, idx, (info_r > 0) | unreliable(diag_r, lam_r))
        idx = (bad | singular).nonzero().flatten()
        if idx.numel() and p is not None:                      # explicit inverses: the fallback joins the batch
            counts["eigh_fallbacks"] += idx.numel()
            return self._ops(None, p.index_copy(0, idx, pseudo_inverse(sigma[idx], lam[idx], self.rcond)))
        ops = self._ops(l, p)
        if idx.numel():
            counts["eigh_fallbacks"] += idx.numel()
            pinv = pseudo_inverse(sigma[idx], lam[idx], self.rcond)
            for j, i in enumerate(idx.tolist()):
                ops[i] = ExplicitInverse(pinv[j])
        return ops


def factor_cholesky(sigma: Tensor, lam: Tensor, rcond: float, counts: dict) -> list:
    """The operators of :class:`CholeskyBatch` at once (one host sync); damps ``sigma`` in place."""
    return CholeskyBatch(sigma, lam, rcond).finish(counts)


def factor_eigh(sigma: Tensor, lam: Tensor, rcond: float) -> list:
    return [ExplicitInverse(p) for p in pseudo_inverse(sigma, lam, rcond)]


def top_eigenpairs(sigma: Tensor, k: int, iters: int = 8):
    """Top-k eigenpairs of a batch of PSD matrices: exact eigh for small d, else subspace iteration
    from a fixed start (deterministic, and it leaves the global RNG alone)."""
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
    v = q @ w
    return e[:, -k:], v[:, :, -k:]


def factor_rankk(sigma: Tensor, lam: Tensor, rank: int) -> list:
    k = min(rank, sigma.shape[-1])
    s, u = top_eigenpairs(sigma, k)
    s = s.clamp(min=0)
    resid = sigma.diagonal(dim1=-2, dim2=-1) - ((u * u) * s[:, None, :]).sum(-1)
    dinv = 1.0 / (resid.clamp(min=0) + lam[:, None])
    ops = []
    for i in range(len(sigma)):
        v = dinv[i][:, None] * u[i]
        keep = s[i] > 0
        v = v[:, keep]
        core = torch.diag(1.0 / s[i][keep]) + u[i][:, keep].T @ v
        ops.append(LowRankDiagonal(dinv[i], v, torch.linalg.inv(core)))
    return ops


def factor_newton_schulz(sigma: Tensor, lam: Tensor, max_steps: int = 60) -> list:
    """Batched (sigma + lam I)^-1 by Newton-Schulz; one step count for the batch (its hardest member)."""
    a = _damped(sigma, lam)
    trace = a.diagonal(dim1=-2, dim2=-1).sum(-1)
    ratio = float((trace / lam.clamp(min=torch.finfo(a.dtype).tiny)).max())
    steps = min(max_steps, int(torch.tensor(ratio).log2().ceil()) + 6)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    x = (2.0 / (trace + lam))[:, None, None] * eye
    for _ in range(steps):
        x = x @ (2.0 * eye - a @ x)
    x = 0.5 * (x + x.transpose(-1, -2))
    return [ExplicitInverse(p) for p in x]


def factor_rank1(mean: Tensor, second: Tensor, lam: Tensor) -> Rank1Diagonal:
    """mean = E[z], second = E[z*z] (diagonal of Sigma)."""
    var = (second - mean * mean).clamp(min=0)
    dinv = 1.0 / (var + lam)
    u = dinv * mean
    return Rank1Diagonal(dinv, u, 1.0 + mean @ u)


def factor_diagonal(diag: Tensor, lam: Tensor) -> DiagonalInverse:
    return DiagonalInverse(1.0 / (diag + lam))


# ------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Solver:
    """A solver by name: the kind of statistic it consumes ("dense" or "moments", see
    dopr.statistics.STATISTICS; embeddings always use the exact diagonal one) and, for dense
    statistics, its batched factorisation ``factor(sigma, lam, counts, **values)``: a list of operators,
    or a :class:`Deferred` whose trouble flags the optimizer reads with everything else in one sync.
    ``values`` are the DoPr options named in ``options`` (e.g. ``("eigh_rcond",)``), and only those."""

    name: str
    statistic: str
    factor: Optional[Callable] = None
    #: the factorisation fails on a non-finite Sigma (eigh raises): such a member is replaced by the
    #: identity first, decided on the host. False: it copes (cholesky_ex flags it) and the optimizer
    #: leaves the member out after the step's one read-back.
    finite_inputs: bool = True
    #: the DoPr options (dopr.options.DoPrOptions fields) that ``factor`` takes as keywords
    options: tuple = ()
    #: ``factor`` takes ``rows``: the gradient rows each member's operator is applied to (the optimizer
    #: passes them, dopr.refresh.Refresh.factor; the Cholesky route depends on them)
    takes_rows: bool = False

    def bind(self, options) -> Optional[Callable]:
        """``factor(sigma, lam, counts)`` with this solver's option values from ``options`` (a DoPrOptions)."""
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
register_solver("eigh", "dense", lambda sigma, lam, counts, eigh_rcond: factor_eigh(sigma, lam, eigh_rcond),
                options=("eigh_rcond",))
register_solver("rank1_diag", "moments")
register_solver("newton_schulz", "dense", lambda sigma, lam, counts: factor_newton_schulz(sigma, lam))
register_solver("rankk_diag", "dense", lambda sigma, lam, counts, rank: factor_rankk(sigma, lam, rank),
                options=("rank",))
register_solver("span", "dense", lambda sigma, lam, counts, span_rcond, span_cap: factor_span(sigma, span_rcond, span_cap),
                options=("span_rcond", "span_cap"))
