"""Parameter routing for Muon-style optimizers, and an optimizer that drives several as one."""

from collections import defaultdict
from collections.abc import Iterable

import math

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim import _muon

from .. import sharding
from .._optimizer_surface import init_hook_registries, needs_closure, with_load_hooks, with_state_dict_hooks
from .base import BaseGP, evaluate
from .newton_schulz import as_matrix, matrix_shape, newton_schulz5


class Muon(BaseGP, torch.optim.Muon):
    """torch.optim.Muon (same hyperparameters, state and update) with the orthogonalisation in float32 off CUDA.

    B <- mu B + (1 - mu) G, U = NS5(G + mu (B - G) if nesterov else B), W <- (1 - lr wd) W - lr' U with lr' from
    ``adjust_lr_fn``. torch's bfloat16 Newton-Schulz is ~50x slower than float32 on a CPU without bf16 matrix
    units; on CUDA this class uses bfloat16 too. Under FSDP2 each weight is gathered, orthogonalised whole and each
    rank applies its rows. A convolution's weight is the matrix (out, in x kernel), as in Keller Jordan's Muon.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=(_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C),
                 eps: float = _muon.EPS, ns_steps: int = _muon.DEFAULT_NS_STEPS, adjust_lr_fn=None) -> None:
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        tensors = [p for g in groups for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])]
        # torch's checks and defaults (its constructor, not BaseGP's), on a 2-D stand-in for each weight (its
        # own check wants ndim 2)
        flat = [torch.empty(matrix_shape(p.shape), device="meta") for p in tensors]
        torch.optim.Muon.__init__(self, flat, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                  ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                  adjust_lr_fn=adjust_lr_fn)
        bad = [tuple(p.shape) for p in tensors if p.ndim < 2]
        if bad:
            raise ValueError(f"Muon updates matrices and convolution filters; got parameters of shapes {bad}")
        self.param_groups, self.state = [], defaultdict(dict)   # the real parameters, as torch would hold them
        for g in groups:
            self.add_param_group(dict(g))

    def update(self, p, grad, group):
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        direction = grad.lerp(buf, mu) if group["nesterov"] else buf
        # sharded (FSDP2): orthogonalise the whole matrix, keep this rank's rows
        direction = sharding.on_whole_matrix(
            lambda m: newton_schulz5(as_matrix(m), steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                                     eps=group["eps"]).view_as(m), direction, p).to(p.dtype)
        w = sharding.local(p)
        w.mul_(1 - lr * wd)
        w.add_(direction, alpha=-lr * _lr_ratio(group["adjust_lr_fn"], matrix_shape(p.shape)))


def _lr_ratio(adjust_lr_fn, shape) -> float:
    """torch's Muon learning-rate adjustment: "original" sqrt(max(1, A/B)), or
    "match_rms_adamw" 0.2 sqrt(max(A, B)) (update RMS matched to AdamW's)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


INPUT_LAYER = ("adamw", "muon")
#: where a convolution's weight goes: AdamW (the default), or Muon as the matrix (out, in x kernel)
CONV_ROUTES = ("adamw", "flatten")
#: the roles a model gives its layers for the routing (:func:`mark_role`); Muon's rule keeps both on AdamW
ROLES = ("input", "output")
ROLE_ATTRIBUTE = "muon_role"


def mark_role(module: nn.Module, role: str) -> nn.Module:
    """Record ``module``'s role ("input" or "output") for :func:`route_matrix_params`; returns it."""
    if role not in ROLES:
        raise ValueError(f"Invalid role: {role!r} (choose from {ROLES})")
    setattr(module, ROLE_ATTRIBUTE, role)
    return module


def _heads_and_inputs(modules: dict, linears: list, convs: list, head_names, input_names) -> tuple:
    """(head modules, input modules) by name, as :func:`route_matrix_params` takes them."""
    def named(names, what):
        names = set([names] if isinstance(names, str) else names)
        missing = sorted(names - modules.keys())
        if missing:
            raise ValueError(f"{what} not found among the model's modules: {missing}")
        return names

    marked = {role: {name for name, m in modules.items() if getattr(m, ROLE_ATTRIBUTE, None) == role}
              for role in ROLES}
    if head_names is not None:
        heads = named(head_names, "head_names")
    else:
        heads = marked["output"] or set(linears[-1:])
    if input_names is not None:
        inputs = named(input_names, "input_names")
    elif marked["input"]:
        inputs = marked["input"] - heads
    elif any(isinstance(m, nn.Embedding) for m in modules.values()):
        inputs = set()
    else:   # the first layer in module order (a convolution too, when convolutions go to Muon)
        first = [name for name, m in modules.items() if name in linears or name in convs]
        inputs = set(first[:1]) - heads
    return heads, inputs


def route_matrix_params(model: nn.Module, head_names: Iterable[str] | None = None,
                        input_layer: str = "adamw", input_names: Iterable[str] | None = None,
                        conv: str = "adamw"):
    """Split ``model``'s trainable parameters into ``(matrix_params, other_params)``, both in
    ``model.parameters()`` order.

    ``matrix_params`` (Muon / AdaMuon): the weight of every hidden ``nn.Linear`` (and, with ``conv="flatten"``,
    of every non-transposed convolution, as the matrix (out, in x kernel)). ``other_params`` (AdamW): the rest,
    the head and, with ``input_layer="adamw"`` (the default), the input layers. The head: ``head_names``, else the
    modules marked "output" (:func:`mark_role`), else the last ``nn.Linear``. The input layers: ``input_names``,
    else the modules marked "input", else the first ``nn.Linear`` (or convolution, under ``conv="flatten"``) unless
    the model has an ``nn.Embedding``.
    """
    if input_layer not in INPUT_LAYER:
        raise ValueError(f"Invalid input_layer: {input_layer!r} (choose from {INPUT_LAYER})")
    if conv not in CONV_ROUTES:
        raise ValueError(f"Invalid conv: {conv!r} (choose from {CONV_ROUTES})")
    modules = dict(model.named_modules())
    linears = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
    convs = [name for name, m in modules.items()
             if conv == "flatten" and isinstance(m, nn.modules.conv._ConvNd) and not m.transposed]
    heads, inputs = _heads_and_inputs(modules, linears, convs, head_names, input_names)
    adamw_modules = heads | (inputs if input_layer == "adamw" else set())

    adamw_ids = {id(p) for name in adamw_modules for p in modules[name].parameters()}
    matrix_ids = {id(modules[name].weight) for name in linears + convs
                  if modules[name].weight.requires_grad} - adamw_ids
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrix_params = [p for p in trainable if id(p) in matrix_ids]
    other_params = [p for p in trainable if id(p) not in matrix_ids]
    return matrix_params, other_params


class _Beta1AsMomentum(dict):
    """An Adam-style param group (``betas``) that also answers to ``momentum`` as its beta1 (the same decay of the
    first-moment average as Muon's momentum); nothing extra is stored, so the ``state_dict`` is unchanged."""

    __slots__ = ()

    def __getitem__(self, key):
        if key == "momentum":
            return dict.__getitem__(self, "betas")[0]
        return dict.__getitem__(self, key)

    def __setitem__(self, key, value):
        if key == "momentum":
            key, value = "betas", (value, *dict.__getitem__(self, "betas")[1:])
        dict.__setitem__(self, key, value)

    def __contains__(self, key):
        return key == "momentum" or dict.__contains__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def _momentum_key(optimizers) -> str | None:
    """The key every member's groups answer to for their momentum: ``"betas"`` if every member is Adam-style,
    ``"momentum"`` if each has ``momentum`` or ``betas`` (aliased, :class:`_Beta1AsMomentum`), else None."""
    kinds = [("momentum" if "momentum" in opt.defaults else "betas" if "betas" in opt.defaults else None)
             for opt in optimizers]
    if None in kinds:
        return None
    return "betas" if set(kinds) == {"betas"} else "momentum"


class HybridOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, used as one ``torch.optim.Optimizer``:
    ``HybridOptimizer({"muon": Muon(...), "adamw": torch.optim.AdamW(...)})``.

    ``param_groups`` are the members' own dicts (an LR scheduler writes the members) and ``state`` a merged
    read-only view, both recomputed on access. For momentum schedules (``OneCycleLR``, ``CyclicLR``), a Muon +
    AdamW hybrid's ``defaults`` hold ``"momentum"`` and each Adam-style group answers to ``group["momentum"]`` as
    its beta1; an all-Adam hybrid keeps ``"betas"``; a member with neither key leaves both out. The other
    ``defaults`` are the members' own, the first member's where they differ.
    """

    def __init__(self, optimizers: dict[str, Optimizer]):
        if not optimizers:
            raise ValueError("HybridOptimizer needs at least one member optimizer")
        seen = set()
        for name, opt in optimizers.items():
            if not isinstance(opt, Optimizer):
                raise TypeError(f"Member {name!r} is not a torch.optim.Optimizer: {type(opt).__name__}")
            if needs_closure(opt):
                raise ValueError(f"Member {name!r} ({type(opt).__name__}) needs a closure in step(); "
                                 "HybridOptimizer steps its members without one")
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError(f"Member {name!r} holds a parameter that another member also holds")
                    seen.add(id(p))
        self.optimizers = dict(optimizers)
        members = list(self.optimizers.values())
        self.defaults = {k: v for opt in reversed(members) for k, v in opt.defaults.items()}
        self._momentum_key = _momentum_key(members)
        self.defaults.pop("momentum", None)
        self.defaults.pop("betas", None)
        if self._momentum_key == "betas":
            self.defaults["betas"] = members[0].defaults["betas"]
        elif self._momentum_key == "momentum":
            first = members[0].defaults
            self.defaults["momentum"] = first["momentum"] if "momentum" in first else first["betas"][0]
        self._alias_beta1()
        init_hook_registries(self)  # Optimizer.__init__ would copy the members' groups into new dicts

    def _alias_beta1(self) -> None:
        """With a ``"momentum"`` default, wrap each member's Adam-style groups as :class:`_Beta1AsMomentum` (on
        every access: a member's ``load_state_dict`` or ``add_param_group`` puts plain dicts back)."""
        if getattr(self, "_momentum_key", None) != "momentum":
            return
        for opt in self.optimizers.values():
            for i, group in enumerate(opt.param_groups):
                if "momentum" not in group and "betas" in group:
                    opt.param_groups[i] = _Beta1AsMomentum(group)

    @property
    def param_groups(self):
        self._alias_beta1()
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def __getstate__(self):
        return {"optimizers": self.optimizers, "defaults": self.defaults, "_momentum_key": self._momentum_key}

    def __repr__(self):
        members = [f"  {name}: " + repr(opt).replace("\n", "\n  ") for name, opt in self.optimizers.items()]
        return f"{type(self).__name__}(\n" + "\n".join(members) + "\n)"

    @torch.no_grad()
    def step(self, closure=None):
        """Evaluate ``closure`` once (if given), then step every member."""
        loss = evaluate(closure)
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return with_state_dict_hooks(self, lambda: {"optimizers": {n: opt.state_dict() for n, opt in self.optimizers.items()}})

    def load_state_dict(self, state_dict) -> None:
        with_load_hooks(self, state_dict, self._load)

    def _load(self, state_dict) -> None:
        saved = state_dict["optimizers"]
        if saved.keys() != self.optimizers.keys():
            raise ValueError(f"state_dict has members {sorted(saved)}, "
                             f"this optimizer has {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])

    def add_param_group(self, param_group) -> None:
        raise RuntimeError(
            "HybridOptimizer cannot take new parameter groups; add them to a member instead, "
            f"e.g. .optimizers[{next(iter(self.optimizers))!r}].add_param_group(...)")
