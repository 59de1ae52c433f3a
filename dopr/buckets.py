"""A bucket of same-shape gradient matrices, read into one stack and written back in a few ops.

The AP step works per bucket (layers whose gradient matrices G have one shape, bias column, dtype and
device: a Linear(7, 4) and a Linear(8, 4, bias=False) have G of one shape laid out differently): one
stack of their G, one batched solve, one write-back of M. Per layer, reading G into its slot of the
stack and writing M back cost 6 to 8 aten ops (views of the slot, the bias column, two copies), the
host time a GPU waits for on a model of many small layers. A :class:`GradientBucket` does both for
the whole bucket:

* read: the weights' gradients concatenated into one (B * rows, d_in) block, the biases' into one
  column, and the two joined (5 ops for the bucket);
* write: M copied into a buffer that the bucket keeps from step to step, whose per-layer views
  (weight block, bias column) are made once, then one ``torch._foreach_copy_`` into the weights'
  gradients and one into the biases'.

A layer type takes part when its helper has ``grad_parts()`` (its weight gradient as a (rows, d_in)
matrix and its bias gradient, or None where a layer cannot); a bucket with any other member, or a
sharded gradient, keeps the per-layer path (``read_grad`` / ``set_grad``). The buffer costs one copy of
the bucket's M, in the statistics dtype, kept between steps (its address is fixed: what a captured
CUDA graph needs).
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
