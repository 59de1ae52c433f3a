"""Per-feature affine normalisation y = scale * x + offset, fitted on the training split.

Where each choice comes from (repository: file):

- real-stanford/diffusion_policy, ``diffusion_policy/common/normalize_util.py``
  ``get_range_normalizer_from_stat``: min-max to [-1, 1] per feature, scale = 2 / (max - min),
  offset = -1 - scale * min; a feature whose range is below ``range_eps`` = 1e-7 (a constant one)
  gets scale 1 and is shifted so that its value maps to 0, never a division by zero.
  ``get_identity_normalizer_from_stat``: scale 1, offset 0.
- same, ``robomimic_abs_action_only_normalizer_from_stat`` (used by
  ``diffusion_policy/dataset/robomimic_replay_image_dataset.py`` ``get_normalizer`` with
  abs_action): absolute 6-D actions are min-maxed on the position and left as they are on the
  rotation_6d entries (already in [-1, 1], and a rescaling would break their unit-norm rows); the
  dual-arm variant does the same per arm. diffusion_policy also leaves the gripper as it is; here
  the gripper is min-maxed, which is the identity when the demos hold both of robomimic's gripper
  commands -1 and +1 (every PH dataset does) and maps it into [-1, 1] otherwise.
- same, ``get_normalizer``: low-dim observations whose key ends in ``pos`` or ``qpos`` are min-maxed,
  keys ending in ``quat`` are left as they are ("quaternion is in [-1,1] already"); this module
  follows that rule (``IDENTITY_SUFFIXES``) and min-maxes every other low-dim key.
- simchowitzlabpublic/much-ado-about-noising, ``mip/dataset_utils.py`` ``MinMaxNormalizer``, the
  pipeline the paper inherits, min-maxes every action and low-dim feature, the rotation_6d and
  quaternion entries included, and maps a constant feature to -1. The 6-D identity above is
  diffusion_policy's choice (much-ado reproduces its robomimic results); ``Normalizer.fit(x)`` without identity_dims gives much-ado's map (up to the constant
  feature landing on 0 instead of -1). ``RobomimicDataset(normalization=...)`` picks one:
  "much_ado" (the default: the paper inherits that pipeline) or "diffusion_policy".

Images are not normalised here: the encoder maps uint8 to [-1, 1] (``encoder.py``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

#: low-dim observation keys with these endings are not rescaled (diffusion_policy get_normalizer)
IDENTITY_SUFFIXES = ("quat",)


def _tensor(x) -> Tensor:
    return torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)


class Normalizer:
    """y = scale * x + offset per feature (the last dimension); x any leading dimensions."""

    def __init__(self, scale, offset) -> None:
        self.scale = _tensor(scale).detach().to(torch.float64).cpu().reshape(-1)
        self.offset = _tensor(offset).detach().to(torch.float64).cpu().reshape(-1)
        if self.scale.shape != self.offset.shape:
            raise ValueError(f"scale and offset must have the same shape, got {tuple(self.scale.shape)} "
                             f"and {tuple(self.offset.shape)}")
        if not torch.isfinite(self.scale).all() or (self.scale == 0).any() or not torch.isfinite(self.offset).all():
            raise ValueError("scale must be finite and nonzero and offset finite")

    @classmethod
    def fit(cls, x, identity_dims: Iterable[int] = (), range_eps: float = 1e-7) -> Normalizer:
        """Min-max to [-1, 1] per feature over every leading dimension of x (..., D); the features in
        ``identity_dims`` get scale 1, offset 0; a feature with max - min < range_eps gets scale 1 and
        maps its value to 0."""
        data = _tensor(x).detach().to(torch.float64).reshape(-1, _tensor(x).shape[-1])
        if data.shape[0] == 0:
            raise ValueError("cannot fit a normalizer on zero samples")
        if not torch.isfinite(data).all():
            raise ValueError("cannot fit a normalizer on data with NaN or infinite values")
        low, high = data.min(dim=0).values, data.max(dim=0).values
        width = high - low
        constant = width < range_eps
        scale = torch.where(constant, torch.ones_like(width), 2.0 / torch.where(constant, torch.ones_like(width), width))
        offset = torch.where(constant, -low, -1.0 - scale * low)
        identity = torch.zeros_like(constant)
        dims = list(identity_dims)
        if dims:
            if max(dims) >= len(width) or min(dims) < -len(width):
                raise ValueError(f"identity_dims {dims} out of range for {len(width)} features")
            identity[dims] = True
        scale = torch.where(identity, torch.ones_like(scale), scale)
        offset = torch.where(identity, torch.zeros_like(offset), offset)
        return cls(scale, offset)

    @classmethod
    def identity(cls, dim: int) -> Normalizer:
        return cls(torch.ones(dim), torch.zeros(dim))

    @property
    def dim(self) -> int:
        return self.scale.numel()

    def _params(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if x.shape[-1] != self.dim:
            raise ValueError(f"this normalizer has {self.dim} features, got shape {tuple(x.shape)}")
        dtype = x.dtype if x.is_floating_point() else torch.float32
        return self.scale.to(device=x.device, dtype=dtype), self.offset.to(device=x.device, dtype=dtype)

    def normalize(self, x: Tensor) -> Tensor:
        scale, offset = self._params(x)
        return x * scale + offset

    def unnormalize(self, x: Tensor) -> Tensor:
        scale, offset = self._params(x)
        return (x - offset) / scale

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "offset": self.offset.clone()}

    def load_state_dict(self, state: Mapping) -> None:
        loaded = Normalizer(state["scale"], state["offset"])
        self.scale, self.offset = loaded.scale, loaded.offset

    @classmethod
    def from_state_dict(cls, state: Mapping) -> Normalizer:
        return cls(state["scale"], state["offset"])

    def __repr__(self) -> str:
        return f"Normalizer(dim={self.dim})"


class NormalizerDict(dict):
    """{name: Normalizer}, e.g. {"actions": ..., "robot0_eef_pos": ...}; saved and loaded as one."""

    def state_dict(self) -> dict:
        return {key: value.state_dict() for key, value in self.items()}

    def load_state_dict(self, state: Mapping) -> None:
        self.clear()
        self.update({key: Normalizer.from_state_dict(value) for key, value in state.items()})

    @classmethod
    def from_state_dict(cls, state: Mapping) -> NormalizerDict:
        out = cls()
        out.load_state_dict(state)
        return out


def fit_low_dim(key: str, x) -> Normalizer:
    """A low-dim observation's normalizer: identity for keys ending in IDENTITY_SUFFIXES, else min-max."""
    if key.endswith(IDENTITY_SUFFIXES):
        return Normalizer.identity(_tensor(x).shape[-1])
    return Normalizer.fit(x)
