"""The approximation schemes of the AP for convolutions (appendix "Approximation Schemes for AP") on a
CPU-sized task: a small Conv2d classifier on scikit-learn's 8x8 digits.

The appendix's Guidelines say SUA "empirically preserves the performance of the full AP"; it also derives
the rank-1 + diagonal approximation for inflated activation dimensions such as im2col's. The arms, all
DoPr-AdamW but the GP alone (plain AdamW):

- full AP: `ap.conv2d=full`, the exact im2col patch covariance (C_in*9 + 1 per 3x3 layer), Cholesky;
- SUA: `ap.conv2d=sua`, the channel covariance C_in x C_in shared by the 9 kernel offsets
  (dopr/layers/conv.py, `Conv2dSUAHelper`; the bias goes to the GP unpreconditioned);
- rank-1 + diagonal: `ap.solver=rank1_diag`, Sherman-Morrison on diag(Var z) + mu mu^T
  (dopr/solvers.py). The library's solver is one per optimizer, so the Linear head takes it too.

The network: three 3x3 convolutions (1 -> c -> 2c -> 2c channels, padding 1, ReLU, a 2x2 average pool
after the second), a global average pool and a Linear head; `task.dropout` > 0 puts an nn.Dropout after
every ReLU (the paper's Guidelines and Limitations: "use no/low dropout", as it "can conflict with
accumulation in the activation preconditioner buffers"). The job reports the final validation loss and
accuracy on the held-out 0.2 of the digits (`experiments.appendix.data`'s split) and, for a DoPr run,
each layer's routing as the optimizer built it (mode and dimension, the solver).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import data as image_data

SIDE = 8   # the digits are 8 x 8


def convnet(channels: int, classes: int, dropout: float = 0.0) -> nn.Sequential:
    """conv3x3(1, c) - conv3x3(c, 2c) - avgpool 2 - conv3x3(2c, 2c) - global average - Linear(2c, classes),
    ReLU after each convolution, nn.Dropout(dropout) after each ReLU when dropout > 0."""
    drop = (lambda: [nn.Dropout(dropout)]) if dropout > 0 else (lambda: [])
    c = int(channels)
    return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), *drop(),
                         nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), *drop(), nn.AvgPool2d(2),
                         nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), *drop(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, classes))


def routing(opt) -> dict:
    """{layer name: 'mode d=dim'} of a DoPr optimizer's preconditioned layers, plus its solver; {} for a GP."""
    if not hasattr(opt, "coverage"):
        return {}
    layers = {e.name: f"{e.mode} d={e.dim}" for e in opt.coverage() if e.status == "preconditioned"}
    return {"layers": layers, "solver": opt.options.solver}


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    model.eval()
    logits = model(x)
    model.train()
    return {"val_loss": float(nn.functional.cross_entropy(logits, y)),
            "val_accuracy": float((logits.argmax(1) == y).float().mean())}


def run(cfg, run) -> dict:
    t = cfg.task
    sets = image_data.load(t)
    x, _, y = sets["train"]
    xv, _, yv = sets["val"]
    x, xv = x.reshape(-1, 1, SIDE, SIDE), xv.reshape(-1, 1, SIDE, SIDE)
    torch.manual_seed(int(cfg.seed))
    model = convnet(int(t.channels), int(t.classes), float(t.dropout))
    opt = run.build_optimizer(model)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    batch, steps = min(int(t.batch_size), len(y)), int(t.steps)
    order, pos = torch.randperm(len(y), generator=gen), 0
    val, window, diverged_at = {}, [], None
    bar = run.progress(steps)
    for step in range(1, steps + 1):
        if pos + batch > len(y):
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx, pos = order[pos:pos + batch], pos + batch
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window = (window + [loss.item()])[-int(t.log_every):]
        bar.update()
        if not math.isfinite(window[-1]):
            diverged_at = step
            break
        if step % int(t.val_every) == 0 or step == steps:
            val = evaluate(model, xv, yv)
            run.log({"train_loss": sum(window) / len(window), **val}, step)
    bar.close()
    if diverged_at is not None:
        val = {"val_loss": None, "val_accuracy": None}
    return {**val, "train_loss": sum(window) / len(window) if diverged_at is None else None,
            "diverged_at": diverged_at, "lr": float(cfg.optim.lr), "dropout": float(t.dropout),
            "steps": step, "ap_routing": routing(opt)}
