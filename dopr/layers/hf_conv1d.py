"""Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2's c_attn, c_proj, c_fc): a linear map y = x W + b
with the weight stored (in, out), so G = weight.grad^T; matched by its qualified name (transformers not imported).
"""
from __future__ import annotations

from torch import Tensor

from .linear import LinearHelper


class HFConv1DHelper(LinearHelper):
    """nn.Linear with a transposed weight: same z, same Sigma, same share_key (a Conv1D and a Linear
    reading one tensor have the same statistics); only the gradient's layout differs."""

    def input_dim(self) -> int:
        return self.module.weight.shape[0]  # nx

    def grad_matrix(self):
        g = self._grad(self.module.weight)  # (in, out)
        return None if g is None else self._with_bias_column(g.T)

    def set_grad(self, m: Tensor) -> None:
        self._grad(self.module.weight).copy_(self._split_bias_column(m).T)

    def grad_shape(self) -> tuple:
        g = self._grad(self.module.weight)   # (in, out)
        return (g.shape[1], g.shape[0] + int(self.homogeneous))

    def grad_parts(self):   # the weight's gradient is G transposed: read and written layer by layer
        return None

    def read_grad(self, out: Tensor) -> None:
        out.copy_(self.grad_matrix())
