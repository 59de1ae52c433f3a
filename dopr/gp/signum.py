"""Signum: sign of the momentum (Bernstein et al., 2018), with decoupled weight decay."""

import torch

from .base import BaseGP


class Signum(BaseGP):
    r"""Signum (Bernstein, Wang, Azizzadenesheli & Anandkumar, 2018, "signSGD: Compressed
    Optimisation for Non-Convex Problems"), with decoupled weight decay.

    For a parameter p with gradient g_t, momentum mu, learning rate lr and weight decay wd:

        m_0 = 0,    m_t = mu m_{t-1} + (1 - mu) g_t
        p_t = (1 - lr wd) p_{t-1} - lr sign(m_t)

    Every entry moves by exactly lr (or 0 where m_t = 0). ``momentum=0`` gives signSGD.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def update(self, p, grad, group):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        m = state["momentum_buffer"]
        m.mul_(mu).add_(grad, alpha=1.0 - mu)
        p.mul_(1.0 - lr * wd)
        p.add_(torch.sign(m), alpha=-lr)
