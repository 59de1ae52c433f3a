"""SOAP, Shampoo and PSGD-Kron, the preconditioned optimizers users pick instead of DoPr, as GPs: the classes
of the published package pytorch-optimizer (pinned in pyproject's `peers` extra), built with the package's
own defaults and imported only when built (dopr itself depends on torch alone).

The package routes what each peer cannot precondition by its own options: SOAP leaves 1-d parameters and
dimensions over ``max_precondition_dim`` to plain Adam, Kron gives 1-d parameters and dimensions over
``max_size_triangular`` (or all of them, ``memory_save_mode``) a diagonal factor. Two things it does not
guard are refused here in one line:

- Shampoo keeps two dim x dim matrices for every dimension of every parameter and takes an SVD of each on
  every step, with no option to leave a large dimension out; a parameter with a dimension over
  :data:`SHAMPOO_MAX_DIM` (a token embedding's vocabulary) is refused, naming it.
- Kron applies its factors by one 5-operand ``torch.einsum``, which torch contracts left to right unless
  opt_einsum is installed: through the gradient's outer product, (m n)^2 numbers (64 GB asked for a 4-block
  transformer's embedding, issue 64). Kron is refused where torch would contract that way.
"""
import importlib
import importlib.util

import torch

PACKAGE, MODULE, EXTRA = "pytorch-optimizer", "pytorch_optimizer", "peers"

#: the largest dimension Shampoo is given: pytorch_optimizer's SOAP preconditions dimensions up to its
#: max_precondition_dim default, 10000, and leaves larger ones alone; Shampoo cannot leave them alone
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


def package_class(name: str):
    """The package's class of peer ``name``; ImportError in one line when the package is not installed."""
    cls = PEERS[name][0]
    try:
        return getattr(importlib.import_module(MODULE), cls)
    except ImportError as e:
        raise ImportError(f"GP {name!r} is {MODULE}.{cls} from the {PACKAGE} package, which is not installed: "
                          f"pip install 'dopr[{EXTRA}]'") from e


def _names_and_params(params) -> tuple:
    """(names by parameter, what the package's class is given): (name, parameter) pairs, as
    :func:`dopr.gp.build_gp` passes a model's, become the parameters alone, so that the optimizer (and its
    state_dict) is the one a direct use of the package builds."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        return {p: n for n, p in params}, [p for _, p in params]
    return {}, params


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
    refusals above; ``params`` may be (name, parameter) pairs, for the refusals to name the layer."""
    cls = package_class(name)
    names, params = _names_and_params(params)
    if name == "kron":
        _check_kron()
    if name == "shampoo":
        _check_shampoo(params, names)
    return cls(params, lr=lr, weight_decay=weight_decay, **kwargs)
