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
