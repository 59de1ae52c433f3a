"""Optimizer checkpoints, sharded or not, for DoPr or any torch.optim optimizer: ``opt.state_dict()`` and
``opt.load_state_dict()``, or under FSDP2 (collectives: every rank calls them) ``torch.distributed.checkpoint``'s
full optimizer state dict with DoPr's own entry (``"dopr"``) beside it. The AP's entry itself (DoPr.ap_state_dict)."""
from __future__ import annotations

import warnings
from torch import nn
from torch.optim import Optimizer

from . import sharding
from .statistics import statistics_dtype

#: the entry of an optimizer state dict that holds DoPr's own state
KEY = "dopr"


def _is_sharded(model: nn.Module) -> bool:
    return any(sharding.is_sharded(p) for p in model.parameters())


def optimizer_state_dict(model: nn.Module, opt: Optimizer) -> dict:
    """`opt`'s state dict; under FSDP2 with full tensors on the CPU (all ranks call it)."""
    if not _is_sharded(model):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    ap = getattr(opt, "ap_state_dict", None)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = get_optimizer_state_dict(model, getattr(opt, "base", opt) if ap else opt, options=options)
    if ap is not None:
        out[KEY] = ap()
    return out


def load_optimizer_state_dict(model: nn.Module, opt: Optimizer, state: dict) -> None:
    """Restore what :func:`optimizer_state_dict` saved (all ranks call it under FSDP2). A DoPr refuses a
    plain optimizer's state (no ``"dopr"`` entry), naming it."""
    if not _is_sharded(model):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = dict(state)
    ap = state.pop(KEY, None)
    is_dopr = hasattr(opt, "load_ap_state_dict")
    if is_dopr and ap is None:
        raise ValueError(f"the optimizer state has no {KEY!r} entry: it was not saved from a DoPr optimizer")
    set_optimizer_state_dict(model, opt.base if is_dopr else opt, state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    if is_dopr:
        opt.load_ap_state_dict(ap)


def ap_state(options, refresh, step: int, warmed: int, grad_ema: dict) -> dict:
    """DoPr.ap_state_dict: the entry ``"dopr"`` of a DoPr's state dict."""
    state = refresh.state_dict()
    policy = state.pop("refresh_policy", None)
    return {"step": step, "warmed": warmed, "grad_ema": grad_ema, **state, "options": options.describe(),
            **({"refresh_policy": policy} if policy else {})}


def placement(helpers: dict):
    """names -> the dtype and device of the layers' statistics (``helpers``: {name: helper})."""
    def to(names: tuple) -> dict:
        w = next((helpers[n].module.weight for n in names if n in helpers), None)
        return {} if w is None else {"dtype": statistics_dtype(w.dtype), "device": w.device}
    return to


def load_ap_state(ours: dict, options, refresh, applied, helpers: dict) -> tuple:
    """DoPr.load_ap_state_dict: restore :func:`ap_state`'s entry, warning about other options; (step, warmed)."""
    mine = options.describe()
    differ = {k: (v, mine[k]) for k, v in ours.get("options", {}).items()
              if k in mine and mine[k] != (tuple(v) if k == "skip_layers" else v)}
    if differ:
        warnings.warn("DoPr.load_state_dict: the checkpoint was saved with other AP options: "
                      + ", ".join(f"{k}={a!r} (this optimizer: {b!r})" for k, (a, b) in sorted(differ.items()))
                      + "; loading it anyway, this optimizer's options apply from here on", UserWarning,
                      stacklevel=4)
    to = placement(helpers)
    applied.load_state_dict(ours["grad_ema"], helpers, to)
    refresh.load_state_dict(ours, helpers, to)
    return ours["step"], ours.get("warmed", options.warmup_steps)   # older checkpoints: past any warm-up
