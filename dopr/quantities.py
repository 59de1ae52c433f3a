"""Per-layer quantities a damping rule reads besides Sigma (issue 75 item 2). The capture computes the ones a
rule names in ``DampingRule.reads`` each forward into the statistic's ``extras`` ({name: 0-d device tensor}),
combined across micro-batches and ranks by the declared merge ("sum" or "max")::

    register_quantity("max_row_norm", lambda helper, x, rows: helper.activations(x).square().sum(-1).max(),
                      merge="max")

The sample count (dopr/sample_count.py, "samples") is registered this way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

#: the merges a quantity may declare, and each one's all-reduce op
MERGES = {"sum": torch.add, "max": torch.maximum}


@dataclass(frozen=True)
class Quantity:
    """``compute(helper, x, rows)``: one forward's value, a 0-d device tensor; ``merge``: "sum" or "max";
    ``missing(count)``: what stands in for a statistic that lacks it (None: the other side's value as it is)."""

    name: str
    compute: Callable
    merge: str = "sum"
    missing: Optional[Callable] = None

    def combine(self, a, b):
        return MERGES[self.merge](a, b) if self.merge != "sum" else a + b


QUANTITIES: dict = {}


def register_quantity(name: str, compute: Callable, merge: str = "sum", missing: Optional[Callable] = None) -> Quantity:
    if merge not in MERGES:
        raise ValueError(f"quantity {name!r}: merge must be one of {sorted(MERGES)}, got {merge!r}")
    QUANTITIES[name] = q = Quantity(name, compute, merge, missing)
    return q


def quantity(name: str) -> Quantity:
    try:
        return QUANTITIES[name]
    except KeyError:
        raise KeyError(f"no per-layer quantity {name!r} is registered (dopr.quantities.register_quantity); "
                       f"registered: {sorted(QUANTITIES)}") from None


def compute(names: tuple, helper, x, rows: int) -> dict:
    """{name: value} of the quantities ``names`` for one forward's input x."""
    return {n: quantity(n).compute(helper, x, rows) for n in names}


def merged(a: dict, a_count: float, b: dict, b_count: float) -> dict:
    """The quantities of two statistics added together (``count``: each one's rows, for ``missing``)."""
    if not a and not b:
        return {}
    out = {}
    for name in list(a) + [n for n in b if n not in a]:
        q = quantity(name)
        if name in a and name in b:
            out[name] = q.combine(a[name], b[name])
        elif q.missing is None:
            out[name] = a[name] if name in a else b[name]
        elif name in a:
            out[name] = q.combine(a[name], q.missing(b_count))
        else:
            out[name] = q.combine(q.missing(a_count), b[name])
    return out


def stand_in(name: str, count):
    """What a statistic without quantity ``name`` contributes to an all-reduce: ``missing(count)`` or the identity."""
    q = quantity(name)
    if q.missing is not None:
        return q.missing(count)
    return torch.zeros_like(count) if q.merge == "sum" else torch.full_like(count, -torch.inf)
