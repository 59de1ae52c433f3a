"""One factory for every optimizer of the suite: each registered GP (dopr.gp.GPS), plain or wrapped in DoPr,
``build(model, gp, ap=None, **gp_kwargs)``; its name is derived from (gp, ap) (:mod:`dopr.names`)."""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn

from .gp import GPS, build_gp
from .names import AP_PREFIX, optimizer_name, split_name  # noqa: F401  (the names' home is dopr.names)
from .optimizer import DoPr
from .options import DoPrOptions

DOPR_KWARGS = DoPrOptions.names()


def names() -> tuple:
    """Every optimizer name :func:`build` takes now: each registered GP, plain and with DoPr."""
    return tuple(GPS) + tuple(optimizer_name(g, True) for g in GPS)


#: the names of the built-in GPs (:func:`names` also lists GPs registered later)
NAMES = names()


def build(model: nn.Module, gp, ap=None, **gp_kwargs) -> torch.optim.Optimizer:
    """``build(model, "adamw", lr=1e-3)``: the GP ``gp`` (a registered name or a ``torch.optim.Optimizer``
    class) over the model's trainable parameters, ``gp_kwargs`` its arguments; with ``ap`` (a
    :class:`dopr.options.DoPrOptions` or a dict of its fields, ``{}``: the defaults) wrapped in :class:`DoPr`:
    ``build(model, "adamw", ap={"damping": 1e-4}, lr=1e-3)``. The old form ``build(model, "dopr_adamw", lr=1e-3,
    damping=1e-4)`` still works, with a DeprecationWarning.
    """
    is_class = isinstance(gp, type) and issubclass(gp, torch.optim.Optimizer)
    if not is_class and not isinstance(gp, str):
        raise TypeError(f"gp must be a registered GP name ({', '.join(GPS)}) or a torch.optim.Optimizer class, "
                        f"got {gp!r}")
    if ap is None and not is_class and gp not in GPS:
        gp, ap, gp_kwargs = _read_old_form(gp, gp_kwargs)
    if not is_class and gp not in GPS:
        raise ValueError(f"Unknown gradient preconditioner {gp!r}; valid names: {list(GPS)}")
    if ap is not None and not isinstance(ap, (DoPrOptions, Mapping)):
        raise TypeError(f"ap must be None (the GP alone), a DoPrOptions or a dict of its fields ({{}}: the "
                        f"defaults), got {type(ap).__name__} {ap!r}")
    misplaced = sorted(set(gp_kwargs) & set(DOPR_KWARGS))
    if misplaced:
        raise TypeError(f"{misplaced} are DoPr options, not arguments of GP {getattr(gp, '__name__', gp)!r}: "
                        "pass them as ap={...}")
    base = (gp([p for p in model.parameters() if p.requires_grad], **gp_kwargs) if is_class
            else build_gp(model, gp, **gp_kwargs))
    return base if ap is None else DoPr(model, base, ap)


def _read_old_form(name: str, kwargs: dict) -> tuple:
    """(gp, ap, gp_kwargs) of the deprecated ``build(model, "dopr_<gp>", **kwargs)``: the keywords that
    name a DoPr option go to ``ap``, the rest to the GP."""
    gp, wrapped = split_name(name)
    if not wrapped or gp not in GPS:
        raise ValueError(f"Unknown optimizer {name!r}; valid names: {list(names())}")
    warnings.warn(f"dopr.build(model, {name!r}, ...) is deprecated: use dopr.build(model, {gp!r}, ap={{...}}, ...) "
                  "with the DoPr options in ap", DeprecationWarning, stacklevel=3)
    gp_kwargs = dict(kwargs)
    return gp, {k: gp_kwargs.pop(k) for k in list(gp_kwargs) if k in DOPR_KWARGS}, gp_kwargs
