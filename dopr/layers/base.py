"""The contract between a layer type and the activation preconditioner (AP): every preconditioned layer is a
linear map ``h = W z`` on activation vectors ``z`` (a token, a sample, a convolution patch), its gradient the matrix
``G`` (rows x dim) that the AP right-multiplies by ``(Sigma + damping)^-1``. With ``homogeneous=True`` a layer with
a bias appends a constant 1 to ``z``: the bias is the last column of ``W`` and the update is invariant to affine
input transforms ``z -> Q z + d``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import sharding
from ..statistics import ActivationStatistics


class LayerHelper:
    """Base class, one instance per preconditioned module: subclasses set ``mode`` and implement
    :meth:`activations`, :meth:`grad_matrix` and :meth:`set_grad`. ``share_key`` (not None) lets layers that read
    the very same input tensor (q, k and v projections) share one covariance and one factorisation.
    """

    mode: str = "?"
    #: rows of the gradient matrix per row of the weight (its dim 0, what FSDP2 shards)
    rows_per_weight_row: int = 1

    def __init__(self, module: nn.Module, name: str, homogeneous: bool = True) -> None:
        self.module = module
        self.name = name
        bias = getattr(module, "bias", None)
        self.homogeneous = bool(homogeneous and bias is not None and bias.requires_grad)

    @property
    def dim(self) -> int:
        """Dimension d of the activation covariance (including the homogeneous 1)."""
        return self.input_dim() + int(self.homogeneous)

    def input_dim(self) -> int:
        raise NotImplementedError

    @property
    def share_key(self) -> Optional[tuple]:
        return None

    def activations(self, x: Tensor) -> Tensor:
        """The activation vectors z as rows of an (n, input_dim) matrix."""
        raise NotImplementedError

    def statistic_type(self, kind: type) -> type:
        """The statistic type this layer gathers when the solver asks for `kind`."""
        return kind

    def statistics(self, x: Tensor, kind: type) -> ActivationStatistics:
        """Sums over the n vectors z of this input, of the statistic type `kind` the solver consumes."""
        return kind.from_activations(self.activations(x), self.homogeneous)  # under no_grad (the capture's)

    def grad_matrix(self) -> Optional[Tensor]:
        """G as a (rows, dim) matrix, or None when the weight has no gradient."""
        raise NotImplementedError

    def set_grad(self, m: Tensor) -> None:
        """Write the preconditioned matrix M (same layout as :meth:`grad_matrix`) back."""
        raise NotImplementedError

    def has_grad(self) -> bool:
        return self.module.weight.grad is not None

    def grad_shape(self) -> tuple:
        """The shape of :meth:`grad_matrix` (a subclass knows it without forming the matrix)."""
        return tuple(self.grad_matrix().shape)

    def grad_dtype(self) -> torch.dtype:
        return self.module.weight.grad.dtype

    def read_grad(self, out: Tensor) -> None:
        """Write G into `out` (a slot of the step's stack of same-shape gradients)."""
        out.copy_(self.grad_matrix())

    def grad_parts(self) -> Optional[tuple]:
        """(the weight's gradient as a (rows, d_in) matrix that writes through, the bias's gradient or None), for a
        bucket's batched read and write (dopr/buckets.py); None: the layer is read and written on its own."""
        return None

    def _plain_parts(self, g_weight: Optional[Tensor]) -> Optional[tuple]:
        """:meth:`grad_parts` of a weight-plus-bias layer whose gradient matrix is `g_weight` (a view of
        the weight's gradient), unless a gradient is sharded (FSDP2: the per-layer path)."""
        if g_weight is None or sharding.is_sharded(self.module.weight.grad):
            return None
        gb = self.module.bias.grad if self.homogeneous else None
        if gb is not None and (sharding.is_sharded(gb) or gb.dim() != 1):
            return None
        return g_weight, gb

    def local_columns(self) -> Optional[slice]:
        """The columns of Sigma that this rank's gradient matrix has (a sharded embedding), or None: all."""
        return None

    def whole_matrix(self, g: Tensor) -> Tensor:
        """A buffer laid out as this rank's gradient matrix, gathered whole (a collective under FSDP2)."""
        w = self.module.weight
        if not sharding.is_sharded(w):
            return g
        return sharding.gather_matrix(g, w, self._sharded_axis(), self.rows_per_weight_row)

    def local_matrix(self, g: Tensor) -> Tensor:
        """This rank's part of a whole-layer gradient-matrix buffer (the inverse of whole_matrix)."""
        w = self.module.weight
        if not sharding.is_sharded(w):
            return g
        return sharding.local_matrix(g, w, self._sharded_axis(), self.rows_per_weight_row)

    def _sharded_axis(self) -> int:
        """The gradient matrix's axis that the weight's row shards split (an embedding's: its token columns)."""
        return 1 if self.local_columns() is not None else 0

    @staticmethod
    def _grad(p: nn.Parameter) -> Optional[Tensor]:
        """p's gradient, or this rank's rows of it when p is sharded (FSDP2): a view that writes through."""
        return sharding.local(p.grad)

    def _with_bias_column(self, g_weight: Tensor) -> Tensor:
        if not self.homogeneous:
            return g_weight
        gb = self._grad(self.module.bias)
        if gb is None:
            gb = torch.zeros(g_weight.shape[0], dtype=g_weight.dtype, device=g_weight.device)
        gb = gb.unsqueeze(1) if gb.dim() == 1 else gb.reshape(-1, 1)
        return torch.cat([g_weight, gb if gb.dtype == g_weight.dtype else gb.to(g_weight.dtype)], dim=1)

    def _read_with_bias_column(self, g_weight: Tensor, out: Tensor) -> None:
        """:meth:`_with_bias_column` written into `out` (no concatenation)."""
        if not self.homogeneous:
            out.copy_(g_weight)
            return
        rows, cols = out.shape
        out.as_strided((rows, cols - 1), out.stride(), out.storage_offset()).copy_(g_weight)
        col = out.as_strided((rows,), (out.stride(0),), out.storage_offset() + (cols - 1) * out.stride(1))
        gb = self._grad(self.module.bias)
        if gb is None:
            col.zero_()
        else:
            col.copy_(gb if gb.dim() == 1 else gb.reshape(-1))

    def _split_bias_column(self, m: Tensor) -> Tensor:
        """Write the bias column (if any) into bias.grad; return the weight part (``as_strided`` views)."""
        if not self.homogeneous:
            return m
        rows, cols = m.shape
        gb = self._grad(self.module.bias)
        if gb is not None:
            col = m.as_strided((rows,), (m.stride(0),), m.storage_offset() + (cols - 1) * m.stride(1))
            gb.copy_(col if gb.dim() == 1 else col.reshape(gb.shape))
        return m.as_strided((rows, cols - 1), m.stride(), m.storage_offset())

    def parameters(self) -> list:
        ps = [self.module.weight]
        if self.homogeneous:
            ps.append(self.module.bias)
        return ps
