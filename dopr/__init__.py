"""dopr: Double Preconditioning. The activation preconditioner (AP) of the paper, wrapped around
any gradient preconditioner (GP): SGD, AdamW, Muon, Signum, AdaMuon, Lion, the peers SOAP, Shampoo and
PSGD-Kron (pytorch-optimizer's, dopr.gp.peers), or one added with register_gp."""
from .compiled import enable_compiled_capture
from .factory import NAMES, build, names
from .gp import SGD, AdaMuon, HybridOptimizer, Lion, Signum, build_gp, register_gp
from .layers import CoverageEntry, register_layer
from .names import optimizer_name, split_name
from .optimizer import DoPr
from .options import DoPrOptions

__all__ = ["DoPr", "DoPrOptions", "build", "build_gp", "register_gp", "NAMES", "names", "optimizer_name",
           "split_name", "SGD", "Signum", "Lion", "AdaMuon", "HybridOptimizer",
           "CoverageEntry", "register_layer", "enable_compiled_capture"]
__version__ = "0.1.0"
