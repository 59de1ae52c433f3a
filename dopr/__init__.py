"""dopr: Double Preconditioning. The activation preconditioner (AP) of the paper, wrapped around
any gradient preconditioner (GP): SGD, AdamW, Muon, Signum, AdaMuon."""
from .compiled import enable_compiled_capture
from .factory import NAMES, build
from .gp import SGD, AdaMuon, HybridOptimizer, Signum, build_gp
from .layers import CoverageEntry, register_layer
from .optimizer import DoPr
from .options import DoPrOptions

__all__ = ["DoPr", "DoPrOptions", "build", "build_gp", "NAMES", "SGD", "Signum", "AdaMuon", "HybridOptimizer",
           "CoverageEntry", "register_layer", "enable_compiled_capture"]
__version__ = "0.1.0"
