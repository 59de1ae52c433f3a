"""DoPr's options: their allowed values, one check that names the first bad one, and what the
damping mode means."""
from __future__ import annotations

import torch
from torch import Tensor

from . import solvers

DAMPING_MODES = ("trace", "trace_per_dim", "absolute")
CONV2D_MODES = ("full", "sua")
NONFINITE = ("skip", "raise")


def check_options(options: dict) -> dict:
    """Raise ValueError naming the first invalid option of DoPr (see its docstring for each); the
    options, skip_layers as a tuple."""
    (damping, damping_mode, grad_ema, precond_ema, solver, precond_every, conv2d, homogeneous, rank, eigh_rcond,
     on_nonfinite, warmup_steps, clip_precond_norm, health_every) = (options.get(k) for k in (
        "damping", "damping_mode", "grad_ema", "precond_ema", "solver", "precond_every", "conv2d", "homogeneous",
        "rank", "eigh_rcond", "on_nonfinite", "warmup_steps", "clip_precond_norm", "health_every"))
    if health_every is not None and not (isinstance(health_every, int) and not isinstance(health_every, bool)
                                         and health_every >= 0):
        raise ValueError(f"Invalid health_every: {health_every} (must be an integer >= 0)")
    if not (isinstance(damping, (int, float)) and not isinstance(damping, bool) and 0.0 <= damping < float("inf")):
        raise ValueError(f"Invalid damping: {damping} (must be a finite number >= 0)")
    if damping_mode not in DAMPING_MODES:
        raise ValueError(f"Invalid damping_mode: {damping_mode!r} (choose from {DAMPING_MODES})")
    for nm, beta in (("grad_ema", grad_ema), ("precond_ema", precond_ema)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {nm}: {beta} (must be in [0, 1))")
    if solver not in solvers.SOLVERS:
        raise ValueError(f"Invalid solver: {solver!r} (choose from {tuple(solvers.SOLVERS)})")
    if not (isinstance(precond_every, int) and precond_every >= 1):
        raise ValueError(f"Invalid precond_every: {precond_every} (must be an integer >= 1)")
    if not (isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0):
        raise ValueError(f"Invalid warmup_steps: {warmup_steps} (must be an integer >= 0)")
    if clip_precond_norm is not None and not (isinstance(clip_precond_norm, (int, float)) and clip_precond_norm > 0):
        raise ValueError(f"Invalid clip_precond_norm: {clip_precond_norm} (must be > 0 or None)")
    if conv2d not in CONV2D_MODES:
        raise ValueError(f"Invalid conv2d mode: {conv2d!r} (choose from {CONV2D_MODES})")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ValueError(f"Invalid rank: {rank} (must be an integer >= 1)")
    if not (isinstance(eigh_rcond, (int, float)) and 0.0 <= eigh_rcond < 1.0):
        raise ValueError(f"Invalid eigh_rcond: {eigh_rcond} (must be in [0, 1))")
    if not isinstance(homogeneous, bool):
        raise ValueError(f"Invalid homogeneous: {homogeneous!r} (must be True or False)")
    skip_layers = options.get("skip_layers", ())
    if isinstance(skip_layers, str) or not all(isinstance(k, str) and k for k in skip_layers):
        raise ValueError(f"Invalid skip_layers: {skip_layers!r} (must be a list of module or class names)")
    if on_nonfinite not in NONFINITE:
        raise ValueError(f"Invalid on_nonfinite: {on_nonfinite!r} (choose from {NONFINITE})")
    return {**options, "skip_layers": tuple(skip_layers)}


def damping(gamma: float, mode: str, diag: Tensor) -> Tensor:
    """The absolute damping lambda added to Sigma's diagonal (``diag``, or a batch of diagonals on its
    last axis): gamma * tr(Sigma) ("trace"), gamma * tr(Sigma) / d ("trace_per_dim") or gamma ("absolute")."""
    if mode == "trace":
        return gamma * diag.sum(-1)
    if mode == "trace_per_dim":
        return gamma * diag.sum(-1) / diag.shape[-1]
    return torch.full(diag.shape[:-1], gamma, dtype=diag.dtype, device=diag.device)
