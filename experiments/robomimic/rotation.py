"""Rotation conversions for absolute robomimic actions: axis-angle <-> matrix <-> 6-D rotation.

Where each convention comes from (repository: file):

- real-stanford/diffusion_policy, ``diffusion_policy/model/common/rotation_transformer.py``
  ``RotationTransformer(from_rep="axis_angle", to_rep="rotation_6d")`` with the functions of
  ``rotation_conversions.py`` (a copy of facebookresearch/pytorch3d
  ``pytorch3d/transforms/rotation_conversions.py``): the 6-D representation of Zhou et al. (2019,
  "On the Continuity of Rotation Representations in Neural Networks") is the first two ROWS of the
  rotation matrix, [R00, R01, R02, R10, R11, R12]; back to a matrix by Gram-Schmidt on those two
  rows, the third row their cross product.
- same, ``diffusion_policy/dataset/robomimic_replay_image_dataset.py`` ``_convert_actions`` and
  simchowitzlabpublic/much-ado-about-noising ``mip/datasets/robomimic_dataset.py`` (same function
  and ``undo_transform_action``): an absolute robomimic action is, per arm, [position (3),
  axis-angle (3), gripper (1)]; two-arm tasks (Transport) concatenate the arms (14 numbers). The
  6-D action is per arm [position (3), rotation_6d (6), gripper (1)], arms concatenated (10 or 20).
- robosuite / robomimic axis-angle: the rotation vector angle * unit axis (``T.quat2axisangle``);
  this module returns angles in [0, pi].

The axis-angle <-> matrix maps are written here without quaternion round trips in the forward
direction: Rodrigues' formula with the Taylor series of sin(t)/t and (1 - cos t)/t^2 below
|t| < 1e-4 (exact to float64 rounding there). The inverse goes through a unit quaternion picked by
Shepperd's rule (the largest of |w|, |x|, |y|, |z| is computed from the diagonal, the rest from the
off-diagonals), so it stays accurate near angle 0 and near pi, where acos((trace - 1) / 2) loses
half of its digits; the angle is 2 atan2(|v|, w) with w >= 0.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

#: numbers per arm in a robomimic absolute action and in its 6-D rotation form
AXIS_ANGLE_ACTION_DIM = 7
ROTATION_6D_ACTION_DIM = 10

_SMALL_ANGLE = 1e-4


def _skew(v: Tensor) -> Tensor:
    """(..., 3) -> (..., 3, 3), the matrix of v x (.)."""
    x, y, z = v.unbind(-1)
    zero = torch.zeros_like(x)
    return torch.stack([zero, -z, y, z, zero, -x, -y, x, zero], dim=-1).reshape(*v.shape[:-1], 3, 3)


def axis_angle_to_matrix(axis_angle: Tensor) -> Tensor:
    """(..., 3) rotation vectors -> (..., 3, 3) rotation matrices (Rodrigues:
    R = I + sin(t)/t K + (1 - cos t)/t^2 K^2, K = skew(axis_angle), t = |axis_angle|)."""
    angle = torch.linalg.vector_norm(axis_angle, dim=-1, keepdim=True)[..., None]  # (..., 1, 1)
    small = angle < _SMALL_ANGLE
    safe = torch.where(small, torch.ones_like(angle), angle)
    t2 = angle * angle
    a = torch.where(small, 1 - t2 / 6 + t2 * t2 / 120, torch.sin(safe) / safe)
    b = torch.where(small, 0.5 - t2 / 24 + t2 * t2 / 720, (1 - torch.cos(safe)) / (safe * safe))
    k = _skew(axis_angle)
    eye = torch.eye(3, dtype=axis_angle.dtype, device=axis_angle.device)
    return eye + a * k + b * (k @ k)


def matrix_to_quaternion(matrix: Tensor) -> Tensor:
    """(..., 3, 3) -> (..., 4) unit quaternions (w, x, y, z) with w >= 0 (Shepperd's rule)."""
    m = matrix
    m00, m11, m22 = m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]
    # 4 w^2, 4 x^2, 4 y^2, 4 z^2 from the diagonal
    squares = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1)
    # off-diagonal combinations: 4 w x, 4 w y, 4 w z, 4 x y, 4 x z, 4 y z
    wx, wy, wz = m[..., 2, 1] - m[..., 1, 2], m[..., 0, 2] - m[..., 2, 0], m[..., 1, 0] - m[..., 0, 1]
    xy, xz, yz = m[..., 0, 1] + m[..., 1, 0], m[..., 0, 2] + m[..., 2, 0], m[..., 1, 2] + m[..., 2, 1]
    best = squares.argmax(dim=-1, keepdim=True)
    # candidate i holds 4 q_i * q, so dividing by 2 sqrt(4 q_i^2) = 4 |q_i| gives q up to sign
    candidates = torch.stack([
        torch.stack([squares[..., 0], wx, wy, wz], -1),
        torch.stack([wx, squares[..., 1], xy, xz], -1),
        torch.stack([wy, xy, squares[..., 2], yz], -1),
        torch.stack([wz, xz, yz, squares[..., 3]], -1),
    ], dim=-2)  # (..., 4 candidates, 4)
    chosen = torch.gather(candidates, -2, best[..., None].expand(*best.shape[:-1], 1, 4)).squeeze(-2)
    q = chosen / (2 * torch.gather(squares, -1, best).clamp_min(1e-30).sqrt())
    q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    return torch.where(q[..., :1] < 0, -q, q)


