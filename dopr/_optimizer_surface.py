"""The torch.optim.Optimizer surface of the optimizers that wrap others (DoPr, HybridOptimizer) and so do not call
Optimizer.__init__ (it would copy the wrapped parameter groups, which an LR scheduler must write): its hook
registries and state-dict hooks, the refusal of bases that need a closure or hold foreign parameters."""
import inspect
from collections import OrderedDict
from typing import Callable

from torch import Tensor
from torch.optim import Optimizer

HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                   "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                   "_optimizer_load_state_dict_post_hooks")


def init_hook_registries(opt: Optimizer) -> None:
    """The six hook registries of torch.optim.Optimizer, and its step() wrapper that runs the step hooks."""
    for name in HOOK_REGISTRIES:
        setattr(opt, name, OrderedDict())
    opt._patch_step_function()


def needs_closure(opt: Optimizer) -> bool:
    """Whether ``opt.step`` cannot be called without a closure (torch.optim.LBFGS)."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or otherwise uninspectable step: assume the usual optional closure
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def refuse_base(base, wrapper: str) -> None:
    """ValueError unless ``base`` is a torch.optim.Optimizer stepped without a closure (LBFGS-like bases
    re-evaluate the gradient, reading it as its loss's, which the AP's M is not)."""
    if not isinstance(base, Optimizer):
        raise ValueError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
    if needs_closure(base):
        raise ValueError(f"Invalid base: {type(base).__name__} needs a closure in step(); {wrapper} "
                         "preconditions the gradient once per step and cannot wrap a base that re-evaluates it")


def refuse_foreign(model, params, message: str) -> None:
    """ValueError(`message` with {n} and {shapes} filled in) when `params` holds one not in `model`."""
    in_model = {id(p) for p in model.parameters()}
    foreign = [tuple(p.shape) for p in params if id(p) not in in_model]
    if foreign:
        raise ValueError(message.format(n=len(foreign), shapes=foreign[:5]))


def refuse_foreign_group(model, param_group) -> None:
    """``add_param_group``'s check that a group holds only ``model``'s parameters (a generator read into a list)."""
    if isinstance(param_group, dict) and "params" in param_group:
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):
            param_group["params"] = params = list(params)   # a generator can be read only once
        refuse_foreign(model, params, "add_param_group got {n} parameter(s) that are not in the model "
                       "(shapes {shapes}); DoPr only steps the model's parameters")


def with_state_dict_hooks(opt: Optimizer, state_dict: Callable[[], dict]) -> dict:
    """``state_dict()`` between ``opt``'s state-dict hooks, as torch.optim.Optimizer.state_dict runs them."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = state_dict()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        out = hook(opt, sd)
        sd = sd if out is None else out
    return sd


def with_load_hooks(opt: Optimizer, state_dict: dict, load: Callable[[dict], None]) -> None:
    """``load(state_dict)`` between ``opt``'s load-state-dict hooks, as Optimizer.load_state_dict runs them."""
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = hook(opt, state_dict)
        state_dict = state_dict if out is None else out
    load(state_dict)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def _of_base(name: str) -> property:
    return property(lambda self: getattr(self.base, name), lambda self, value: setattr(self.base, name, value),
                    doc=f"The wrapped optimizer's ``{name}``.")


class WrapsBase:
    """``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (``self.base``)."""

    param_groups = _of_base("param_groups")
    state = _of_base("state")
    defaults = _of_base("defaults")
