"""Independent float64 references for the tests: the paper's formulas written out directly."""
import torch


def ap_reference(g: torch.Tensor, z: torch.Tensor, damping: float, mode: str = "trace") -> torch.Tensor:
    """M = G (Sigma + lam I)^-1 with Sigma = Z^T Z / n, all in float64; lam = damping * tr(Sigma)
    ("trace", Algorithms 1-2), damping * tr(Sigma) / d ("trace_per_dim") or damping ("absolute")."""
    g, z = g.double(), z.double()
    sigma = z.T @ z / z.shape[0]
    d = sigma.shape[0]
    lam = {"trace": damping * torch.trace(sigma), "trace_per_dim": damping * torch.trace(sigma) / d,
           "absolute": torch.tensor(damping, dtype=torch.float64)}[mode]
    a = sigma + lam * torch.eye(d, dtype=torch.float64)
    return torch.linalg.solve(a, g.T).T  # a is symmetric: G A^-1 = (A^-1 G^T)^T


def with_ones(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([z, torch.ones(z.shape[0], 1, dtype=z.dtype)], dim=1)


def conv1d_patches(x: torch.Tensor, k: int, stride: int, padding: int, dilation: int) -> torch.Tensor:
    """Patch vectors (channel-major, then kernel offset) by explicit loops, zero padding."""
    n, c, length = x.shape
    xp = torch.nn.functional.pad(x, [padding, padding])
    out_len = (length + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    rows = []
    for b in range(n):
        for o in range(out_len):
            rows.append(torch.stack([xp[b, :, o * stride + j * dilation] for j in range(k)], dim=1).reshape(-1))
    return torch.stack(rows)


def conv2d_patches(x: torch.Tensor, k: int, stride: int, padding: int) -> torch.Tensor:
    n, c, h, w = x.shape
    xp = torch.nn.functional.pad(x, [padding] * 4)
    ho, wo = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    rows = []
    for b in range(n):
        for i in range(ho):
            for j in range(wo):
                rows.append(xp[b, :, i * stride:i * stride + k, j * stride:j * stride + k].reshape(-1))
    return torch.stack(rows)


def conv_transpose1d_patches(x, c_out_len, k, stride, padding, dilation):
    """z[c_in, j] at output position o is x[c_in, i] with o = i*stride - padding + j*dilation."""
    n, c, length = x.shape
    rows = []
    for b in range(n):
        for o in range(c_out_len):
            z = torch.zeros(c, k, dtype=x.dtype)
            for j in range(k):
                num = o + padding - j * dilation
                if num % stride == 0 and 0 <= num // stride < length:
                    z[:, j] = x[b, :, num // stride]
            rows.append(z.reshape(-1))
    return torch.stack(rows)


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u), u = eps / 2 the unit roundoff of `dtype` (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., ch. 3): a product of n roundings lies within gamma_n of 1."""
    u = torch.finfo(dtype).eps / 2
    assert n * u < 1
    return n * u / (1 - n * u)


def matmul_error_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|fl(a @ b) - a @ b| <= gamma_n |a| |b| entry by entry, n the inner dimension (Higham ch. 3): each
    entry is a dot product of n terms, in any summation order, with or without FMA (blocked or vectorised
    BLAS kernels only reorder the sum). Computed in float64 from the operands' magnitudes, so it holds on
    any BLAS and CPU; under cancellation it is far above eps * |a @ b|, which is no bound."""
    a, b = a.double().abs(), b.double().abs()
    return gamma(a.shape[-1], dtype) * (a @ b)


def cholesky_ap_error_bound(got: torch.Tensor, want: torch.Tensor, z: torch.Tensor, damping: float,
                            dtype: torch.dtype) -> torch.Tensor:
    """A bound on |got - want| entry by entry, where got = G (Sigma + lam I)^-1 is DoPr's, computed in `dtype`
    from inputs z (exact in `dtype`) by a Cholesky factor and two triangular solves (cholesky_solve,
    dopr.solvers.CholeskyFactor, the CPU's route at small d and few gradient rows: dopr.solvers.cholesky_route),
    and want = ap_reference(G, z, damping) (LU with partial pivoting, float64), lam = damping tr(Sigma).

    Each side computes its M exactly for a perturbed matrix, Mhat (A + E) = G, so Mhat - M = -Mhat E A^-1 and
    |Mhat - M| <= |Mhat| F |A^-1| for any F >= |E| (u the unit roundoff, S = |Z|^T |Z| / n, Higham, Accuracy
    and Stability of Numerical Algorithms, 2nd ed.):
      Sigma = Z^T Z / n, sums of n products, then / n:       gamma_{n+1} S                      (ch. 3)
      lam = damping tr(Sigma): the rounded diagonal's d-term sum (gamma_{d-1}), damping's cast, the product and
      lam's cast (3 roundings), and Sigma's own error on the diagonal (gamma_{n+1}):
                                                             damping gamma_{n+d+3} tr(S)  on the diagonal
      Sigma_ii + lam, one rounding:                          gamma_2 (S_ii + lam)  on the diagonal
      DoPr's Cholesky factor and solves:                     gamma_{3d+1} |R^T| |R|             (Thm 10.4)
      the reference's LU solve:                              gamma_{3d} P |L| |U|                (Thm 9.4)
    The factors are the float64 ones of the exact A (the computed ones agree to first order); |A^-1| is
    float64's, within cond(A) d eps64 of it. No constant is chosen: every term is a count of roundings."""
    from dopr.solvers import cholesky_route
    z = z.double()
    n, d = z.shape
    assert cholesky_route("cpu", d, got.shape[0]) == "cholesky_solve", "the bound is the Cholesky solve's"
    s = z.abs().T @ z.abs() / n
    a = z.T @ z / n
    lam = damping * float(torch.trace(a))
    a = a + lam * torch.eye(d, dtype=torch.float64)
    ainv = torch.linalg.inv(a).abs()

    def rounding(dt, solve):
        f = gamma(n + 1, dt) * s + solve
        f.diagonal().add_(damping * gamma(n + d + 3, dt) * float(torch.trace(s)) + gamma(2, dt) * (s.diagonal() + lam))
        return f

    r = torch.linalg.cholesky(a).abs()
    p, l, u = torch.linalg.lu(a)
    ours = rounding(dtype, gamma(3 * d + 1, dtype) * (r @ r.T))
    reference = rounding(torch.float64, gamma(3 * d, torch.float64) * (p @ (l.abs() @ u.abs())))
    return got.double().abs() @ ours @ ainv + want.double().abs() @ reference @ ainv


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """|got - want| <= bound entry by entry; the message names the entry furthest over."""
    err = (got - want).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), f"{float(err.flatten()[worst]):.3g} off, bound {float(bound.flatten()[worst]):.3g}"
