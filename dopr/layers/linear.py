"""nn.Linear (and anything built from it: attention projections, peft's lora_A / lora_B)."""
from __future__ import annotations

from torch import Tensor

from .base import LayerHelper


class LinearHelper(LayerHelper):
    """z is the input feature vector of every sample and every sequence position."""

    mode = "linear"

    def input_dim(self) -> int:
        return self.module.in_features

    @property
    def share_key(self):
        # q, k and v projections of one input tensor have identical statistics
        return ("linear", self.homogeneous)

    def activations(self, x: Tensor) -> Tensor:
        return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])

    def grad_matrix(self):
        g = self._grad(self.module.weight)
        return None if g is None else self._with_bias_column(g)

    def set_grad(self, m: Tensor) -> None:
        self._grad(self.module.weight).copy_(self._split_bias_column(m))

    def grad_shape(self) -> tuple:
        g = self._grad(self.module.weight)
        return (g.shape[0], g.shape[1] + int(self.homogeneous))

    def grad_parts(self):
        return self._plain_parts(self.module.weight.grad)

    def read_grad(self, out: Tensor) -> None:
        self._read_with_bias_column(self._grad(self.module.weight), out)
