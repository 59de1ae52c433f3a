"""dopr: Double Preconditioning. The activation preconditioner (AP) of the paper, wrapped around
any gradient preconditioner (GP): SGD, AdamW, Muon, Signum, AdaMuon."""
from .layers import CoverageEntry, register_layer
from .optimizer import DoPr

__all__ = ["DoPr", "CoverageEntry", "register_layer"]
__version__ = "0.1.0"
