"""nn.Embedding: the input is one-hot, so Sigma is diagonal.

Written as a linear map, an embedding is h = W^T e_t with W (vocab x dim) and e_t the one-hot
vector of token t, so Sigma = diag(c / n) with c the token counts in the batch. The AP
G Sigma^-1 of the linear form becomes a per-row scaling of the (vocab x dim) gradient:
row t is divided by c_t / n + damping. No vocab x vocab matrix is ever formed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import sharding
from ..statistics import ActivationStatistics, Diagonal, statistics_dtype
from .base import LayerHelper


class EmbeddingHelper(LayerHelper):
    mode = "embedding-diagonal"

    def __init__(self, module, name, homogeneous=True):
        super().__init__(module, name, homogeneous=False)  # an embedding has no bias

    def input_dim(self) -> int:
        return self.module.num_embeddings

    def statistic_type(self, kind: type) -> type:
        return Diagonal

    def statistics(self, x: Tensor, kind: type) -> ActivationStatistics:
        """Always the exact diagonal (token counts), whatever the solver's `kind`. A scatter-add, not
        bincount: its output size is static, so a compiled forward does not break its graph."""
        idx = x.reshape(-1)
        dtype = statistics_dtype(self.module.weight.dtype)
        counts = torch.zeros(self.module.num_embeddings, dtype=dtype, device=idx.device)
        counts.index_add_(0, idx, torch.ones(idx.shape, dtype=dtype, device=idx.device))
        return Diagonal.from_counts(counts, idx.numel(), self.module.weight.dtype)

    def grad_matrix(self):
        g = self._grad(self.module.weight)
        return None if g is None else g.T  # the linear form (dim x vocab), a view

    def set_grad(self, m: Tensor) -> None:
        self._grad(self.module.weight).copy_(m.T)

    def grad_shape(self) -> tuple:
        g = self._grad(self.module.weight)   # (vocab rows of this rank, dim)
        return (g.shape[1], g.shape[0])

    def local_columns(self):
        """Sharded (FSDP2 splits the vocabulary rows): this rank's token columns of the diagonal Sigma."""
        w = self.module.weight
        return slice(*sharding.row_range(w)) if sharding.is_sharded(w) else None
