"""`rehearse=true` for the image-policy tasks: the paper-size flow policy (ChiUNet + one ResNet-18 per
camera) built from the task config alone (no dataset), one synthetic batch of the real shapes (uint8
frames at task.image_size for every camera, the low-dim keys, absolute actions with 6-D rotations
for every arm), the job's optimizer and gradient clipping (experiments/common/rehearsal.py)."""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from ..common.rehearsal import rehearse
from .policy import FlowPolicy

#: robosuite's low-dim observation sizes by key suffix (robot0_eef_pos -> eef_pos)
LOW_DIM_SIZES = {"eef_pos": 3, "eef_quat": 4, "gripper_qpos": 2}


def shapes(t) -> tuple:
    """({low-dim key: size}, action size) of the task's files: per arm 3 + 6 + 1 (rotation_6d) or 3 + 3 + 1."""
    unknown = [k for k in t.low_dim if k.split("_", 1)[1] not in LOW_DIM_SIZES]
    if unknown:
        raise ValueError(f"rehearsal: no known size for the low-dim keys {unknown} (known: {list(LOW_DIM_SIZES)})")
    arms = len({k.split("_", 1)[0] for k in t.low_dim})
    return {k: LOW_DIM_SIZES[k.split("_", 1)[1]] for k in t.low_dim}, arms * (10 if t.rotation_6d else 7)


def synthetic_batch(t, batch: int, low_dim: dict, action_dim: int) -> dict:
    size = int(t.image_size)
    obs = {k: torch.randint(0, 256, (batch, t.obs_steps, 3, size, size), dtype=torch.uint8) for k in t.cameras}
    obs.update({k: torch.randn(batch, t.obs_steps, d) for k, d in low_dim.items()})
    return {"obs": obs, "actions": torch.randn(batch, t.horizon, action_dim)}


def paper_policy(t, low_dim: dict, action_dim: int) -> FlowPolicy:
    return FlowPolicy(list(t.cameras), low_dim, action_dim, t.horizon, t.obs_steps, t.action_steps,
                      encoder=OmegaConf.to_container(t.encoder, resolve=True),
                      unet=OmegaConf.to_container(t.unet, resolve=True), loss_scale=t.loss_scale,
                      sample_start=t.sample_start)


def run(cfg, run) -> dict:
    t = cfg.task
    low_dim, action_dim = shapes(t)
    torch.manual_seed(int(cfg.seed))
    policy = paper_policy(t, low_dim, action_dim).to(run.device)
    batch = {k: (v.to(run.device) if torch.is_tensor(v) else {j: x.to(run.device) for j, x in v.items()})
             for k, v in synthetic_batch(t, int(t.rehearsal.batch), low_dim, action_dim).items()}

    def loss():   # the same flow times, noise and crops every step: a repeated batch
        return policy.loss(batch, torch.Generator(device=run.device).manual_seed(0))

    name = f"ChiUNet {t.unet.model_dim} + ResNet-18 x {len(t.cameras)}, {t.image_size}px"
    return rehearse(cfg, run, policy, loss, name, int(t.rehearsal.batch), clip=t.grad_clip_norm)
