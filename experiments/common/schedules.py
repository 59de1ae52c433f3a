"""Learning-rate schedules as LambdaLR factors of the base rate, by the number of steps taken.

``warmup_cosine``: linear warmup over ``warmup_frac`` of the steps (from 1/warmup to 1), then a
cosine from 1 down to ``min_factor``; ``constant``: 1 (no warmup); ``cosine``: Hugging Face's
(``transformers.get_scheduler("cosine")``, the LLM family's, as the paper's SFT runs): its warmup starts
from 0, its cosine ends at 0. Hugging Face's "constant" is this ``constant``."""
from __future__ import annotations

import math

import torch

SCHEDULES = ("warmup_cosine", "constant", "cosine")


def warmup_cosine(total: int, warmup_frac: float, min_factor: float = 0.0):
    warmup = max(1, int(round(warmup_frac * total)))

    def factor(step: int) -> float:  # step = number of optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def constant(total: int = 0, warmup_frac: float = 0.0, min_factor: float = 1.0):
    return lambda step: 1.0


def hf_cosine(total: int, warmup_frac: float):
    """Hugging Face's get_cosine_schedule_with_warmup (one half cycle), factor for factor: linear warmup
    from 0 over round(warmup_frac * total) steps, then a cosine from 1 to 0."""
    warmup = round(warmup_frac * total)

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor


def build_schedule(opt: torch.optim.Optimizer, name: str, total: int, warmup_frac: float = 0.0,
                   min_factor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    if name not in SCHEDULES:
        raise ValueError(f"Invalid schedule: {name!r} (choose from {SCHEDULES})")
    if name == "cosine" and min_factor:
        raise ValueError(f"Invalid min_factor for schedule 'cosine': {min_factor} (Hugging Face's cosine ends at 0; "
                         "warmup_cosine has a floor)")
    factor = (warmup_cosine(total, warmup_frac, min_factor) if name == "warmup_cosine"
              else hf_cosine(total, warmup_frac) if name == "cosine" else constant())
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
