"""The step every GP of this package takes (:class:`BaseGP`), and the check of their shared hyperparameters."""

import torch
from torch.optim import Optimizer


def evaluate(closure):
    """The loss of ``closure()`` evaluated with gradients on, or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_hyperparameters(defaults: dict) -> None:
    """One-line ValueError naming the bad value for the shared hyperparameters in ``defaults``: lr >= 0,
    weight_decay >= 0, momentum, beta2 and each of betas in [0, 1), eps > 0."""
    if "lr" in defaults and not 0.0 <= defaults["lr"]:
        raise ValueError(f"Invalid learning rate: {defaults['lr']}")
    if "weight_decay" in defaults and not 0.0 <= defaults["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {defaults['weight_decay']}")
    for name in ("momentum", "beta2"):
        if name in defaults and not 0.0 <= defaults[name] < 1.0:
            raise ValueError(f"Invalid {name} value: {defaults[name]}")
    for i, beta in enumerate(defaults.get("betas", ())):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if "eps" in defaults and not 0.0 < defaults["eps"]:
        raise ValueError(f"Invalid epsilon value: {defaults['eps']}")


class BaseGP(Optimizer):
    """A gradient preconditioner written as its update formula: a subclass defines ``update(p, grad, group)``,
    which moves ``p`` given its dense gradient, its group's hyperparameters and ``self.state[p]``."""

    def __init__(self, params, defaults: dict):
        check_hyperparameters(defaults)
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no update(p, grad, group)")

    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step."""
        loss = evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self.update(p, grad, group)
        return loss
