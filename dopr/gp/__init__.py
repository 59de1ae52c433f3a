"""Gradient preconditioners (GPs): the optimizers that take the step after DoPr's activation
preconditioner has rewritten the gradients."""

import difflib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .adamuon import AdaMuon
from .base import BaseGP
from .lion import Lion
from .muon import HybridOptimizer, Muon, mark_role, route_matrix_params
from .newton_schulz import newton_schulz5
from .peers import PEERS, build_peer
from .sgd import SGD
from .signum import Signum

__all__ = ["BaseGP", "SGD", "Signum", "Lion", "AdaMuon", "Muon", "HybridOptimizer", "mark_role", "route_matrix_params", "newton_schulz5",
           "GPS", "GradientPreconditioner", "register_gp", "build_gp"]


@dataclass(frozen=True)
class GradientPreconditioner:
    """A GP by name: ``build(params, lr=, weight_decay=, **kwargs)`` makes it over parameters (or param groups),
    the ``nn.Module`` itself (``needs_module``) or its (name, parameter) pairs (``named``); ``kwargs`` are the
    keywords it takes besides lr and weight_decay."""

    name: str
    build: Callable
    kwargs: frozenset
    needs_module: bool = False
    named: bool = False


GPS: dict = {}


def register_gp(name: str, build: Callable, kwargs: Optional[Iterable[str]] = None,
                needs_module: bool = False, named: bool = False) -> None:
    """Add a GP: ``build_gp(model, name, lr=...)`` and ``dopr.build(model, name, ap=None | {...})``
    then make it. ``build`` is a ``torch.optim.Optimizer`` class or a function with its constructor's
    form; ``kwargs`` defaults to its keyword parameters besides the first (the parameters), lr and
    weight_decay."""
    if kwargs is None:
        params = list(inspect.signature(build).parameters.values())[1:]
        kwargs = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    GPS[name] = GradientPreconditioner(name, build, frozenset(kwargs) - {"lr", "weight_decay"}, needs_module, named)


def build_gp(model_or_params_source, name: str, lr: Optional[float] = None, weight_decay: float = 0.0,
             **kwargs) -> torch.optim.Optimizer:
    """Build the registered GP ``name`` (:data:`GPS`) over a model's trainable parameters (or, but for "muon" and
    "adamuon", an iterable of parameters / param groups).

    "muon" and "adamuon" return a :class:`HybridOptimizer`: Muon / AdaMuon on the hidden matrices
    (:func:`route_matrix_params`: ``head_names``, ``input_layer``, ``input_names``, ``conv``) and AdamW at
    ``adamw_lr`` (default ``lr``) on the rest; ``adjust_lr_fn`` is torch.optim.Muon's step scale ("original",
    sqrt(max(1, m/n)), or "match_rms_adamw", 0.2 sqrt(max(m, n))); ``eps`` and ``betas`` go to AdamW (``eps`` to
    AdaMuon too). "soap", "shampoo", "kron" are pytorch-optimizer's (:mod:`dopr.gp.peers`). A keyword the GP does
    not take, or a missing ``lr``, raises ``TypeError`` naming it (and the closest option).
    """
    gp = GPS.get(name)
    if gp is None:
        raise ValueError(f"Unknown gradient preconditioner {name!r}; valid names: {list(GPS)}")
    unknown = sorted(set(kwargs) - gp.kwargs)
    if unknown:
        options = ["lr", "weight_decay", *sorted(gp.kwargs)]
        close = [m for k in unknown for m in difflib.get_close_matches(k, options, n=1)]
        raise TypeError(f"unexpected keyword{'s' * (len(unknown) > 1)} {', '.join(unknown)} for {name} (its options: "
                        f"{', '.join(options)}{'; did you mean ' + ', '.join(close) + '?' if close else ''})")
    if lr is None:
        raise TypeError(f"missing keyword lr for {name} (the learning rate)")

    source = model_or_params_source
    if gp.needs_module and not isinstance(source, nn.Module):
        raise TypeError(f"GP {name!r} routes parameters by module and needs an nn.Module, "
                        f"got {type(source).__name__}")
    if gp.named and isinstance(source, nn.Module):
        source = [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    elif not gp.needs_module and isinstance(source, nn.Module):
        source = [p for p in source.parameters() if p.requires_grad]
    return gp.build(source, lr=lr, weight_decay=weight_decay, **kwargs)


def _build_hybrid(model, name, lr, weight_decay, momentum=0.95, nesterov=True, ns_steps=5,
                  adjust_lr_fn=None, beta2=0.999, betas=(0.9, 0.999), eps=1e-8, adamw_lr=None,
                  head_names=None, input_layer="adamw", input_names=None, conv="adamw"):
    matrix_params, other_params = route_matrix_params(model, head_names, input_layer, input_names, conv)
    members = {}
    if matrix_params and name == "muon":
        members["muon"] = Muon(
            matrix_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps)
    if matrix_params and name == "adamuon":
        members["adamuon"] = AdaMuon(
            matrix_params, lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2, eps=eps,
            weight_decay=weight_decay, ns_steps=ns_steps,
            adjust_lr_fn="match_rms_adamw" if adjust_lr_fn is None else adjust_lr_fn)
    if other_params:
        members["adamw"] = torch.optim.AdamW(
            other_params, lr=lr if adamw_lr is None else adamw_lr, betas=betas, eps=eps,
            weight_decay=weight_decay)
    if not members:
        raise ValueError("optimizer got an empty parameter list: the model has no trainable parameters")
    return HybridOptimizer(members)


# Keyword arguments of the hybrids, besides lr and weight_decay.
_HYBRID_KWARGS = {"momentum", "nesterov", "adjust_lr_fn", "ns_steps",
                  "betas", "eps", "adamw_lr", "head_names", "input_layer", "input_names", "conv"}

register_gp("sgd", SGD)
register_gp("adamw", torch.optim.AdamW, kwargs=("betas", "eps"))
register_gp("muon", functools.partial(_build_hybrid, name="muon"), _HYBRID_KWARGS, needs_module=True)
register_gp("signum", Signum)
register_gp("adamuon", functools.partial(_build_hybrid, name="adamuon"), _HYBRID_KWARGS | {"beta2"},
            needs_module=True)
register_gp("lion", Lion)
for _peer, (_, _kwargs) in PEERS.items():   # SOAP, Shampoo, PSGD-Kron from pytorch-optimizer (dopr/gp/peers.py)
    register_gp(_peer, functools.partial(build_peer, name=_peer), _kwargs, named=True)
