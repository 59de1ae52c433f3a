"""One factory for every optimizer of the suite: each registered GP (dopr.gp.GPS: sgd, adamw, signum,
lion, muon, adamuon, soap, shampoo, kron), plain or wrapped in DoPr. An optimizer's identity is the pair (gp, ap); its
user-facing name is ``gp`` or ``"dopr_" + gp`` (:func:`optimizer_name`, :func:`split_name`)."""
from __future__ import annotations

import torch
from torch import nn

from .gp import GPS, build_gp
from .optimizer import DoPr
from .options import DoPrOptions

DOPR_KWARGS = DoPrOptions.names()
AP_PREFIX = "dopr_"


def optimizer_name(gp: str, ap: bool) -> str:
    """The user-facing name of GP ``gp`` alone (``ap`` false) or wrapped in DoPr: "adamw", "dopr_adamw"."""
    return AP_PREFIX + gp if ap else gp


def split_name(name: str) -> tuple:
    """(gp, ap) of an optimizer name: ("adamw", True) for "dopr_adamw", ("adamw", False) for "adamw".
    Syntax only (reports read names of runs); :func:`build` checks that the GP is registered."""
    return (name[len(AP_PREFIX):], True) if name.startswith(AP_PREFIX) else (name, False)


def names() -> tuple:
    """Every optimizer name :func:`build` takes now: each registered GP, plain and with DoPr."""
    return tuple(GPS) + tuple(optimizer_name(g, True) for g in GPS)


#: the names of the built-in GPs (:func:`names` also lists GPs registered later)
NAMES = names()


def build(model: nn.Module, name: str, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.Optimizer:
    """``build(model, "dopr_adamw", lr=1e-3, damping=1e-4)``: the GP over the model's trainable
    parameters, wrapped in :class:`DoPr` when ``name`` starts with ``dopr_``.

    Keywords that name a :class:`dopr.options.DoPrOptions` field go to DoPr; the rest to the GP.
    """
    gp, ap = split_name(name)
    if gp not in GPS:
        raise ValueError(f"Unknown optimizer {name!r}; valid names: {list(names())}")
    ap_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in DOPR_KWARGS}
    if ap_kwargs and not ap:
        raise TypeError(f"{sorted(ap_kwargs)} are DoPr options; {name!r} is a plain GP "
                        f"(use {optimizer_name(gp, True)!r})")
    base = build_gp(model, gp, lr=lr, weight_decay=weight_decay, **kwargs)
    return DoPr(model, base, **ap_kwargs) if ap else base
