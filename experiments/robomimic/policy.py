"""The flow policy: observation encoder + ChiUNet velocity, trained by flow matching on action chunks.

A batch is ``{"obs": {key: (B, To, ...)}, "actions": (B, H, A)}`` as ``data.RobomimicDataset``
yields it: images uint8 (B, To, 3, H, W), low-dim and actions normalised (``normalizer.py``).
``act`` turns raw environment observations into the executed actions of a chunk: normalise the
low-dim keys, encode, integrate the flow with ``sample_steps`` Euler steps, unnormalise, map the
6-D rotations back to axis-angle, and keep steps ``To - 1 .. To - 2 + action_steps`` of the
horizon (much-ado-about-noising ``examples/train_robomimic.py`` ``eval``: ``start = obs_steps - 1``,
``end = start + act_steps``; diffusion_policy does the same).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from . import flow
from .encoder import ObservationEncoder
from .model import ChiUNet
from .rotation import actions_from_rotation_6d


class FlowPolicy(nn.Module):
    def __init__(self, cameras: Sequence[str], low_dim: Mapping[str, int], action_dim: int, horizon: int = 16,
                 obs_steps: int = 2, action_steps: int = 8, encoder: Mapping | None = None,
                 unet: Mapping | None = None, loss_scale: float = 0.1, sample_start: str = "zero") -> None:
        super().__init__()
        if not 1 <= action_steps <= horizon - obs_steps + 1:
            raise ValueError(f"action_steps must be in [1, horizon - obs_steps + 1] = [1, {horizon - obs_steps + 1}],"
                             f" got {action_steps}")
        self.encoder = ObservationEncoder(cameras, low_dim, obs_steps, **dict(encoder or {}))
        self.unet = ChiUNet(action_dim, self.encoder.cond_dim, **dict(unet or {}))
        if horizon % self.unet.horizon_multiple:
            raise ValueError(f"horizon {horizon} must be divisible by {self.unet.horizon_multiple} "
                             "(ChiUNet's down/upsampling); the anchors round robomimic's 10 up to 16")
        self.action_dim, self.horizon = action_dim, horizon
        self.obs_steps, self.action_steps = obs_steps, action_steps
        self.loss_scale, self.sample_start = loss_scale, sample_start

    def loss(self, batch: Mapping, generator: torch.Generator | None = None) -> Tensor:
        cond = self.encoder(batch["obs"], generator)
        return flow.loss(self.unet, batch["actions"], cond, generator, self.loss_scale)

    @torch.no_grad()
    def sample(self, obs: Mapping[str, Tensor], steps: int, generator: torch.Generator | None = None) -> Tensor:
        """Normalised action chunks (B, H, A) for normalised observations."""
        cond = self.encoder(obs)
        return flow.sample(self.unet, cond, steps, (cond.shape[0], self.horizon, self.action_dim),
                           generator, self.sample_start)


class PolicyRunner:
    """``runner(obs) -> actions``: numpy observation stacks from the environments ({key: (N, To, ...)},
    images uint8 (N, To, 3, H, W)) to the executed absolute actions (N, action_steps, 7 per arm)."""

    def __init__(self, policy: FlowPolicy, normalizer, steps: int, device, rotation_6d: bool = True) -> None:
        self.policy, self.normalizer, self.steps = policy, normalizer, steps
        self.device, self.rotation_6d = torch.device(device), rotation_6d
        self.calls = 0

    def __call__(self, obs: Mapping[str, np.ndarray]) -> np.ndarray:
        self.calls += 1
        batch = {}
        for key, value in obs.items():
            x = torch.as_tensor(np.ascontiguousarray(value), device=self.device)
            if key in self.policy.encoder.low_dim:
                x = self.normalizer[key].normalize(x.float())
            batch[key] = x
        was_training = self.policy.training
        self.policy.eval()
        try:
            chunk = self.policy.sample(batch, self.steps)
        finally:
            self.policy.train(was_training)
        chunk = self.normalizer["actions"].unnormalize(chunk).float().cpu()
        start = self.policy.obs_steps - 1
        chunk = chunk[:, start:start + self.policy.action_steps]
        if self.rotation_6d:
            chunk = actions_from_rotation_6d(chunk)
        return np.asarray(chunk, dtype=np.float64)
