"""Where ``solve_space="auto"`` solves a group (issue 73): in sample space (dopr/sample_space.py) only where that is
faster on the device, by the device's measured table, else by a FLOP rule; not by n < d alone.

The capture keeps a forward's rows where they are fewer than d (dopr.sample_space.RowsOrCovariance: the
candidates). At the step, once every micro-batch and rank is in, :func:`choose` decides per group from its
rows n, its dimension d and the gradient rows d_out its operator is applied to (the layers' summed over a group
sharing one Sigma): a group the rule puts in feature space becomes Sigma's sums (``to_dense``: the same
Sigma as the capture forms with solve_space="features" from one forward) and takes the feature-space solve.

* The table, SOLVE_SPACE_TABLE[device type] (dopr/tables: the module solve_space_<device type>.py, written by
  ``python -m benchmarks.bench_solvers --space-crossover --table-out ...``): {(n, d, d_out): "samples" or
  "features"} at the measured points, "samples" only where the sample-space step's slowest repeat beat the
  feature-space step's fastest (dopr.tables.keep: sample space is the fast path, feature space the default).
  Read at the nearest measured point in (log d, log n/d, log d_out/d), and only within the measured sizes
  (dopr.tables.lookup); one of "samples" / "features" instead of a table forces it wherever n < d ("samples":
  the rule before issue 73).
* The FLOP rule (:func:`flop_space`), elsewhere: sample space where its FLOPs (:func:`space_cost`, the n x n
  side weighted by FLOAT64_COST) are fewer than the feature-space solve's: for a square layer (d_out = d)
  where n < 0.42 d on the CPU and n < 0.55 d elsewhere; for d_out = d / 64, n < 0.58 d and 0.98 d.
"""
from __future__ import annotations

from collections import OrderedDict
from . import tables
from .sample_space import SampleRows

SPACES = ("features", "samples")

#: per device type, {(n, d, d_out): "samples" | "features"} measured on that device, or one space name for
#: every size with n < d; a device type without an entry gets :func:`flop_space`
SOLVE_SPACE_TABLE: dict = tables.load("solve_space")

#: per device type, what one FLOP on the sample space's n x n side (float64, dopr.sample_space.SAMPLE_SPACE_DTYPE)
#: costs in float32 FLOPs: 2 on a CPU (its vector units hold half as many float64 numbers); elsewhere 1 (the
#: data-centre GPUs' float64 GEMM runs at their float32 rate without TF32: H100, H200, A100)
FLOAT64_COST = {"cpu": 2.0}


def space_cost(space: str, n: int, d: int, d_out: int, float64_cost: float = 1.0) -> float:
    """FLOPs of one refresh and apply in ``space`` for n rows of dimension d applied to d_out gradient rows
    (a multiply-add counted as 2): features, Sigma = X^T X 2 n d^2, its Cholesky factor d^3/3, two triangular
    solves 2 d_out d^2; samples, K = X X^T 2 n^2 d, its factor n^3/3 and the solve against it 2 d_out n^2 in
    float64 (each FLOP counted ``float64_cost`` times), G X^T and Y X 4 d_out n d in float32."""
    if space == "features":
        return 2 * n * d * d + d**3 / 3 + 2 * d_out * d * d
    return float64_cost * (2 * n * n * d + n**3 / 3 + 2 * d_out * n * n) + 4 * d_out * n * d


def flop_space(device_type: str, n: int, d: int, d_out: int) -> str:
    """The space of fewer weighted FLOPs on the device type (:func:`space_cost`, FLOAT64_COST), feature space
    on a tie or when n >= d."""
    if n >= d:
        return "features"
    w = FLOAT64_COST.get(device_type, 1.0)
    return "samples" if space_cost("samples", n, d, d_out, w) < space_cost("features", n, d, d_out) else "features"


def _coordinates(point: tuple) -> tuple:
    """(d, n / d, d_out / d): the grid the crossover benchmark measures (sizes as multiples of d)."""
    n, d, d_out = point
    return d, max(n, 1) / d, max(d_out, 1) / d


def solve_space(device_type: str, n: int, d: int, d_out: int) -> str:
    """"samples" or "features" for a group of n rows of dimension d whose operator is applied to d_out gradient
    rows on ``device_type``: feature space when n >= d; else the measured table's nearest point within its
    measured sizes, else :func:`flop_space`."""
    if n >= d:
        return "features"
    table = SOLVE_SPACE_TABLE.get(device_type)
    if isinstance(table, str):
        return table
    default = flop_space(device_type, n, d, d_out)
    return default if table is None else tables.lookup(table, (n, d, d_out), _coordinates, default)


def space_table(records: list) -> dict:
    """The table to keep from crossover timings: ``records`` [{"n", "d", "d_out", "ms": {"features": [repeats],
    "samples": [repeats]}}] -> {(n, d, d_out): space}, "samples" only where it beat feature space beyond the
    spread of the repeats (dopr.tables.keep, feature space the default)."""
    return {(r["n"], r["d"], r["d_out"]): tables.keep(r["ms"], "features") for r in records}


def group_rows(key: tuple, grads: dict) -> int:
    """The gradient rows a group's operator is applied to: its layers' (``grads``: {name: helper}) summed."""
    return sum(grads[name].grad_shape()[0] for name in key if name in grads)


def choose(groups: "OrderedDict", grads: dict) -> "OrderedDict":
    """solve_space "auto": each group held as rows (the capture's candidates, dopr.sample_space.SampleRows with
    ``auto``) that :func:`solve_space` puts in feature space becomes Sigma's sums; the others are kept."""
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

