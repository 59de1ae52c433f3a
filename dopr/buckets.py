"""A bucket of same-shape gradient matrices (one shape, bias column, dtype and device), read into one stack and
written back in a few ops, where per layer it would cost 6 to 8 aten ops of host time.

Read: the weights' gradients concatenated into one (B * rows, d_in) block, the biases' into one column, the two
joined. Write: M copied into a buffer the bucket keeps between steps (a fixed address, as a CUDA graph needs), whose
per-layer views are made once, then one ``torch._foreach_copy_`` into the weights' gradients and one into the
biases'. A layer takes part when its helper's ``grad_parts()`` gives its parts; else the bucket keeps the per-layer
path (``read_grad`` / ``set_grad``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class GradientBucket:
    """The layers ``helpers`` whose G are (rows, d) matrices of dtype ``dtype`` (the statistics dtype)
    on ``device``; ``homogeneous``: their last column is the bias's gradient."""

    def __init__(self, helpers: list, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
        self.helpers, self.shape, self.dtype = list(helpers), tuple(shape), dtype
        self.homogeneous = helpers[0].homogeneous
        rows, d = self.shape
        self.m = torch.empty((len(helpers), rows, d), dtype=dtype, device=device)
        cols = d - int(self.homogeneous)
        self.weight_views = [self.m[i, :, :cols] for i in range(len(helpers))]
        self.bias_views = [self.m[i, :, cols] for i in range(len(helpers))] if self.homogeneous else []

    @staticmethod
    def parts(helpers: list) -> Optional[list]:
        """[(weight gradient (rows, d_in), bias gradient or None)] per layer, or None when a layer has no
        such parts this step (another layer type, a sharded gradient, a bias without a gradient)."""
        out = []
        for h in helpers:
            part = h.grad_parts() if hasattr(h, "grad_parts") else None
            if part is None or (h.homogeneous and part[1] is None):
                return None
            if part[0].dim() != 2 or part[0].shape[1] != h.dim - int(h.homogeneous):
                raise RuntimeError(f"{type(h).__name__}.grad_parts() gave a weight gradient of shape "
                                   f"{tuple(part[0].shape)} for a layer of dim {h.dim}: (rows, d_in) expected")
            out.append(part)
        return out

    def read(self, parts: list) -> Tensor:
        """G stacked, (B, rows, d) in the statistics dtype."""
        b = len(parts)
        rows, d = self.shape
        w = torch.cat([p[0] for p in parts]).view(b, rows, d - int(self.homogeneous))
        if self.homogeneous:
            w = torch.cat([w, torch.cat([p[1] for p in parts]).view(b, rows, 1)], dim=2)
        return w if w.dtype == self.dtype else w.to(self.dtype)

    def fill(self, parts: list) -> None:
        """G into the bucket's buffer, the inverse of :meth:`write` (a CUDA graph's static input, dopr/graphs.py)."""
        torch._foreach_copy_(self.weight_views, [p[0] for p in parts])
        if self.homogeneous:
            torch._foreach_copy_(self.bias_views, [p[1] for p in parts])

    def write(self, parts: list, m: Tensor) -> None:
        """M (B, rows, d) into the layers' gradients (weight block and bias column)."""
        self.m.copy_(m)
        torch._foreach_copy_([p[0] for p in parts], self.weight_views)
        if self.homogeneous:
            torch._foreach_copy_([p[1] for p in parts], self.bias_views)
