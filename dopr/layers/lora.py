"""peft's LoRA on a half-precision base: lora_A of ``peft.tuners.lora.layer.Linear`` (matched by name).

peft keeps the adapters in float32 on a bf16 (or fp16) model and computes ``lora_B(lora_A(dropout(x.to(float32))))``:
lora_A's input is float32, yet each entry is ``c`` times a value of the base's dtype (c = 1 / (1 - p) under a
training dropout, else 1). This helper hands the statistics that scale and dtype, so that Sigma is formed from the
half-precision values where the device's GEMM accumulates them in float32
(statistics.DenseCovariance.from_scaled_activations), not by a float32 GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..statistics import DenseCovariance
from .linear import LinearHelper

#: peft's LoRA layer on an nn.Linear base (its forward casts the input to lora_A's dtype, then dropout)
PEFT_LORA_LINEAR = "peft.tuners.lora.layer.Linear"
_HALF = (torch.bfloat16, torch.float16)


def lora_inputs(model: nn.Module) -> dict:
    """{id(lora_A module): (its LoRA layer, adapter name)} for every peft LoRA layer on an nn.Linear base."""
    out = {}
    for layer in model.modules():
        if f"{type(layer).__module__}.{type(layer).__qualname__}" != PEFT_LORA_LINEAR:
            continue
        if isinstance(layer.get_base_layer(), nn.Linear):
            out.update({id(a): (layer, adapter) for adapter, a in layer.lora_A.items()})
    return out


class LoraInputHelper(LinearHelper):
    """lora_A of a peft LoRA layer: a Linear whose input may be a half-precision tensor cast up (see above)."""

    def __init__(self, module: nn.Module, name: str, homogeneous: bool, layer: nn.Module, adapter: str) -> None:
        super().__init__(module, name, homogeneous)
        self.layer, self.adapter = layer, adapter

    def upcast(self) -> Optional[tuple]:
        """(source dtype, c) when lora_A's float32 input is c times values of the base's half-precision dtype;
        None otherwise. Outside autocast the base's GEMM takes only its weight's dtype, so the layer's input
        is in it; under autocast on a device that forms Sigma in half precision the capture has already
        cast the input as lora_A's autocast GEMM does (capture._as_multiplied), and it is not float32 here."""
        layer = self.layer
        if (self.adapter in getattr(layer, "lora_variant", {}) or not getattr(layer, "cast_input_dtype_enabled", True)
                or self.module.weight.dtype is not torch.float32):
            return None
        source = layer.get_base_layer().weight.dtype
        if source not in _HALF:
            return None
        dropout = layer.lora_dropout[self.adapter]
        if isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and not dropout.training):
            return source, 1.0
        if isinstance(dropout, nn.Dropout) and dropout.p < 1:
            return source, 1.0 / (1.0 - dropout.p)   # F.dropout: x * mask * (1 / (1 - p)), 1 at p = 0
        return None

    def statistics(self, x: Tensor, kind: type):
        up = self.upcast() if x.dtype is torch.float32 and issubclass(kind, DenseCovariance) else None
        if up is None:
            return super().statistics(x, kind)
        return kind.from_scaled_activations(self.activations(x), self.homogeneous, *up)

