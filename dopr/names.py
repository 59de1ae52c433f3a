"""An optimizer's name, derived from its identity (gp, ap): ``gp`` for the GP alone, ``"dopr_" + gp`` for
DoPr over it. The names label runs (folders, summary.json's "optim", reports); :func:`split_name` is the
one reader of a name back into (gp, ap), for the runs written by name and the deprecated
``dopr.build(model, "dopr_<gp>")``. Nothing else parses the prefix (tests/suite/test_layout.py)."""
from __future__ import annotations

AP_PREFIX = "dopr_"


def optimizer_name(gp: str, ap) -> str:
    """The name of GP ``gp`` alone (``ap`` false or None) or wrapped in DoPr: "adamw", "dopr_adamw"."""
    return AP_PREFIX + gp if ap not in (None, False) else gp


def split_name(name: str) -> tuple:
    """(gp, ap) of an optimizer name: ("adamw", True) for "dopr_adamw", ("adamw", False) for "adamw".
    Syntax only (reports read names of runs); :func:`dopr.build` checks that the GP is registered."""
    return (name[len(AP_PREFIX):], True) if name.startswith(AP_PREFIX) else (name, False)
