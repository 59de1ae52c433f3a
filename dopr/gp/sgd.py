"""SGD with heavy-ball (or Nesterov) momentum and decoupled weight decay."""

from .base import BaseGP


class SGD(BaseGP):
    r"""Stochastic gradient descent with momentum and decoupled weight decay.

    For a parameter p with gradient g_t at step t, momentum mu, learning rate lr and
    weight decay wd:

        b_1 = g_1,    b_t = mu b_{t-1} + g_t                      (heavy-ball buffer)
        d_t = g_t + mu b_t   if nesterov,   else   d_t = b_t
        p_t = (1 - lr wd) p_{t-1} - lr d_t

    ``momentum=0`` gives plain gradient descent. The weight decay is decoupled (Loshchilov & Hutter, 2019),
    unlike ``torch.optim.SGD``'s L2 penalty.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0):
        if nesterov and momentum == 0.0:
            raise ValueError(f"Nesterov momentum requires momentum > 0, got momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    def update(self, p, grad, group):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        d = grad
        if mu != 0.0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                buf = state["momentum_buffer"] = grad.detach().clone()
            else:
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(grad)
            d = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        p.mul_(1.0 - lr * wd)
        p.add_(d, alpha=-lr)
