"""Lion: the sign of an interpolated momentum (Chen et al., 2023), with decoupled weight decay."""

import torch

from .base import BaseGP


class Lion(BaseGP):
    r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675, Algorithm 2).

    For a parameter p with gradient g_t, rates beta1, beta2, learning rate lr and weight decay wd:

        c_t = beta1 m_{t-1} + (1 - beta1) g_t        (the update's interpolation, m_0 = 0)
        p_t = p_{t-1} - lr (sign(c_t) + wd p_{t-1})  (decoupled weight decay)
        m_t = beta2 m_{t-1} + (1 - beta2) g_t        (the momentum kept, a slower EMA)

    Every entry moves by exactly lr (or 0), so the paper advises a learning rate 3-10x smaller than AdamW's and a
    weight decay 3-10x larger. ``betas=(0.9, 0.99)`` is the paper's default.
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def update(self, p, grad, group):
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
        m = state["exp_avg"]
        c = torch.lerp(grad, m, beta1)
        p.mul_(1.0 - lr * wd)
        p.add_(torch.sign(c), alpha=-lr)
        m.lerp_(grad, 1.0 - beta2)
