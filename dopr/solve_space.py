"""Where ``solve_space="auto"`` solves a group (issue 73): in sample space (dopr/sample_space.py) only where that
is faster on the device, by its measured table (SOLVE_SPACE_TABLE, dopr/tables: "samples" kept only where it beat
feature space beyond the repeats' spread, read only within the measured sizes), else by a FLOP rule
(:func:`flop_space`: for a square layer n < 0.42 d on the CPU, n < 0.55 d elsewhere). At the step,
:func:`choose` decides per group from its rows n, dimension d and gradient rows d_out; a group put in feature
space becomes Sigma's sums.
"""
from __future__ import annotations

from collections import OrderedDict
from . import tables
from .sample_space import SampleRows

SPACES = ("features", "samples")

#: per device type, {(n, d, d_out): space} measured there, or one space name for every size with n < d
SOLVE_SPACE_TABLE: dict = tables.load("solve_space")

#: per device type, what one float64 FLOP on the sample space's n x n side costs in float32 FLOPs: 2 on a CPU
#: (half as many float64 numbers per vector); elsewhere 1 (H100, H200, A100: float64 at float32's rate w/o TF32)
FLOAT64_COST = {"cpu": 2.0}


def space_cost(space: str, n: int, d: int, d_out: int, float64_cost: float = 1.0) -> float:
    """FLOPs of one refresh and apply in ``space`` for n rows of dimension d applied to d_out gradient rows: the
    sample space's n x n side (float64) counted ``float64_cost`` times."""
    if space == "features":
        return 2 * n * d * d + d**3 / 3 + 2 * d_out * d * d
    return float64_cost * (2 * n * n * d + n**3 / 3 + 2 * d_out * n * n) + 4 * d_out * n * d


def flop_space(device_type: str, n: int, d: int, d_out: int) -> str:
    """The space of fewer weighted FLOPs (:func:`space_cost`); feature space on a tie or when n >= d."""
    if n >= d:
        return "features"
    w = FLOAT64_COST.get(device_type, 1.0)
    return "samples" if space_cost("samples", n, d, d_out, w) < space_cost("features", n, d, d_out) else "features"


def _coordinates(point: tuple) -> tuple:
    """(d, n / d, d_out / d): the grid the crossover benchmark measures (sizes as multiples of d)."""
    n, d, d_out = point
    return d, max(n, 1) / d, max(d_out, 1) / d


def solve_space(device_type: str, n: int, d: int, d_out: int) -> str:
    """The space for n rows of dimension d applied to d_out gradient rows: features when n >= d, else the
    table's nearest point within its measured sizes (dopr.tables.lookup), else :func:`flop_space`."""
    if n >= d:
        return "features"
    table = SOLVE_SPACE_TABLE.get(device_type)
    if isinstance(table, str):
        return table
    default = flop_space(device_type, n, d, d_out)
    return default if table is None else tables.lookup(table, (n, d, d_out), _coordinates, default)


def space_table(records: list) -> dict:
    """{(n, d, d_out): space} from timings [{"n", "d", "d_out", "ms": {space: [repeats]}}] (dopr.tables.keep)."""
    return {(r["n"], r["d"], r["d_out"]): tables.keep(r["ms"], "features") for r in records}


def group_rows(key: tuple, grads: dict) -> int:
    """The gradient rows a group's operator is applied to: its layers' (``grads``: {name: helper}) summed."""
    return sum(grads[name].grad_shape()[0] for name in key if name in grads)


def choose(groups: "OrderedDict", grads: dict) -> "OrderedDict":
    """solve_space "auto": each group held as "auto" rows that :func:`solve_space` puts in feature space becomes
    Sigma's sums."""
    out = OrderedDict()
    for key, stat in groups.items():
        if isinstance(stat, SampleRows) and stat.auto:
            n, d = stat.rows.shape
            if solve_space(stat.rows.device.type, n, d, group_rows(key, grads)) == "features":
                dense = stat.to_dense()
                dense.extras = stat.extras
                stat = dense
        out[key] = stat
    return out

