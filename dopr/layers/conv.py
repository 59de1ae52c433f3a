"""Convolutions as linear maps on unfolded patches (im2col): ``h = W z`` at every output position, ``W`` the
kernel as (C_out, C_in * prod(kernel)) and ``z`` the patch in the same (channel, kernel offset) order; Sigma is
the mean of z z^T over samples and positions (the paper's "Convolutional Affine Invariance"). ``groups == 1`` only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import LayerHelper

_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def explicit_padding(module) -> list:
    """Left/right padding per spatial dim, in F.pad order (last dim first)."""
    k, dil = module.kernel_size, module.dilation
    pads = []
    for i in reversed(range(len(k))):
        if isinstance(module.padding, str):
            total = dil[i] * (k[i] - 1) if module.padding == "same" else 0
            pads += [total // 2, total - total // 2]
        else:
            pads += [module.padding[i], module.padding[i]]
    return pads


def patch_matrix(x: Tensor, kernel, dilation, stride) -> Tensor:
    """The patches of a padded (N, C, *spatial) input as rows of an (N * positions, C * prod(kernel)) matrix in
    F.unfold's order: a strided view and one copy (F.unfold's CUDA im2col launches one kernel per sample).
    """
    n = len(kernel)
    for i, (k, dl, s) in enumerate(zip(kernel, dilation, stride)):
        x = x.unfold(2 + i, dl * (k - 1) + 1, s)[..., ::dl]  # (N, C, *out, *kernel) once done
    cols = x.shape[1] * math.prod(kernel)
    return x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)).reshape(-1, cols)


class ConvHelper(LayerHelper):
    """nn.Conv1d and nn.Conv2d ("full" mode): the exact im2col patch covariance."""

    def __init__(self, module, name, homogeneous=True):
        super().__init__(module, name, homogeneous)
        self.spatial = len(module.kernel_size)
        self.mode = f"conv{self.spatial}d-full"

    def input_dim(self) -> int:
        m = self.module
        return m.in_channels * math.prod(m.kernel_size)

    def activations(self, x: Tensor) -> Tensor:
        m = self.module
        if x.dim() == self.spatial + 1:  # unbatched input
            x = x.unsqueeze(0)
        x = F.pad(x, explicit_padding(m), mode=_PAD_MODES[m.padding_mode])
        return patch_matrix(x, m.kernel_size, m.dilation, m.stride)

    def grad_matrix(self):
        g = self._grad(self.module.weight)
        return None if g is None else self._with_bias_column(g.reshape(g.shape[0], -1))

    def grad_shape(self) -> tuple:
        return (self._grad(self.module.weight).shape[0], self.dim)

    def read_grad(self, out: Tensor) -> None:
        g = self._grad(self.module.weight)
        self._read_with_bias_column(g.reshape(g.shape[0], -1), out)

    def grad_parts(self):
        g = self.module.weight.grad
        if g is None or not g.is_contiguous():   # the matrix must be a view that writes through
            return None
        return self._plain_parts(g.view(g.shape[0], -1))

    def set_grad(self, m: Tensor) -> None:
        g = self._grad(self.module.weight)
        g.copy_(self._split_bias_column(m).reshape(g.shape))


class ConvTranspose1dHelper(LayerHelper):
    """nn.ConvTranspose1d as the equivalent ordinary convolution: stride s, padding p, dilation dl is a stride-1
    convolution, the kernel flipped and its in/out channels swapped, of the input with s - 1 zeros between samples,
    padded by dl*(k-1) - p on the left (plus output_padding on the right); dim = C_in * k. Whole weights only.
    """

    mode = "convtranspose1d-full"

    def input_dim(self) -> int:
        return self.module.in_channels * self.module.kernel_size[0]

    def activations(self, x: Tensor) -> Tensor:
        m = self.module
        if x.dim() == 2:
            x = x.unsqueeze(0)
        (k,), (s,), (p,), (dl,), (op,) = m.kernel_size, m.stride, m.padding, m.dilation, m.output_padding
        n, c, length = x.shape
        if s > 1:
            up = x.new_zeros(n, c, (length - 1) * s + 1)
            up[..., ::s] = x
            x = up
        edge = dl * (k - 1) - p
        x = F.pad(x, [edge, edge + op])
        return patch_matrix(x, (k,), (dl,), (1,))

    def grad_shape(self) -> tuple:
        return (self.module.weight.grad.shape[1], self.dim)

    def grad_matrix(self):
        g = self.module.weight.grad  # (C_in, C_out, k)
        if g is None:
            return None
        g = g.flip(2).transpose(0, 1).reshape(g.shape[1], -1)
        return self._with_bias_column(g)

    def set_grad(self, m: Tensor) -> None:
        w = self.module.weight
        c_in, c_out, k = w.shape
        wm = self._split_bias_column(m).reshape(c_out, c_in, k).transpose(0, 1).flip(2)
        w.grad.copy_(wm)


class Conv2dSUAHelper(LayerHelper):
    """nn.Conv2d with the spatially-uncorrelated approximation (SUA).

    Assuming activations at different pixels are uncorrelated and have the same second moment,
    the patch covariance becomes block diagonal with identical blocks, I_(kh*kw) (x) Sigma_c, where
    Sigma_c = mean over all N*H*W input pixels (padding excluded) of the channel vector z z^T,
    of size C_in x C_in. Its inverse acts on the channel axis of the kernel gradient at each of the
    kh*kw kernel offsets: M[:, :, i, j] = G[:, :, i, j] (Sigma_c + damping)^-1.

    Cost: N*H*W*C_in^2 to form Sigma_c and C_in^3/3 to factor it, (kh*kw)^2 and (kh*kw)^3 times less than
    "full", no unfolded copy. The bias is not part of this covariance: its gradient goes to the GP unchanged.
    """

    mode = "conv2d-sua"

    def __init__(self, module, name, homogeneous=True):
        super().__init__(module, name, homogeneous=False)
        kh, kw = module.kernel_size
        self.rows_per_weight_row = kh * kw  # rows (C_out, kh, kw): each output channel's kernel offsets

    def input_dim(self) -> int:
        return self.module.in_channels

    def activations(self, x: Tensor) -> Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(0)
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])

    def grad_shape(self) -> tuple:
        return (self._grad(self.module.weight).shape[0] * self.rows_per_weight_row, self.dim)

    def grad_matrix(self):
        g = self._grad(self.module.weight)  # (C_out, C_in, kh, kw) -> rows (C_out, kh, kw), columns C_in
        return None if g is None else g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])

    def set_grad(self, m: Tensor) -> None:
        g = self._grad(self.module.weight)
        c_out, c_in, kh, kw = g.shape
        g.copy_(m.reshape(c_out, kh, kw, c_in).permute(0, 3, 1, 2))
