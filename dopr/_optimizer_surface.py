"""What torch.optim.Optimizer.__init__ sets up for its hooks, for the optimizers here that wrap
other optimizers (DoPr, HybridOptimizer) and so do not call it: it would copy the wrapped
optimizers' parameter groups into new dicts, and an LR scheduler must write the wrapped ones; and
which wrapped optimizers such a wrapper cannot step (those that need a closure); the surface a
wrapper shows of its `base` (WrapsBase); the check that a wrapper steps only its model's parameters."""
import inspect
from collections import OrderedDict

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


def refuse_foreign(model, params, message: str) -> None:
    """ValueError(`message` with {n} and {shapes} filled in) when `params` holds a parameter that is
    not in `model`."""
    in_model = {id(p) for p in model.parameters()}
    foreign = [tuple(p.shape) for p in params if id(p) not in in_model]
    if foreign:
        raise ValueError(message.format(n=len(foreign), shapes=foreign[:5]))


def _of_base(name: str) -> property:
    return property(lambda self: getattr(self.base, name), lambda self, value: setattr(self.base, name, value),
                    doc=f"The wrapped optimizer's ``{name}``.")


class WrapsBase:
    """``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (``self.base``), so an
    LR scheduler or a checkpoint sees the optimizer that steps."""

    param_groups = _of_base("param_groups")
    state = _of_base("state")
    defaults = _of_base("defaults")
