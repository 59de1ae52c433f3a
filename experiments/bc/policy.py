"""The BC policy: a residual MLP (table "State-based IL Network Architecture": hidden [256, 256], ReLU)
with the observation normalisation of the demonstrations folded in as buffers."""
from __future__ import annotations

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """h_1 = relu(W_1 x~), h_k = h_{k-1} + relu(W_k h_{k-1}) for k >= 2, a = W_out h_K, with
    x~ = (x - mean) / std the normalised observation, clamped to [-obs_clip, obs_clip] when obs_clip is set."""

    def __init__(self, obs_dim: int, act_dim: int, hidden=(256, 256), obs_clip: float | None = None):
        super().__init__()
        if obs_clip is not None and not obs_clip > 0:
            raise ValueError(f"obs_clip must be a positive number of standard deviations or None, got {obs_clip}")
        self.obs_clip = None if obs_clip is None else float(obs_clip)
        hidden = list(hidden)
        if len(hidden) < 1 or any(h != hidden[0] for h in hidden):
            raise ValueError(f"hidden must be one width repeated (residual connections), got {hidden}")
        self.inp = nn.Linear(obs_dim, hidden[0])
        self.blocks = nn.ModuleList(nn.Linear(hidden[0], hidden[0]) for _ in hidden[1:])
        self.out = nn.Linear(hidden[0], act_dim)
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_std", torch.ones(obs_dim))

    def set_normalization(self, observations: torch.Tensor, min_std: float = 1e-6) -> None:
        """Mean and std per coordinate; constant coordinates (std < min_std) are only centred."""
        self.obs_mean.copy_(observations.mean(0))
        std = observations.std(0)
        self.obs_std.copy_(torch.where(std < min_std, torch.ones_like(std), std))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = (obs - self.obs_mean) / self.obs_std
        if self.obs_clip is not None:
            x = x.clamp(-self.obs_clip, self.obs_clip)
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)
