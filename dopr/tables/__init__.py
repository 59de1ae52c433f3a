"""Measured per-device tables (issue 73): the Cholesky route (dopr.solvers) and the solve space (dopr.solve_space)
measured fastest on one kind of device. A table is ``{point: choice}``, in the module ``<kind>_<device type>.py``
here (``TABLE`` and the ``SOURCE`` that measured it), written by a benchmark's ``--table-out`` (:func:`write`)
and read at import (:func:`load`). A choice other than the default is kept only where it beat the default
beyond the spread of the repeats (:func:`keep`), and read only within the measured sizes (:func:`lookup`): it
is never extrapolated.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
import statistics
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

#: how far (a factor, in every coordinate) a size may lie outside the measured box and still be read from the
#: table: d = 1025 (a bias's 1 on 1024 inputs) is within the sizes measured at d = 1024, d = 2100 is not
BOX_MARGIN = 1.1


def keep(times: Mapping[str, Sequence[float]], default: str) -> str:
    """``default`` unless another choice's slowest repeat beat the default's fastest (of several, the least median)."""
    floor = min(times[default])
    faster = [c for c, t in times.items() if c != default and max(t) < floor]
    return min(faster, key=lambda c: statistics.median(times[c])) if faster else default


def lookup(table: Mapping[tuple, str], point: tuple, coordinates: Callable[[tuple], tuple],
           default: str) -> str:
    """The choice of the measured point nearest to ``point`` in log ``coordinates(point)``; ``default`` outside
    the measured box (BOX_MARGIN), for an empty table, or on a tie."""
    if not table:
        return default
    logs = {key: [math.log(c) for c in coordinates(key)] for key in table}
    here = [math.log(c) for c in coordinates(point)]
    margin = math.log(BOX_MARGIN)
    for i, x in enumerate(here):
        column = [v[i] for v in logs.values()]
        if not min(column) - margin <= x <= max(column) + margin:
            return default
    distance = {key: round(math.dist(v, here), 9) for key, v in logs.items()}
    return table[min(table, key=lambda key: (distance[key], table[key] != default))]


def load(kind: str) -> dict:
    """{device type: TABLE} of the modules ``<kind>_<device type>`` here."""
    out = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith(kind + "_"):
            out[module.name[len(kind) + 1:]] = dict(importlib.import_module(f"{__name__}.{module.name}").TABLE)
    return out


def module_text(kind: str, device: str, table: Mapping[tuple, str], source: str) -> str:
    """The text of a table's module (:func:`load` reads its TABLE)."""
    rows = "".join(f"    {key!r}: {value!r},\n" for key, value in sorted(table.items()))
    return (f'"""The {kind} table for device type {device!r} (dopr/tables/__init__.py: how it is built and read).\n'
            f'Written by the benchmark named in SOURCE; rerun it to replace this file."""\n\n'
            f"SOURCE = {source!r}\n\nTABLE = {{\n{rows}}}\n")


def write(path, kind: str, device: str, table: Mapping[tuple, str], source: str) -> Optional[Path]:
    """Write a table's module to ``path``; None does nothing."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(module_text(kind, device, table, source))
    return path
