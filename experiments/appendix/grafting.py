"""Moment grafting (appendix "Moment Grafting Experiments").

Three copies of one MLP, trained side by side on matched batches with the same GP (no AP):
"Original" on the original images, "Transformed" on their transformed versions (`data.transform`), and
"Grafted", which sees the original batch but, before each layer, has its input X mapped to the mean and
covariance that the Transformed model's same layer saw on the transformed batch:

    X_new = Sigma_t^{1/2} Sigma^{-1/2} (X - mu 1^T) + mu_t 1^T

(square roots by a symmetric eigendecomposition, each matrix damped by 1e-6 tr(A), as the appendix).
The map's matrices and means are computed from detached activations, so the gradient flows through X
alone. All three are validated on the transformed validation set, the Grafted and Original models
without any map: the claim is that the Grafted model's validation loss tracks the Transformed model's
far more closely than the Original model's does.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from . import data as image_data
from .model import mlp

#: the appendix's damping of the square roots, relative to tr(A)
SQRT_DAMPING = 1e-6


def moments(x: Tensor) -> tuple:
    """(mean d, covariance d x d) of the rows of x (b x d), normalised by b."""
    mu = x.mean(0)
    xc = x - mu
    return mu, xc.T @ xc / x.shape[0]


def sym_power(a: Tensor, power: float, damping: float = SQRT_DAMPING) -> Tensor:
    """(A + damping tr(A) I)^power for a symmetric positive semi-definite A."""
    e, v = torch.linalg.eigh(a)
    e = e.clamp_min(0) + damping * torch.trace(a)
    return (v * e**power) @ v.T


def moment_map(x: Tensor, mu_t: Tensor, sigma_t: Tensor, damping: float = SQRT_DAMPING) -> Tensor:
    """x (b x d, rows are samples) mapped to mean mu_t and covariance sigma_t (exactly so with
    damping 0 and a full-rank batch): (x - mu) Sigma^{-1/2} Sigma_t^{1/2} + mu_t, the appendix's
    formula written for rows."""
    with torch.no_grad():
        mu, sigma = moments(x)
        a = sym_power(sigma, -0.5, damping) @ sym_power(sigma_t, 0.5, damping)
    return (x - mu) @ a + mu_t


class Graft:
    """Records each nn.Linear input's moments on the `source` model and maps the `target` model's
    inputs to them (forward pre-hooks); `target`'s maps apply only while `enabled`."""

    def __init__(self, source: nn.Module, target: nn.Module, damping: float = SQRT_DAMPING) -> None:
        src = [m for m in source.modules() if isinstance(m, nn.Linear)]
        dst = [m for m in target.modules() if isinstance(m, nn.Linear)]
        self.damping, self.enabled, self.targets = damping, True, [None] * len(src)
        self.handles = [m.register_forward_pre_hook(self._recorder(i)) for i, m in enumerate(src)]
        self.handles += [m.register_forward_pre_hook(self._grafter(i)) for i, m in enumerate(dst)]

    def _recorder(self, i):
        def hook(module, inputs):
            if self.enabled:
                with torch.no_grad():
                    self.targets[i] = moments(inputs[0].detach())
        return hook

    def _grafter(self, i):
        def hook(module, inputs):
            if self.enabled:
                if self.targets[i] is None:
                    raise RuntimeError("Graft: run the source model on the matching batch before the target")
                return (moment_map(inputs[0], *self.targets[i], damping=self.damping),)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run(cfg, run) -> dict:
    t = cfg.task
    sets = image_data.load(t)
    x, xt, y = sets["train"]
    xv, xtv, yv = sets["val"]
    torch.manual_seed(int(cfg.seed))
    original = mlp(x.shape[1], int(t.width), int(t.classes))
    transformed, grafted = copy.deepcopy(original), copy.deepcopy(original)   # one initialisation
    models = {"transformed": (transformed, xt), "grafted": (grafted, x), "original": (original, x)}
    graft = Graft(transformed, grafted)   # before the optimizers: a DoPr's capture sees the mapped inputs
    opts = {name: run.build_optimizer(m) for name, (m, _) in models.items()}
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(int(cfg.seed))
    batch = min(int(t.batch_size), len(y))
    order, pos = torch.randperm(len(y), generator=gen), 0
    gaps = {"grafted": [], "original": []}
    bar = run.progress(int(t.steps))
    for step in range(1, int(t.steps) + 1):
        if pos + batch > len(y):
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx, pos = order[pos:pos + batch], pos + batch
        for name, (model, inputs) in models.items():   # transformed first: it records the targets
            loss = loss_fn(model(inputs[idx]), y[idx])
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
        bar.update()
        if step % int(t.val_every) and step != int(t.steps):
            continue
        graft.enabled = False
        with torch.no_grad():
            val = {name: loss_fn(m(xtv), yv).item() for name, (m, _) in models.items()}
            acc = {name: (m(xtv).argmax(1) == yv).float().mean().item() for name, (m, _) in models.items()}
        graft.enabled = True
        for name in gaps:
            gaps[name].append(abs(val[name] - val["transformed"]))
        run.log({**{f"val_loss_{k}": v for k, v in val.items()}, **{f"val_acc_{k}": v for k, v in acc.items()},
                 "gap_grafted": gaps["grafted"][-1], "gap_original": gaps["original"][-1]}, step)
    bar.close()
    graft.remove()
    mean_gap = {k: sum(v) / len(v) for k, v in gaps.items()}
    return {**{f"val_loss_{k}": v for k, v in val.items()}, **{f"val_acc_{k}": v for k, v in acc.items()},
            "mean_gap_grafted": mean_gap["grafted"], "mean_gap_original": mean_gap["original"],
            "gap_ratio": mean_gap["grafted"] / mean_gap["original"] if mean_gap["original"] > 0 else float("nan"),
            "lr": float(cfg.optim.lr)}
