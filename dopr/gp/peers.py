"""SOAP, Shampoo and PSGD-Kron as GPs: the classes of the package pytorch-optimizer (pyproject's `peers` extra),
with the package's own defaults, imported only when built. Two things the package does not guard are refused:

- Shampoo keeps two dim x dim matrices per dimension of every parameter and an SVD of each every step: a
  parameter with a dimension over :data:`SHAMPOO_MAX_DIM` (a token embedding's vocabulary) is refused, naming it.
- Kron applies its factors by one 5-operand ``torch.einsum``, which without opt_einsum contracts through the
  gradient's outer product, (m n)^2 numbers (issue 64): refused unless opt_einsum is there.
"""
import importlib
import importlib.util

import torch

PACKAGE, MODULE, EXTRA = "pytorch-optimizer", "pytorch_optimizer", "peers"

#: the largest dimension Shampoo is given (SOAP's max_precondition_dim default)
SHAMPOO_MAX_DIM = 10000

#: each peer's class in the package and the keywords it takes besides params, lr and weight_decay
#: (the class signature's; tests/suite/test_peers_gp.py checks them against the pinned version)
PEERS = {
    "soap": ("SOAP", ("betas", "shampoo_beta", "precondition_frequency", "max_precondition_dim", "merge_dims",
                      "precondition_1d", "correct_bias", "normalize_gradient", "data_format", "eps", "maximize")),
    "shampoo": ("Shampoo", ("momentum", "weight_decouple", "fixed_decay", "preconditioning_compute_steps",
                            "matrix_eps", "maximize")),
    "kron": ("Kron", ("momentum", "weight_decouple", "pre_conditioner_update_probability", "max_size_triangular",
                      "min_ndim_triangular", "memory_save_mode", "momentum_into_precondition_update", "mu_dtype",
                      "precondition_dtype", "balance_prob", "maximize")),
}


def _check_kron() -> None:
    if importlib.util.find_spec("opt_einsum") is None or not torch.backends.opt_einsum.enabled:
        raise RuntimeError(f"GP 'kron': {MODULE}.Kron applies its factors by a 5-operand torch.einsum, which without "
                           f"opt_einsum contracts through an (m n)^2 tensor per m x n weight; "
                           f"pip install 'dopr[{EXTRA}]' (opt-einsum) and keep torch.backends.opt_einsum enabled")


def _check_shampoo(params, names: dict) -> None:
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    for group in groups:
        ps = [group["params"]] if isinstance(group["params"], torch.Tensor) else group["params"]
        for p in ps:
            if max(p.shape, default=0) > SHAMPOO_MAX_DIM:
                what = f"parameter {names[p]!r}" if p in names else "a parameter"
                raise ValueError(f"GP 'shampoo': {what} of shape {tuple(p.shape)} would get a {max(p.shape)} x "
                                 f"{max(p.shape)} factor and its SVD every step ({MODULE}.Shampoo has no option to "
                                 f"leave a dimension over {SHAMPOO_MAX_DIM} alone): use soap or kron, which do, or "
                                 f"freeze that layer")


def build_peer(params, name: str, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.Optimizer:
    """``{MODULE}.<class>(params, lr=lr, weight_decay=weight_decay, **kwargs)`` for peer ``name``, after the
    refusals above; ``params`` may be (name, parameter) pairs, for the refusals to name the layer (the class gets
    the parameters alone, as a direct use of the package would). ImportError in one line without the package."""
    try:
        cls = getattr(importlib.import_module(MODULE), PEERS[name][0])
    except ImportError as e:
        raise ImportError(f"GP {name!r} is {MODULE}.{PEERS[name][0]} from the {PACKAGE} package, which is not "
                          f"installed: pip install 'dopr[{EXTRA}]'") from e
    params = list(params)
    names = {p: n for n, p in params} if params and isinstance(params[0], tuple) else {}
    params = [p for _, p in params] if names else params
    if name == "kron":
        _check_kron()
    if name == "shampoo":
        _check_shampoo(params, names)
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs)
