"""SiT: the class-conditional latent transformer of Ma et al. (2024), which is DiT (Peebles & Xie, 2023)
with a continuous time t in [0, 1] fed to the same sinusoidal embedding.

Layout as in willisma/SiT ``models.py`` (itself facebookresearch/DiT): a patch embedding (Conv2d with
kernel = stride = patch), fixed 2-D sine-cosine position embeddings, a timestep MLP and a label table
(one extra row: the null class of classifier-free guidance) summed into the conditioning c; blocks of
LayerNorm (no affine) -> adaLN modulation -> attention / GELU-tanh MLP with gated residuals, each
block's modulation a SiLU + Linear(c -> 6 widths) initialised to zero (adaLN-Zero, so every block
starts as the identity); a final adaLN layer, zero-initialised, and unpatchify. ``learn_sigma`` (SiT's
default) doubles the output channels and the second half is dropped, as in SiT's forward.

    model = SiT_models["SiT-S/2"](input_size=32, num_classes=1000)   # 33.0M parameters
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dopr.gp import mark_role


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """t (any real, SiT feeds t in [0, 1]) -> sinusoidal features (max period 10000) -> 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_size: int = 256) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    @staticmethod
    def sinusoid(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1) if dim % 2 else emb

    def forward(self, t: Tensor) -> Tensor:
        return self.mlp(self.sinusoid(t, self.frequency_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors; with ``dropout_prob`` > 0 a row for the null class (label
    ``num_classes``) that training swaps in with that probability (classifier-free guidance)."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def forward(self, labels: Tensor, train: bool) -> Tensor:
        if train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class Attention(nn.Module):
    """Multi-head self-attention with one qkv projection (timm's layout, bias on)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiTBlock(nn.Module):
    """adaLN-Zero block: shift, scale and gate for the attention and the MLP from the conditioning c."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        # the output layer (Muon's rule keeps it on AdamW; adaLN_modulation, registered after it, is hidden)
        self.linear = mark_role(nn.Linear(hidden_size, patch_size * patch_size * out_channels), "output")
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def sincos_pos_embed(dim: int, grid: int) -> np.ndarray:
    """(grid*grid, dim) fixed 2-D sine-cosine embedding: half the channels encode the row, half the column."""
    if dim % 4:
        raise ValueError(f"hidden size {dim} must be divisible by 4 for the 2-D sine-cosine position embedding")

    def one_axis(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    w, h = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
    return np.concatenate([one_axis(dim // 2, w), one_axis(dim // 2, h)], axis=1)


class SiT(nn.Module):
    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4, hidden_size: int = 1152,
                 depth: int = 28, num_heads: int = 16, mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1,
                 num_classes: int = 1000, learn_sigma: bool = True) -> None:
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input size {input_size} is not divisible by the patch size {patch_size}")
        self.in_channels, self.patch_size, self.num_classes = in_channels, patch_size, num_classes
        self.learn_sigma = learn_sigma
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.grid = input_size // patch_size
        self.x_embedder = mark_role(nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size),
                                    "input")   # the patch embedding reads the image
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        # fixed, as in SiT (a Parameter with requires_grad=False, so it counts in the published size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid ** 2, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([SiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        self.pos_embed.data.copy_(torch.from_numpy(sincos_pos_embed(self.pos_embed.shape[-1], self.grid)).float()[None])
        w = self.x_embedder.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in [*self.blocks, self.final_layer]:      # adaLN-Zero
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x: Tensor) -> Tensor:
        """(N, T, p*p*C) -> (N, C, H, W)."""
        p, c, h = self.patch_size, self.out_channels, self.grid
        x = x.reshape(x.shape[0], h, h, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, h * p)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """x (N, C, H, W), t (N,) in [0, 1], y (N,) labels -> the predicted velocity (N, C, H, W)."""
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training)
        for block in self.blocks:
            x = block(x, c)
        x = self.unpatchify(self.final_layer(x, c))
        return x[:, : self.in_channels] if self.learn_sigma else x

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float) -> Tensor:
        """Classifier-free guidance: v_null + s (v_y - v_null) on every channel (SiT's sample script
        guides the first three channels only, a DiT legacy; here the guided field is the textbook one)."""
        null = torch.full_like(y, self.num_classes)
        out = self(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
        cond, uncond = out.chunk(2)
        return uncond + cfg_scale * (cond - uncond)


# the published sizes (SiT/DiT Table 1): depth, hidden size, heads
SIZES = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
SiT_models = {
    f"SiT-{size}/{patch}": (lambda d=d, h=h, n=n, patch=patch, **kw: SiT(depth=d, hidden_size=h, num_heads=n,
                                                                          patch_size=patch, **kw))
    for size, (d, h, n) in SIZES.items() for patch in (2, 4, 8)
}


def build_model(name: str, **kwargs) -> SiT:
    """``build_model("SiT-S/2", input_size=32)``; ``name="custom"`` takes depth, hidden_size, num_heads
    and patch_size from kwargs (the CPU analogue's small SiT)."""
    if name == "custom":
        return SiT(**kwargs)
    if name not in SiT_models:
        raise ValueError(f"unknown SiT model {name!r}; choose from {sorted(SiT_models)} or 'custom'")
    clash = {"depth", "hidden_size", "num_heads", "patch_size"} & set(kwargs)
    if clash:
        raise ValueError(f"{name} fixes {sorted(clash)}; use model=custom to set them")
    return SiT_models[name](**kwargs)
