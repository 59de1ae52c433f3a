"""Moment grafting (appendix "Moment Grafting Experiments").

Three copies of one MLP, trained side by side on matched batches with the same GP (no AP):
"Original" on the original images, "Transformed" on their transformed versions (`data.transform`), and
"Grafted", which sees the original batch but, before each layer, has its input X mapped to the mean and
covariance that the Transformed model's same layer saw on the transformed batch:

    X_new = Sigma_t^{1/2} Sigma^{-1/2} (X - mu 1^T) + mu_t 1^T

(square roots by a symmetric eigendecomposition, each matrix damped by 1e-6 tr(A), as the appendix).
The map's matrices and means are computed from detached activations, so the gradient flows through X
alone. Every reading's loss is compared to the Transformed model's on the transformed validation images
(`evaluate`, `READINGS`); in each the Transformed model's layer-input moments on those images are the
maps' targets:

- grafted_on_transformed, the paper's reading: the trained Grafted network, maps on, fed the
  transformed validation images (what every model is validated on in the appendix);
- grafted_on_original, in-distribution scoring: the Grafted network, maps on, fed the matching
  original validation images (the data it sees in training);
- grafted_off: the bare Grafted weights on the transformed images (the reading of the earliest runs);
- original: the Original model on the transformed images (the claim's baseline);
- original_on_original, the in-distribution control: the Original model on its own original images;
- original_maps_on_transformed, the maps' control: the Original network with the same evaluation-time maps
  (its layer inputs mapped to the Transformed model's moments), fed the transformed images. Where it is as
  close to Transformed as the paper's reading, the maps at evaluation, not training under them, made the gap.

The claim: the Grafted model's validation loss tracks the Transformed model's far more closely than
the Original model's does.

`task.parameterization`: null keeps PyTorch's initialisation and one rate for every parameter (the
earlier runs); sp or mup re-initialise the weights and split the rates by `experiments.appendix.mup`'s
rules (biases: its "vector" role, rate eta, no decay), the same initialisation for all three models.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from . import data as image_data
from . import mup
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

    def __init__(self, source: nn.Module, target: nn.Module, damping: float = SQRT_DAMPING,
                 enabled: bool = True) -> None:
        src = [m for m in source.modules() if isinstance(m, nn.Linear)]
        dst = [m for m in target.modules() if isinstance(m, nn.Linear)]
        self.damping, self.enabled, self.targets = damping, enabled, [None] * len(src)
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


def layer_roles(model: nn.Sequential) -> dict:
    """{parameter: μP role}: `mup.roles` for the weights, the "vector" role for the biases."""
    return {**mup.roles(model), **{m.bias: "vector" for m in model if isinstance(m, nn.Linear) and m.bias is not None}}


def parameterize(models: dict, opts: dict, parameterization, width: int) -> dict:
    """Apply `parameterization` (None: leave PyTorch's initialisation and the optimizer's one rate; "sp" |
    "mup": `mup`'s initialisation and per-role rates) to the models of {name: model}, which share one
    initialisation before and after, and their optimizers {name: optimizer}. Returns {role: (lr, wd)}
    (empty for None). The presets carry no weight decay; its scaling is the constant one."""
    if parameterization is None:
        return {}
    if parameterization not in mup.PARAMETERIZATIONS:
        raise ValueError(f"task.parameterization must be null or one of {mup.PARAMETERIZATIONS}, got {parameterization!r}")
    first, *rest = models.values()
    mup.initialize(first, parameterization)
    with torch.no_grad():
        for m in rest:
            for p, q in zip(m.parameters(), first.parameters()):
                p.copy_(q)
    rates = {}
    for name, m in models.items():
        rates = mup.apply(opts[name], layer_roles(m), width, parameterization, "constant")
    return rates


def evaluate(models: dict, graft: Graft, control: Graft, xv: Tensor, xtv: Tensor, yv: Tensor) -> dict:
    """Validation, one full-batch pass per reading of `READINGS` (a flat dict of val_loss_<reading>,
    val_acc_<reading>): the Transformed model on xtv records the maps' targets (its layer-input moments);
    the Grafted model reads xtv (the paper's reading) and the matching original images xv through its
    maps, and xtv with the maps off; the Original model reads xtv and xv, and xtv through `control`'s maps
    (the same evaluation-time maps onto the Original network). Leaves the maps enabled and `control`'s off."""
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    with torch.no_grad():
        graft.enabled = control.enabled = True
        logits = {"transformed": models["transformed"](xtv), "grafted_on_transformed": models["grafted"](xtv),
                  "grafted_on_original": models["grafted"](xv),
                  "original_maps_on_transformed": models["original"](xtv)}
        graft.enabled = control.enabled = False
        logits.update(grafted_off=models["grafted"](xtv), original=models["original"](xtv),
                      original_on_original=models["original"](xv))
        graft.enabled = True
    for name in READINGS:
        out[f"val_loss_{name}"] = loss_fn(logits[name], yv).item()
        out[f"val_acc_{name}"] = (logits[name].argmax(1) == yv).float().mean().item()
    return out


#: what `evaluate` scores (model, maps, validation images); the gaps are to the Transformed model's loss
READINGS = ("transformed", "grafted_on_transformed", "grafted_on_original", "grafted_off", "original",
            "original_on_original", "original_maps_on_transformed")
GAPPED = READINGS[1:]


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
    control = Graft(transformed, original, enabled=False)   # on at evaluation only: the Original trains without
    rates = parameterize({n: m for n, (m, _) in models.items()}, opts, t.parameterization, int(t.width))
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(int(cfg.seed))
    batch = min(int(t.batch_size), len(y))
    order, pos = torch.randperm(len(y), generator=gen), 0
    gaps = {name: [] for name in GAPPED}
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
        val = evaluate({n: m for n, (m, _) in models.items()}, graft, control, xv, xtv, yv)
        for name in gaps:
            gaps[name].append(abs(val[f"val_loss_{name}"] - val["val_loss_transformed"]))
        run.log({**val, **{f"gap_{k}": v[-1] for k, v in gaps.items()}}, step)
    bar.close()
    graft.remove()
    control.remove()
    mean_gap = {k: sum(v) / len(v) for k, v in gaps.items()}
    ratio = lambda a, b: a / b if b > 0 else float("nan")
    return {**val, **{f"mean_gap_{k}": v for k, v in mean_gap.items()},
            **{f"gap_ratio_{k}": ratio(v, mean_gap["original"]) for k, v in mean_gap.items() if k != "original"},
            "lr": float(cfg.optim.lr), "parameterization": t.parameterization or "pytorch default",
            "batch": batch, "steps": int(t.steps),
            "rates": {k: {"lr": v[0], "weight_decay": v[1]} for k, v in rates.items()}}
