"""Optimizer checkpoints, sharded or not: the two calls a training loop makes, for DoPr or any
torch.optim optimizer.

Unsharded, they are ``opt.state_dict()`` and ``opt.load_state_dict()``. Under FSDP2 the GP's state is
gathered to full tensors with ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` (which
keeps only "state" and "param_groups"), and DoPr's own entry (``"dopr"``: step, EMAs gathered to
whole matrices, cached inverses, counters) is added beside it; loading splits them again. Every rank
must call both under FSDP2 (they are collectives)."""
from __future__ import annotations

import warnings
from collections import defaultdict

from torch import nn
from torch.optim import Optimizer

from . import sharding, solvers
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


def ap_state(opt) -> dict:
    """DoPr.ap_state_dict: the entry ``"dopr"`` of a DoPr's state dict (its damping rule's state as
    ``damping_scale`` and its counters among ``counts``, the layout of checkpoints before dopr/damping.py)."""
    rule = opt._damping.state_dict()
    return {
        "step": opt._step,
        "warmed": opt._warmed,
        "grad_ema": opt._grad_ema.state_dict(opt._helpers(), whole=True),
        "precond_ema": opt._precond_ema.state_dict(),
        "cache": {"|".join(k): solvers.operator_state(op) for k, op in opt._cache.items()},
        "counts": {**opt._counts, **rule["counts"]},
        "damping_scale": rule["damping_scale"],
        "unfactored": sorted(opt._unfactored),
        "idle": sorted(opt._idle),
        "options": opt.options.describe(),
        **({"refresh_policy": policy} if (policy := opt._policy.state_dict()) else {}),   # a stateful policy's
    }


def cache_on_layers(cache: dict, helpers: dict) -> dict:
    """The cached factors {group key: operator} in their layers' statistics dtype and on their device (a
    checkpoint from another dtype or device, a model converted between refreshes: cast once, where they
    differ); a float64 sample-space factor keeps its dtype (bit-identical resume). ``helpers``: {name: helper}."""
    out = {}
    for key, op in cache.items():
        w = next((helpers[n].module.weight for n in key if n in helpers), None)
        out[key] = op if w is None else solvers.operator_to(op, statistics_dtype(w.dtype), w.device)
    return out


def load_ap_state(opt, ours: dict) -> None:
    """DoPr.load_ap_state_dict: restore :func:`ap_state`'s entry into `opt`, warning about other options."""
    mine = opt.options.describe()
    differ = {k: (v, mine[k]) for k, v in ours.get("options", {}).items()
              if k in mine and mine[k] != (tuple(v) if k == "skip_layers" else v)}
    if differ:
        warnings.warn("DoPr.load_state_dict: the checkpoint was saved with other AP options: "
                      + ", ".join(f"{k}={a!r} (this optimizer: {b!r})" for k, (a, b) in sorted(differ.items()))
                      + "; loading it anyway, this optimizer's options apply from here on", UserWarning,
                      stacklevel=4)
    opt._step = ours["step"]
    opt._warmed = ours.get("warmed", opt.options.warmup_steps)  # older checkpoints: past any warm-up
    helpers = opt._helpers()

    def to(names: tuple) -> dict:   # the dtype and device of the layers' statistics, as saved elsewhere
        w = next((helpers[n].module.weight for n in names if n in helpers), None)
        return {} if w is None else {"dtype": statistics_dtype(w.dtype), "device": w.device}

    opt._grad_ema.load_state_dict(ours["grad_ema"], helpers, to)
    opt._precond_ema.load_state_dict(ours["precond_ema"], to)
    opt._cache = cache_on_layers({tuple(k.split("|")): solvers.operator_from_state(s) for k, s in ours["cache"].items()},
                                 helpers)
    # checkpoints written before the step counter was kept once also hold it as counts["steps"]
    opt._counts = defaultdict(int, {k: v for k, v in ours["counts"].items()
                                    if k != "steps" and k not in opt._damping.COUNTERS})
    opt._damping.load_state_dict(ours)
    opt._unfactored, opt._idle = set(ours.get("unfactored", ())), set(ours.get("idle", ()))
    opt._policy.load_state_dict(ours.get("refresh_policy", {}))
    opt._capture.collecting = opt.collecting
