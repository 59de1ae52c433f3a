"""What torch.optim.Optimizer.__init__ sets up for its hooks, for the optimizers here that wrap
other optimizers (DoPr, HybridOptimizer) and so do not call it: it would copy the wrapped
optimizers' parameter groups into new dicts, and an LR scheduler must write the wrapped ones; and
which wrapped optimizers such a wrapper cannot step (those that need a closure); the surface a
wrapper shows of its `base` (WrapsBase); the check that a wrapper steps only its model's parameters; the
state-dict hooks run around a wrapper's own state dict."""
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
    """Whether ``opt.step`` cannot be called without a closure (torch.optim.LBFGS: it re-evaluates
    the loss and its gradient several times per step)."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or otherwise uninspectable step: assume the usual optional closure
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def refuse_base(base, wrapper: str) -> None:
    """ValueError unless ``base`` is a torch.optim.Optimizer stepped without a closure: LBFGS-like bases re-evaluate
    it, reading each gradient as its loss's (line search), which the AP's M is not; its EMAs count steps."""
    if not isinstance(base, Optimizer):
        raise ValueError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
    if needs_closure(base):
        raise ValueError(f"Invalid base: {type(base).__name__} needs a closure in step(); {wrapper} "
                         "preconditions the gradient once per step and cannot wrap a base that re-evaluates it")


def refuse_foreign(model, params, message: str) -> None:
    """ValueError(`message` with {n} and {shapes} filled in) when `params` holds a parameter that is
    not in `model`."""
    in_model = {id(p) for p in model.parameters()}
    foreign = [tuple(p.shape) for p in params if id(p) not in in_model]
    if foreign:
        raise ValueError(message.format(n=len(foreign), shapes=foreign[:5]))


def refuse_foreign_group(model, param_group) -> None:
    """``add_param_group``'s check that a group holds only ``model``'s parameters (a generator read into a list the
    group then holds; a set, or no dict with "params", is the wrapped optimizer's to refuse)."""
    if isinstance(param_group, dict) and "params" in param_group:
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):
            param_group["params"] = params = list(params)   # a generator can be read only once
        refuse_foreign(model, params, "add_param_group got {n} parameter(s) that are not in the model "
                       "(shapes {shapes}); DoPr only steps the model's parameters")


def with_state_dict_hooks(opt: Optimizer, state_dict: Callable[[], dict]) -> dict:
    """``state_dict()`` between ``opt``'s state-dict pre and post hooks, as torch.optim.Optimizer.state_dict runs
    them (a post hook's result, when not None, replaces the state dict)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = state_dict()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        out = hook(opt, sd)
        sd = sd if out is None else out
    return sd


def with_load_hooks(opt: Optimizer, state_dict: dict, load: Callable[[dict], None]) -> None:
    """``load(state_dict)`` between ``opt``'s load-state-dict pre hooks (a result, when not None, replaces the
    state dict) and post hooks, as torch.optim.Optimizer.load_state_dict runs them."""
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
    """``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (``self.base``), so an
    LR scheduler or a checkpoint sees the optimizer that steps."""

    param_groups = _of_base("param_groups")
    state = _of_base("state")
    defaults = _of_base("defaults")
