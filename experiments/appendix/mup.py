"""Appendix "Hyperparameter Scaling DoPr": standard (SP) and maximal-update (μP) parameterisations
of the 3-layer bias-free MLP (d_in-w-w-10), and the width sweep that asks whether the best learning
rate moves with the width.

The appendix's rules, per layer role (input, hidden, output), for width w and base rate η, base
weight decay λ:

| | input | hidden | output |
|---|---|---|---|
| init variance, SP | 1/d_in | 1/w | 1/w |
| init variance, μP | 1/d_in | 1/w | 1/w² |
| learning rate, SP | η | η | η |
| learning rate, μP (AdamW-type update) | η | η/w | η/w |
| weight decay, SP, and μP with `weight_decay_scaling=constant` | λ | λ | λ |
| weight decay, μP with `weight_decay_scaling=mup` ("wd x w": η·λ width-independent) | λ | λw | λw |

DoPr keeps its GP's rules (the appendix's argument: AdamW and Muon normalise whatever gradient they
are handed). The appendix gives Muon's rule only in words ("a constant learning rate"): here a
Muon-updated (hidden) matrix keeps η and λ at every width, and the layers Muon hands to AdamW (input,
output) follow the AdamW rows. SP has a constant decay whatever `weight_decay_scaling` says (before
issue 46 its hidden and output layers got λw too, and the SP optima followed the decay). The weight-decay
experiment's "SP" keeps μP's initialisation and rates with a constant weight decay
(`weight_decay_scaling=constant`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .model import mlp

ROLES = ("input", "hidden", "output", "vector")   # vector: norm gains and biases (rate eta, no decay)
PARAMETERIZATIONS = ("sp", "mup")
WD_SCALINGS = ("constant", "mup")


def roles(model: nn.Sequential) -> dict:
    """{weight parameter: role} for the MLP's Linear layers: the first reads the data, the last
    writes the logits, the rest are hidden."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise ValueError(f"a μP MLP needs an input and an output layer, got {len(linears)} Linear layer(s)")
    return {m.weight: "input" if i == 0 else "output" if i == len(linears) - 1 else "hidden"
            for i, m in enumerate(linears)}


def init_std(role: str, parameterization: str, d_in: int, width: int) -> float:
    if parameterization not in PARAMETERIZATIONS:
        raise ValueError(f"parameterization must be one of {PARAMETERIZATIONS}, got {parameterization!r}")
    if role == "input":
        return d_in ** -0.5
    if role == "hidden" or parameterization == "sp":
        return width ** -0.5
    return 1.0 / width


