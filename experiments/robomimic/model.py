"""ChiUNet: the conditional 1-D U-Net of Chi et al. (2023), the velocity network of the flow policy.

The paper (appendix "Image-Based Robot Policy Learning") uses the training pipeline of Pan et al.
(2025), "inheriting all architectural ... hyperparameters", with ChiUNet at about 20M parameters.
Where each value comes from (repository: file):

- simchowitzlabpublic/much-ado-about-noising: ``examples/configs/network/chiunet.yaml``:
  model_dim 128, dim_mult [1, 2, 2] (level widths 128 * cumprod = 128, 256, 512; Chi's
  ``down_dims``), emb_dim 256, kernel_size 5, cond_predict_scale true (FiLM predicts a per-channel
  scale and bias), obs_as_global_cond true, timestep_emb_type positional.
- same, ``mip/networks/chiunet.py``: the block structure below, GELU everywhere, the time MLP
  Linear(emb, 4 emb), GELU, Linear(4 emb, emb), the observation projection Linear(To * obs_dim, emb)
  and the FiLM input c = [time MLP output, projected observation] of size 2 emb; the output head
  Conv1d(k), GroupNorm, GELU, Conv1d(1).
- same, ``mip/network_utils.py`` ``GroupNorm1d(dim, 8, 4)``: min(8, channels // 4) groups.
- same, ``mip/networks/jannerunet.py``: downsampling Conv1d(c, c, 3, stride 2, padding 1),
  upsampling ConvTranspose1d(c, c, 4, stride 2, padding 1).
- same, ``mip/embeddings.py`` ``PositionalEmbedding``: frequencies 10000^(-i / half), i < half,
  features [cos, sin], applied to the flow time t in [0, 1] as it is (no 1000x rescaling).
- same, ``examples/train_robomimic.py``: the horizon must be a power of 2; robomimic's 10 becomes 16.
- real-stanford/diffusion_policy, ``diffusion_policy/model/diffusion/conditional_unet1d.py`` and
  ``conv1d_components.py``: the original much-ado follows (ConditionalResidualBlock1D, FiLM as
  ``scale * h + bias``, no skip from the first level into the decoder), with Mish instead of GELU
  and a fixed 8 groups: ``activation="mish"`` selects Mish.

Departures, none of which changes the parameter count of the U-Net proper:
(1) much-ado embeds the two times (s, t) of its flow-map interface with emb/2 features each and,
for flow matching, calls the net with s = t, so its time MLP reads the same emb/2 features twice;
here t is embedded once with emb features (same MLP, no duplicated input columns, which would make
the AP's activation covariance of that layer singular). (2) much-ado's ChiUNet also carries a scalar
head (Linear(512, 128), SiLU, Linear(128, 1): 65,793 parameters) that the flow loss never uses; it
is left out. (3) nn.GroupNorm instead of the functional GroupNorm1d (same groups and parameters).

Every weight sits in an nn.Linear, nn.Conv1d or nn.ConvTranspose1d (no grouped convolutions, no
functional calls), the module types whose inputs DoPr's forward hooks see.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dopr.gp import mark_role

#: the activation of every block and of the time MLP: GELU (much-ado) or Mish (diffusion_policy)
ACTIVATIONS = {"gelu": nn.GELU, "mish": nn.Mish}


def group_norm(channels: int, n_groups: int) -> nn.GroupNorm:
    """GroupNorm with min(n_groups, channels // 4) groups (much-ado's GroupNorm1d(dim, 8, 4))."""
    return nn.GroupNorm(max(1, min(n_groups, channels // 4)), channels)


def conv1d_block(in_channels: int, out_channels: int, kernel_size: int, n_groups: int, activation: str) -> nn.Sequential:
    """Conv1d (length-preserving), GroupNorm, activation."""
    return nn.Sequential(
        nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
        group_norm(out_channels, n_groups),
        ACTIVATIONS[activation](),
    )


class SinusoidalTimeEmbedding(nn.Module):
    """t -> [cos(t f_i), sin(t f_i)], f_i = 10000^(-i / (dim/2)), i < dim/2; no parameters."""

    def __init__(self, dim: int, max_period: float = 10000.0) -> None:
        super().__init__()
        if dim < 2 or dim % 2:
            raise ValueError(f"the time embedding needs an even dimension >= 2, got {dim}")
        half = dim // 2
        self.register_buffer("frequencies", max_period ** (-torch.arange(half, dtype=torch.float32) / half),
                             persistent=False)

    def forward(self, t: Tensor) -> Tensor:
        angles = t[:, None] * self.frequencies.to(t.dtype)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


class ConditionalResidualBlock1d(nn.Module):
    """h = block1(x); FiLM: h <- scale(c) * h + bias(c) per channel, [scale, bias] = Linear(act(c))
    (with cond_predict_scale=False only h <- h + bias(c)); out = block2(h) + residual(x), the
    residual a 1x1 Conv1d when the widths differ."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int, n_groups: int,
                 cond_predict_scale: bool, activation: str) -> None:
        super().__init__()
        self.block1 = conv1d_block(in_channels, out_channels, kernel_size, n_groups, activation)
        self.block2 = conv1d_block(out_channels, out_channels, kernel_size, n_groups, activation)
        self.cond_predict_scale = cond_predict_scale
        self.film = nn.Sequential(ACTIVATIONS[activation](),
                                  nn.Linear(cond_dim, out_channels * (2 if cond_predict_scale else 1)))
        self.residual = nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        h = self.block1(x)
        film = self.film(cond).unsqueeze(-1)  # (B, channels [x2], 1)
        if self.cond_predict_scale:
            scale, bias = film.chunk(2, dim=1)
            h = scale * h + bias
        else:
            h = h + film
        return self.block2(h) + self.residual(x)


class ChiUNet(nn.Module):
    """Velocity v(x_t, t | observation features): (B, H, action_dim) -> (B, H, action_dim).

    Encoder levels i = 0..n-1 (n = len(dim_mult)) of width model_dim * prod(dim_mult[:i+1]): two
    conditional residual blocks, then a stride-2 Conv1d except at the last level; two middle blocks;
    decoder levels n-2..0 (in reverse): concatenate the encoder output of level i+1, two blocks down
    to the width of level i, then ConvTranspose1d x2. The first level's encoder output is not
    reused (as in both anchors). H must be divisible by 2^(n-1). Every block is FiLM-conditioned on
    c = [MLP(sinusoidal(t)), Linear(cond)], cond being the flattened observation features (B, cond_dim).
    """

    def __init__(self, action_dim: int, cond_dim: int, model_dim: int = 128, dim_mult: Sequence[int] = (1, 2, 2),
                 emb_dim: int = 256, kernel_size: int = 5, n_groups: int = 8, cond_predict_scale: bool = True,
                 activation: str = "gelu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (length-preserving padding), got {kernel_size}")
        if not dim_mult or any(m < 1 for m in dim_mult):
            raise ValueError(f"dim_mult must be a non-empty list of positive integers, got {list(dim_mult)}")
        widths = [model_dim * math.prod(dim_mult[:i + 1]) for i in range(len(dim_mult))]
        levels = list(zip([action_dim] + widths[:-1], widths))
        self.horizon_multiple = 2 ** (len(levels) - 1)

        def block(c_in, c_out):
            return ConditionalResidualBlock1d(c_in, c_out, 2 * emb_dim, kernel_size, n_groups, cond_predict_scale,
                                              activation)

        self.time_embedding = SinusoidalTimeEmbedding(emb_dim)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, 4 * emb_dim), ACTIVATIONS[activation](),
                                      nn.Linear(4 * emb_dim, emb_dim))
        self.obs_projection = nn.Linear(cond_dim, emb_dim)
        self.down = nn.ModuleList(
            nn.ModuleList([block(c_in, c_out), block(c_out, c_out),
                           nn.Conv1d(c_out, c_out, 3, stride=2, padding=1) if i < len(levels) - 1 else nn.Identity()])
            for i, (c_in, c_out) in enumerate(levels))
        self.mid = nn.ModuleList([block(widths[-1], widths[-1]), block(widths[-1], widths[-1])])
        self.up = nn.ModuleList(
            nn.ModuleList([block(2 * c_out, c_in), block(c_in, c_in),
                           nn.ConvTranspose1d(c_in, c_in, 4, stride=2, padding=1)])
            for c_in, c_out in reversed(levels[1:]))
        self.final = nn.Sequential(conv1d_block(model_dim, model_dim, kernel_size, n_groups, activation),
                                   mark_role(nn.Conv1d(model_dim, action_dim, 1), "output"))   # writes the velocity

    def conditioning(self, t: Tensor | float, cond: Tensor) -> Tensor:
        """The FiLM input c = [MLP(sinusoidal(t)), Linear(cond)], (B, 2 emb_dim)."""
        t = torch.as_tensor(t, dtype=cond.dtype, device=cond.device)
        if t.dim() == 0:
            t = t.expand(cond.shape[0])
        return torch.cat([self.time_mlp(self.time_embedding(t)), self.obs_projection(cond)], dim=-1)

    def forward(self, x: Tensor, t: Tensor | float, cond: Tensor) -> Tensor:
        """x: (B, H, action_dim), t: (B,) or a scalar in [0, 1], cond: (B, cond_dim)."""
        if x.shape[1] % self.horizon_multiple:
            raise ValueError(f"the horizon H={x.shape[1]} must be divisible by {self.horizon_multiple} "
                             f"(2^(levels-1) for the stride-2 down/upsampling)")
        c = self.conditioning(t, cond)
        h = x.transpose(1, 2)  # (B, action_dim, H): channels first for Conv1d
        skips = []
        for block1, block2, downsample in self.down:
            h = block2(block1(h, c), c)
            skips.append(h)
            h = downsample(h)
        for block in self.mid:
            h = block(h, c)
        for block1, block2, upsample in self.up:
            h = torch.cat([h, skips.pop()], dim=1)
            h = upsample(block2(block1(h, c), c))
        return self.final(h).transpose(1, 2)
