"""Gradient preconditioners (GPs): the optimizers that take the step after DoPr's activation
preconditioner has rewritten the gradients."""

import torch
from torch import nn

from .adamuon import AdaMuon
from .muon import HybridOptimizer, Muon, mark_role, route_matrix_params
from .newton_schulz import newton_schulz5
from .sgd import SGD
from .signum import Signum

__all__ = ["SGD", "Signum", "AdaMuon", "Muon", "HybridOptimizer", "mark_role", "route_matrix_params", "newton_schulz5",
           "build_gp"]

# Keyword arguments each GP accepts in build_gp, besides lr and weight_decay.
GP_KWARGS = {
    "sgd": {"momentum", "nesterov"},
    "adamw": {"betas", "eps"},
    "signum": {"momentum"},
    "muon": {"momentum", "nesterov", "adjust_lr_fn", "ns_steps",
             "betas", "eps", "adamw_lr", "head_names", "input_layer", "input_names", "conv"},
    "adamuon": {"momentum", "nesterov", "beta2", "ns_steps", "adjust_lr_fn",
                "betas", "eps", "adamw_lr", "head_names", "input_layer", "input_names", "conv"},
}


def build_gp(model_or_params_source, name: str, lr: float, weight_decay: float = 0.0,
             **kwargs) -> torch.optim.Optimizer:
    """Build the gradient preconditioner ``name`` over the trainable parameters of a model.

    ``name`` is one of "sgd", "adamw", "signum" (an ``nn.Module`` or an iterable of
    parameters / param groups), or "muon", "adamuon" (an ``nn.Module`` only). The last two
    return a :class:`HybridOptimizer`: Muon / AdaMuon on the hidden ``nn.Linear`` weights
    (see :func:`route_matrix_params`; ``input_layer="muon"`` adds the input layer) and AdamW, at
    ``adamw_lr`` (default ``lr``), on the rest; a member with no parameters is left out.
    ``adjust_lr_fn`` is the Muon step scale, with torch.optim.Muon's names: ``"original"``
    (sqrt(max(1, m/n)), Keller Jordan's Muon, torch's default); ``conv="flatten"`` gives
    convolutions to Muon / AdaMuon as (out, in x kernel) matrices (default ``"adamw"``) or ``"match_rms_adamw"``
    (0.2 sqrt(max(m, n)): update RMS 0.2, AdamW's rates carry over). ``eps`` and ``betas`` go to AdamW (``eps``
    to AdaMuon too). Keywords a GP does not take raise ``TypeError``.
    """
    if name not in GP_KWARGS:
        raise ValueError(f"Unknown gradient preconditioner {name!r}; "
                         f"valid names: {list(GP_KWARGS)}")
    unknown = sorted(set(kwargs) - GP_KWARGS[name])
    if unknown:
        raise TypeError(f"Unexpected arguments for GP {name!r}: {unknown}; "
                        f"it accepts {sorted(GP_KWARGS[name])}")

    source = model_or_params_source
    if name in ("muon", "adamuon"):
        if not isinstance(source, nn.Module):
            raise TypeError(f"GP {name!r} routes parameters by module and needs an nn.Module, "
                            f"got {type(source).__name__}")
        return _build_hybrid(source, name, lr, weight_decay, **kwargs)

    if isinstance(source, nn.Module):
        params = [p for p in source.parameters() if p.requires_grad]
    else:
        params = source
    if name == "sgd":
        return SGD(params, lr, weight_decay=weight_decay, **kwargs)
    if name == "signum":
        return Signum(params, lr, weight_decay=weight_decay, **kwargs)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)


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
        raise ValueError("optimizer got an empty parameter list: the model has no trainable "
                         "parameters")
    return HybridOptimizer(members)
