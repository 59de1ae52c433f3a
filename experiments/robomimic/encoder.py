"""The observation encoder: one GroupNorm ResNet-18 per camera plus proprioception, over To steps.

Where each value comes from (repository: file):

- simchowitzlabpublic/much-ado-about-noising, ``mip/encoders.py`` ``MultiImageObsEncoder`` (a port
  of real-stanford/diffusion_policy ``diffusion_policy/model/vision/multi_image_obs_encoder.py``):
  one ResNet-18 per camera (share_rgb_model false); torchvision's fc replaced by the identity
  (``get_resnet``, as diffusion_policy's ``model/vision/model_getter.py``), so a camera's feature is
  the global average pool of the last stage, 512 numbers; every BatchNorm2d replaced by GroupNorm
  with channels // 16 groups (use_group_norm); camera keys and low-dim keys each in sorted order;
  per step [camera features, low-dim] -> Linear(., emb_dim), LeakyReLU, Linear(emb_dim, emb_dim).
- same, ``examples/configs/network/_base.yaml`` and ``chiunet.yaml``: rgb_model_name resnet18,
  use_seq and keep_horizon_dims true (the To steps are encoded independently by the same networks
  and stacked to (B, To, emb_dim); ChiUNet then flattens them step-major to (B, To * emb_dim)),
  emb_dim 256 (the feature dimension per step).
- same, ``examples/configs/task/robomimic_base.yaml``: obs_steps To = 2, crop_shape [76, 76] of
  the 84 x 84 images, random_crop true, use_group_norm true; no resize.
- same, ``mip/datasets/robomimic_dataset.py`` and ``mip/dataset_utils.py`` ``ImageNormalizer``:
  uint8 / 255, then 2x - 1, so the ResNet sees [-1, 1]; no ImageNet normalisation
  (imagenet_norm false) and no pretrained weights (weights None).
- ARISE-Initiative/robomimic, ``robomimic/models/obs_core.py`` ``CropRandomizer`` and
  ``robomimic/utils/obs_utils.py`` (copied by diffusion_policy's ``model/vision/crop_randomizer.py``
  and by much-ado): in training one random crop per image, independently per sample, step and
  camera, top-left offset floor(u * (H - h)), u ~ U[0, 1), so in {0, ..., H - h - 1} (offset H - h
  is never drawn); in eval the center crop, offset (H - h) // 2 (obs_utils.center_crop; torchvision's
  center_crop, which much-ado calls, rounds instead: the same 4 for 84 -> 76).
- torchvision ``resnet18`` (what get_resnet builds): 7x7 stride-2 stem without bias, 3x3 stride-2
  max pool, BasicBlocks [2, 2, 2, 2] of widths 64, 128, 256, 512 and strides 1, 2, 2, 2, 1x1
  projection shortcuts, kaiming-normal (fan_out, relu) convolution weights.

Pooling: robomimic's own visual core (``robomimic/models/obs_core.py`` VisualCore with
``base_nets.py`` ResNet18Conv + SpatialSoftmax, 32 keypoints, then Linear to 64), which
diffusion_policy's hybrid image policy reuses, pools with spatial-softmax keypoints. much-ado, the
pipeline the paper inherits, uses global average pooling, and so does this encoder.

Cameras per task (much-ado's task configs): tool_hang_ph_image ``sideview_image``,
``robot0_eye_in_hand_image`` with low-dim robot0_eef_pos (3), robot0_eef_quat (4),
robot0_gripper_qpos (2); transport_ph_image ``shouldercamera0_image``, ``shouldercamera1_image``,
``robot0_eye_in_hand_image``, ``robot1_eye_in_hand_image`` with both arms' low-dim (18); lift, can
and square ``agentview_image``, ``robot0_eye_in_hand_image``.

``width`` scales the ResNet widths (64 is ResNet-18) so a CPU-sized variant exists; GroupNorm
uses max(1, channels // 16) groups.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from dopr.gp import mark_role


# ---------------------------------------------------------------------------------- random crop
def center_crop(images: Tensor, size: Sequence[int]) -> Tensor:
    """(..., C, H, W) -> (..., C, h, w), top-left offset ((H - h) // 2, (W - w) // 2)."""
    h, w = size
    top, left = (images.shape[-2] - h) // 2, (images.shape[-1] - w) // 2
    return images[..., top:top + h, left:left + w]


def random_crop(images: Tensor, size: Sequence[int], generator: torch.Generator | None = None) -> Tensor:
    """(N, C, H, W) -> (N, C, h, w): each image its own window, top-left offset floor(u * (H - h))."""
    n, c, height, width = images.shape
    h, w = size
    u = torch.rand(2, n, generator=generator, device=images.device)
    top = (u[0] * (height - h)).long()
    left = (u[1] * (width - w)).long()
    rows = (top[:, None] + torch.arange(h, device=images.device))[:, None, :, None]   # (N, 1, h, 1)
    cols = (left[:, None] + torch.arange(w, device=images.device))[:, None, None, :]  # (N, 1, 1, w)
    sample = torch.arange(n, device=images.device)[:, None, None, None]
    channel = torch.arange(c, device=images.device)[None, :, None, None]
    return images[sample, channel, rows, cols]


class RandomCrop(nn.Module):
    """Training: a random (h, w) window per image; eval: the center window."""

    def __init__(self, size: Sequence[int]) -> None:
        super().__init__()
        self.size = tuple(int(s) for s in size)

    def forward(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if images.shape[-2] < self.size[0] or images.shape[-1] < self.size[1]:
            raise ValueError(f"images of size {tuple(images.shape[-2:])} are smaller than the crop {self.size}")
        if self.training:
            return random_crop(images, self.size, generator)
        return center_crop(images, self.size)


# ------------------------------------------------------------------------------ ResNet-18 (GN)
def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(max(1, channels // 16), channels)


class BasicBlock(nn.Module):
    """relu(GN(conv3x3(relu(GN(conv3x3_stride(x))))) + shortcut(x)); shortcut 1x1 conv + GN when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _norm(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          _norm(out_channels))

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        return self.relu(h + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 with GroupNorm, globally average-pooled: (N, C, H, W) -> (N, 8 * width)."""

    def __init__(self, width: int = 64, in_channels: int = 3) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be a positive number of channels, got {width}")
        widths = [width, 2 * width, 4 * width, 8 * width]
        # the stem conv reads the camera's pixels: an input layer, in every camera's encoder
        stem = mark_role(nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False), "input")
        self.stem = nn.Sequential(stem, _norm(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages, c_in = [], width
        for i, c_out in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(c_in, c_out, 1 if i == 0 else 2), BasicBlock(c_out, c_out, 1)))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_features = widths[-1]
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        return self.pool(self.stages(self.stem(images))).flatten(1)


# ------------------------------------------------------------------------- observation encoder
class ObservationEncoder(nn.Module):
    """obs -> (B, To * feature_dim), the ``cond`` of ChiUNet.

    ``obs`` maps every camera key to images (B, To, C, H, W), uint8 in [0, 255] or floating point
    in [0, 1] (both are mapped to [-1, 1] here, as much-ado's ImageNormalizer does), and every
    low-dim key to (B, To, d) already normalised by the data pipeline. Per step and camera: crop
    (random in training, center in eval), ResNet-18; then [camera features (sorted keys), low-dim
    (sorted keys)] -> Linear, LeakyReLU, Linear -> feature_dim; the To steps are flattened in order.
    """

    def __init__(self, cameras: Sequence[str], low_dim: Mapping[str, int], obs_steps: int = 2,
                 feature_dim: int = 256, width: int = 64, crop: Sequence[int] = (76, 76)) -> None:
        super().__init__()
        if not cameras:
            raise ValueError("at least one camera key is needed")
        self.cameras = sorted(cameras)
        self.low_dim = {k: int(low_dim[k]) for k in sorted(low_dim)}
        self.obs_steps = obs_steps
        self.feature_dim = feature_dim
        self.crop = RandomCrop(crop)
        self.backbones = nn.ModuleDict({k: ResNet18(width) for k in self.cameras})
        per_step = len(self.cameras) * 8 * width + sum(self.low_dim.values())
        self.mlp = nn.Sequential(nn.Linear(per_step, feature_dim), nn.LeakyReLU(), nn.Linear(feature_dim, feature_dim))

    @property
    def cond_dim(self) -> int:
        return self.obs_steps * self.feature_dim

    @staticmethod
    def normalize_images(images: Tensor) -> Tensor:
        """uint8 [0, 255] or float [0, 1] -> float [-1, 1]."""
        if images.dtype == torch.uint8:
            images = images.float() / 255.0
        return images * 2.0 - 1.0

    def forward(self, obs: Mapping[str, Tensor], generator: torch.Generator | None = None) -> Tensor:
        first = obs[self.cameras[0]]
        batch, steps = first.shape[:2]
        if steps != self.obs_steps:
            raise ValueError(f"expected {self.obs_steps} observation steps, got images of shape {tuple(first.shape)}")
        features = []
        for key in self.cameras:
            images = obs[key].reshape(batch * steps, *obs[key].shape[2:])  # each step is its own image
            images = self.normalize_images(self.crop(images, generator))
            features.append(self.backbones[key](images))
        for key in self.low_dim:
            features.append(obs[key].reshape(batch * steps, -1).to(features[0].dtype))
        per_step = self.mlp(torch.cat(features, dim=-1))  # (B * To, feature_dim)
        return per_step.reshape(batch, steps * self.feature_dim)
