"""Signum: sign of the momentum (Bernstein et al., 2018), with decoupled weight decay."""

import torch
from torch.optim import Optimizer


class Signum(Optimizer):
    r"""Signum (Bernstein, Wang, Azizzadenesheli & Anandkumar, 2018, "signSGD: Compressed
    Optimisation for Non-Convex Problems"), with decoupled weight decay.

    For a parameter p with gradient g_t, momentum mu, learning rate lr and weight decay wd:

        m_0 = 0,    m_t = mu m_{t-1} + (1 - mu) g_t
        p_t = (1 - lr wd) p_{t-1} - lr sign(m_t)

    Every entry moves by exactly lr (or 0 where m_t = 0). ``momentum=0`` gives signSGD.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Signum does not support sparse gradients")

                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                m = state["momentum_buffer"]

                # m_t = mu m_{t-1} + (1 - mu) g_t
                m.mul_(mu).add_(grad, alpha=1.0 - mu)
                # p <- (1 - lr wd) p - lr sign(m_t)
                p.mul_(1.0 - lr * wd)
                p.add_(torch.sign(m), alpha=-lr)

        return loss
