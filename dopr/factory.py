"""One factory for every optimizer of the suite: {sgd, adamw, muon, signum, adamuon} x {plain, dopr}."""
from __future__ import annotations

import torch
from torch import nn

from .gp import GP_KWARGS, build_gp
from .optimizer import DoPr
from .options import DoPrOptions

DOPR_KWARGS = DoPrOptions.names()
NAMES = tuple(GP_KWARGS) + tuple(f"dopr_{g}" for g in GP_KWARGS)


def build(model: nn.Module, name: str, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.Optimizer:
    """``build(model, "dopr_adamw", lr=1e-3, damping=1e-4)``: the GP over the model's trainable
    parameters, wrapped in :class:`DoPr` when ``name`` starts with ``dopr_``.

    Keywords that name a :class:`dopr.options.DoPrOptions` field go to DoPr; the rest to the GP.
    """
    if name not in NAMES:
        raise ValueError(f"Unknown optimizer {name!r}; valid names: {list(NAMES)}")
    use_dopr = name.startswith("dopr_")
    ap_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in DOPR_KWARGS}
    if ap_kwargs and not use_dopr:
        raise TypeError(f"{sorted(ap_kwargs)} are DoPr options; {name!r} is a plain GP (use 'dopr_{name}')")
    base = build_gp(model, name.removeprefix("dopr_"), lr=lr, weight_decay=weight_decay, **kwargs)
    return DoPr(model, base, **ap_kwargs) if use_dopr else base