def multipliers(role: str, parameterization: str, width: int, matrix_update: bool,
                weight_decay_scaling: str) -> tuple:
    """(learning-rate multiplier, weight-decay multiplier) of a layer, relative to (η, λ).
    `matrix_update`: the layer is updated by Muon / AdaMuon's orthogonalised step (constant rate)."""
    if weight_decay_scaling not in WD_SCALINGS:
        raise ValueError(f"weight_decay_scaling must be one of {WD_SCALINGS}, got {weight_decay_scaling!r}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "vector":
        return 1.0, 0.0
    scaled = parameterization == "mup" and role != "input" and not matrix_update
    lr = 1.0 / width if scaled else 1.0
    # SP is the paper's "constant learning rate, and constant weight decay" whatever
    # weight_decay_scaling says: that axis varies the decay at μP only (the weight-decay figure)
    wd = float(width) if scaled and weight_decay_scaling == "mup" else 1.0
    return lr, wd


def applied_weight_decay_scaling(parameterization: str, weight_decay_scaling: str) -> str:
    """The decay rule a run actually used, for its record: SP is always "constant"."""
    return weight_decay_scaling if parameterization == "mup" else "constant"


def initialize(model: nn.Sequential, parameterization: str, generator: torch.Generator = None) -> None:
    """Gaussian initialisation of every Linear weight at the parameterisation's variance."""
    layer_roles = roles(model)
    width = next(w for w, r in layer_roles.items() if r == "input").shape[0]
    with torch.no_grad():
        for w, role in layer_roles.items():
            std = init_std(role, parameterization, w.shape[1], width)
            w.copy_(torch.randn(w.shape, generator=generator) * std)


def _members(opt) -> list:
    """The torch optimizers whose param_groups hold the rates: the GP under a DoPr, the members of a
    Muon + AdamW hybrid."""
    base = getattr(opt, "base", opt)
    return list(base.optimizers.values()) if hasattr(base, "optimizers") else [base]


def apply(opt, layer_roles: dict, width: int, parameterization: str, weight_decay_scaling: str) -> dict:
    """Split the optimizer's groups so that each parameter gets its role's rate and weight decay
    (`layer_roles`: {parameter: role}, e.g. `roles(model)`; multiplying the group's own). Call before
    the first step. Returns {role: (lr, wd)}."""
    out = {}
    for member in _members(opt):
        if member.state:
            raise RuntimeError("μP rates must be set before the optimizer's first step")
        matrix = type(member).__name__ in ("Muon", "AdaMuon")
        groups = []
        for g in member.param_groups:
            split: dict = {}
            for p in g["params"]:
                role = layer_roles.get(p)
                if role is None:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} has no μP role (the MLP here is "
                                     "bias-free: every parameter is a Linear weight)")
                split.setdefault((role, *multipliers(role, parameterization, width, matrix, weight_decay_scaling)),
                                 []).append(p)
            for (role, m_lr, m_wd), params in split.items():
                groups.append({**g, "params": params, "lr": g["lr"] * m_lr,
                               "weight_decay": g.get("weight_decay", 0.0) * m_wd, "mup_role": role})
                out[role] = (groups[-1]["lr"], groups[-1]["weight_decay"])
        member.param_groups = groups
    return out


def update_ratio(weight: torch.Tensor, before: torch.Tensor) -> float:
    """‖ΔW‖_F / ‖W‖_F of one step (the appendix's weight-decay figure; W before the step)."""
    return float(torch.linalg.norm(weight - before) / torch.linalg.norm(before))


def run(cfg, run) -> dict:
    from experiments.appendix import data as image_data

    t, m = cfg.task, cfg.task.mup
    sets = image_data.load(t)
    x, _, y = sets["train"]
    x = 2.0 * x - 1.0                      # the appendix: inputs normalised to [-1, 1]
    width = int(m.width)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    model = mlp(x.shape[1], width, int(t.classes), bias=False)
    initialize(model, m.parameterization, gen)
    opt = run.build_optimizer(model)
    rates = apply(opt, roles(model), width, m.parameterization, m.weight_decay_scaling)
    hidden = next(w for w, r in roles(model).items() if r == "hidden")
    loss_fn = nn.CrossEntropyLoss()
    batch = min(int(t.batch_size), len(y))
    per_epoch = len(y) // batch
    steps = int(t.epochs) * per_epoch
    losses, ratios = [], {}
    bar = run.progress(steps)
    for step in range(1, steps + 1):
        if (step - 1) % per_epoch == 0:
            order = torch.randperm(len(y), generator=gen)
        idx = order[((step - 1) % per_epoch) * batch:((step - 1) % per_epoch + 1) * batch]
        loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = hidden.detach().clone()
        opt.step()
        losses.append(loss.item())
        if step % int(t.ratio_every) == 0 or step == steps:
            ratios[str(step)] = update_ratio(hidden.detach(), before)
        if step % int(t.log_every) == 0 or step == steps:
            run.log({"train_loss": losses[-1], "update_ratio": update_ratio(hidden.detach(), before)}, step)
        bar.update()
        if not math.isfinite(losses[-1]):
            break
    bar.close()
    last_epoch = losses[-per_epoch:]
    final = sum(last_epoch) / len(last_epoch)
    return {"train_loss": final if math.isfinite(final) else float("nan"), "width": width,
            "parameterization": m.parameterization,
            "weight_decay_scaling": applied_weight_decay_scaling(m.parameterization, m.weight_decay_scaling),
            "lr": float(cfg.optim.lr), "multiplier_log2": float(m.k), "steps": len(losses),
            "rates": {k: {"lr": v[0], "weight_decay": v[1]} for k, v in rates.items()},
            "update_ratio_curve": ratios}
