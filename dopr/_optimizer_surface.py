"""What torch.optim.Optimizer.__init__ sets up for its hooks, for the optimizers here that wrap
other optimizers (DoPr, HybridOptimizer) and so do not call it: it would copy the wrapped
optimizers' parameter groups into new dicts, and an LR scheduler must write the wrapped ones; and
which wrapped optimizers such a wrapper cannot step (those that need a closure)."""
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
