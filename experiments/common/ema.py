"""The weights EMA: a frozen copy of the model whose parameters follow the trained ones,
theta_ema <- decay * theta_ema + (1 - decay) * theta after every optimizer step (buffers copied)."""
from __future__ import annotations

import copy

import torch
from torch import nn


class WeightEMA:
    """``ema = WeightEMA(model, decay)`` before the optimizer hooks the model (a deep copy of a model
    with DoPr's forward hooks attached would carry inert copies of them); ``ema.update()`` after each
    step; ``ema.module`` is the averaged model to evaluate. ``state_dict`` / ``load_state_dict`` for
    checkpoints."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"Invalid EMA decay: {decay} (must be in [0, 1]; 1 keeps the initial weights)")
        self.decay = float(decay)
        self.source = model
        self.module = copy.deepcopy(model).requires_grad_(False)
        self._params = list(model.parameters())
        self._ema_params = list(self.module.parameters())
        self._buffers = list(model.buffers())
        self._ema_buffers = list(self.module.buffers())

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self._ema_params, self._params, 1.0 - self.decay)
        for b, src in zip(self._ema_buffers, self._buffers):
            b.copy_(src)

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)