def quaternion_to_axis_angle(quaternion: Tensor) -> Tensor:
    """(..., 4) quaternions (w, x, y, z) -> (..., 3) rotation vectors with angle in [0, pi]."""
    q = torch.where(quaternion[..., :1] < 0, -quaternion, quaternion)
    w, v = q[..., :1], q[..., 1:]
    sin_half = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    half = torch.atan2(sin_half, w)
    # angle / sin(half) = 2 half / sin(half); its series 2 (1 + half^2 / 6) where sin(half) is ~0
    small = sin_half < _SMALL_ANGLE
    safe = torch.where(small, torch.ones_like(sin_half), sin_half)
    norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    factor = torch.where(small, 2 * (1 + half * half / 6) / norm, 2 * half / safe)
    return v * factor


def matrix_to_axis_angle(matrix: Tensor) -> Tensor:
    """(..., 3, 3) rotation matrices -> (..., 3) rotation vectors, angle in [0, pi]."""
    return quaternion_to_axis_angle(matrix_to_quaternion(matrix))


def matrix_to_rotation_6d(matrix: Tensor) -> Tensor:
    """(..., 3, 3) -> (..., 6): the first two rows, [R00, R01, R02, R10, R11, R12] (pytorch3d)."""
    return matrix[..., :2, :].reshape(*matrix.shape[:-2], 6).clone()


def rotation_6d_to_matrix(rotation_6d: Tensor) -> Tensor:
    """(..., 6) -> (..., 3, 3): Gram-Schmidt on the two rows a, b: r0 = a / |a|,
    r1 = (b - <r0, b> r0) / |.|, r2 = r0 x r1; rows (r0, r1, r2). Any 6 numbers with a and b
    linearly independent give a proper rotation."""
    a, b = rotation_6d[..., :3], rotation_6d[..., 3:]
    r0 = torch.nn.functional.normalize(a, dim=-1)
    r1 = torch.nn.functional.normalize(b - (r0 * b).sum(-1, keepdim=True) * r0, dim=-1)
    r2 = torch.linalg.cross(r0, r1, dim=-1)
    return torch.stack([r0, r1, r2], dim=-2)


def axis_angle_to_rotation_6d(axis_angle: Tensor) -> Tensor:
    """(..., 3) -> (..., 6)."""
    return matrix_to_rotation_6d(axis_angle_to_matrix(axis_angle))


def rotation_6d_to_axis_angle(rotation_6d: Tensor) -> Tensor:
    """(..., 6) -> (..., 3), angle in [0, pi]."""
    return matrix_to_axis_angle(rotation_6d_to_matrix(rotation_6d))


# ---------------------------------------------------------------------------------------- actions
def _as_tensor(actions) -> tuple[Tensor, bool]:
    if isinstance(actions, np.ndarray):
        return torch.from_numpy(np.asarray(actions)), True
    if isinstance(actions, Tensor):
        return actions, False
    raise TypeError(f"actions must be a numpy array or a torch tensor, got {type(actions).__name__}")


def _arms(x: Tensor, per_arm: int, what: str) -> int:
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % per_arm:
        raise ValueError(f"{what} actions need a last dimension that is a positive multiple of {per_arm} "
                         f"({per_arm} numbers per arm), got shape {tuple(x.shape)}")
    return x.shape[-1] // per_arm


def actions_to_rotation_6d(actions):
    """Absolute actions (..., 7 k) per arm [pos 3, axis-angle 3, gripper 1] -> (..., 10 k) per arm
    [pos 3, rotation_6d 6, gripper 1]. A numpy array in gives a numpy array out (same dtype)."""
    x, was_numpy = _as_tensor(actions)
    arms = _arms(x, AXIS_ANGLE_ACTION_DIM, "axis-angle")
    if not x.is_floating_point():
        x = x.double()
    x = x.reshape(*x.shape[:-1], arms, AXIS_ANGLE_ACTION_DIM)
    out = torch.cat([x[..., :3], axis_angle_to_rotation_6d(x[..., 3:6]), x[..., 6:]], dim=-1)
    out = out.reshape(*out.shape[:-2], arms * ROTATION_6D_ACTION_DIM)
    return out.numpy() if was_numpy else out


def actions_from_rotation_6d(actions):
    """The inverse of ``actions_to_rotation_6d``: (..., 10 k) -> (..., 7 k), axis-angle with angle in
    [0, pi] (the 6-D part need not be orthonormal: Gram-Schmidt projects it to a rotation)."""
    x, was_numpy = _as_tensor(actions)
    arms = _arms(x, ROTATION_6D_ACTION_DIM, "rotation-6d")
    if not x.is_floating_point():
        x = x.double()
    x = x.reshape(*x.shape[:-1], arms, ROTATION_6D_ACTION_DIM)
    out = torch.cat([x[..., :3], rotation_6d_to_axis_angle(x[..., 3:9]), x[..., 9:]], dim=-1)
    out = out.reshape(*out.shape[:-2], arms * AXIS_ANGLE_ACTION_DIM)
    return out.numpy() if was_numpy else out


def rotation_6d_action_dims(action_dim: int) -> list[int]:
    """The indices of the rotation_6d entries in a (.., action_dim) 6-D action: 3..8 of every arm."""
    if action_dim <= 0 or action_dim % ROTATION_6D_ACTION_DIM:
        raise ValueError(f"a rotation-6d action has 10 numbers per arm, got action_dim {action_dim}")
    return [arm * ROTATION_6D_ACTION_DIM + i for arm in range(action_dim // ROTATION_6D_ACTION_DIM)
            for i in range(3, 9)]
