"""Appendix "Hyperparameter Scaling DoPr", the language-model half (figures mup_nanogpt_adamw,
mup_nanogpt_muon): a GPT-2-style transformer (pre-LayerNorm blocks, causal attention with head
dimension 64, a 4x GELU MLP, learned positions, untied output head, no biases) of `layers` blocks and
width w (w / 64 heads), in SP or μP, trained on a token stream; its best training loss per
learning-rate multiplier and width.

μP here (the MLP's rules of experiments/appendix/mup.py, with the transformer's parts): the token and
position embeddings are the input layer (initial standard deviation 0.02 at every width, rate η,
decay λ), the block matrices hidden (variance 1/w, rate η/w under AdamW, decay λw), the head the
output layer (variance 1/w², rate η/w, decay λw), the LayerNorm gains vectors (rate η, no decay);
attention divides q·k by d_head (μP) instead of √d_head (SP), as the appendix prints. SP: the same
initial variances as μP but the head's 1/w, every rate η, every decay λ (the appendix: "PyTorch
defaults", which nanoGPT-style models do not use for embeddings; our choice is written here).

Data: `bytes` (CPU): the Python documentation that ships inside the interpreter (pydoc_data.topics,
466 KB), byte-level; `openwebtext` (the paper's): nanoGPT's `train.bin` / `val.bin` (uint16 GPT-2
tokens) under `task.data_path`, a missing file named in the error.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import mup


class Block(nn.Module):
    def __init__(self, width: int, head_dim: int, attn_scale: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.scale = width // head_dim, head_dim, attn_scale
        self.ln_1, self.ln_2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.fc_out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, head_dim: int = 64,
                 parameterization: str = "sp") -> None:
        super().__init__()
        if width % head_dim:
            raise ValueError(f"width {width} is not a multiple of the head dimension {head_dim}")
        if parameterization not in mup.PARAMETERIZATIONS:
            raise ValueError(f"parameterization must be one of {mup.PARAMETERIZATIONS}, got {parameterization!r}")
        scale = 1.0 / head_dim if parameterization == "mup" else head_dim ** -0.5
        self.width, self.parameterization = width, parameterization
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, head_dim, scale) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def roles(model: GPT) -> dict:
    """{parameter: μP role}: embeddings input, block matrices hidden, head output, LayerNorm gains vector."""
    out = {model.wte.weight: "input", model.wpe.weight: "input", model.head.weight: "output"}
    for name, p in model.named_parameters():
        if p not in out:
            out[p] = "vector" if p.dim() == 1 else "hidden"
    return out


def initialize(model: GPT, generator: torch.Generator = None) -> None:
    w = model.width
    with torch.no_grad():
        for p, role in roles(model).items():
            if role == "vector":
                p.fill_(1.0)
                continue
            std = 0.02 if role == "input" else mup.init_std(role, model.parameterization, w, w)
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def openwebtext_root(t) -> Path:
    """The folder of nanoGPT's tokenised OpenWebText (train.bin, val.bin); FileNotFoundError naming what is missing."""
    root = Path(t.data_path) if t.data_path else None
    missing = [f for f in ("train.bin", "val.bin") if root is None or not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"task.data=openwebtext needs nanoGPT's tokenised OpenWebText under "
                                f"task.data_path (now {t.data_path}): missing {', '.join(missing)} "
                                "(made by nanoGPT's data/openwebtext/prepare.py)")
    return root


def check_inputs(t) -> None:
    """The task's input files are there (checked before a sweep is submitted): OpenWebText's tokens."""
    if t.get("data") == "openwebtext":
        openwebtext_root(t)


def tokens(t) -> dict:
    """{"train"|"val": 1-d int64 token stream} and the vocabulary size."""
    if t.data == "bytes":
        import pydoc_data.topics

        text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        stream = torch.tensor(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        cut = int(len(stream) * float(t.train_fraction))
        return {"train": stream[:cut], "val": stream[cut:], "vocab": 256}
    if t.data == "openwebtext":
        root = openwebtext_root(t)
        return {s: torch.from_numpy(np.memmap(root / f"{s}.bin", dtype=np.uint16, mode="r").astype(np.int64))
                for s in ("train", "val")} | {"vocab": int(t.vocab)}
    raise ValueError(f"task.data must be bytes or openwebtext, got {t.data!r}")


def batch(stream: torch.Tensor, size: int, context: int, gen: torch.Generator) -> tuple:
    starts = torch.randint(0, len(stream) - context - 1, (size,), generator=gen)
    x = torch.stack([stream[s:s + context] for s in starts.tolist()])
    y = torch.stack([stream[s + 1:s + 1 + context] for s in starts.tolist()])
    return x, y


def run(cfg, run) -> dict:
    t, m = cfg.task, cfg.task.mup
    data = tokens(t)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    width = int(m.width)
    model = GPT(data["vocab"], int(t.context), width, int(t.layers), int(t.head_dim), m.parameterization)
    initialize(model, gen)
    opt = run.build_optimizer(model)
    rates = mup.apply(opt, roles(model), width, m.parameterization, m.weight_decay_scaling)
    hidden = model.blocks[0].proj.weight
    best, losses, ratios = math.inf, [], {}
    bar = run.progress(int(t.steps))
    for step in range(1, int(t.steps) + 1):
        x, y = batch(data["train"], int(t.batch_size), int(t.context), gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = hidden.detach().clone()
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        window = losses[-int(t.smooth):]
        best = min(best, sum(window) / len(window))   # the appendix: the best training loss reached
        if step % int(t.ratio_every) == 0 or step == int(t.steps):
            ratios[str(step)] = mup.update_ratio(hidden.detach(), before)
        if step % int(t.log_every) == 0:
            run.log({"train_loss": losses[-1], "best_train_loss": best}, step)
        bar.update()
    bar.close()
    with torch.no_grad():
        vx, vy = batch(data["val"], int(t.batch_size), int(t.context), torch.Generator().manual_seed(0))
        val = F.cross_entropy(model(vx).flatten(0, 1), vy.flatten()).item()
    return {"train_loss": best if math.isfinite(losses[-1]) else float("nan"), "last_train_loss": losses[-1],
            "val_loss": val, "width": width, "parameterization": m.parameterization,
            "weight_decay_scaling": mup.applied_weight_decay_scaling(m.parameterization, m.weight_decay_scaling),
            "lr": float(cfg.optim.lr),
            "multiplier_log2": float(m.k), "steps": len(losses),
            "rates": {k: {"lr": v[0], "weight_decay": v[1]} for k, v in rates.items()},
            "update_ratio_curve": ratios}
