"""Optimizer checkpoints, sharded or not: the two calls a training loop makes, for DoPr or any
torch.optim optimizer.

Unsharded, they are ``opt.state_dict()`` and ``opt.load_state_dict()``. Under FSDP2 the GP's state is
gathered to full tensors with ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` (which
keeps only "state" and "param_groups"), and DoPr's own entry (``"dopr"``: step, EMAs gathered to
whole matrices, cached inverses, counters) is added beside it; loading splits them again. Every rank
must call both under FSDP2 (they are collectives)."""
from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from . import sharding

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
