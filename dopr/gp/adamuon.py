"""AdaMuon: Muon with an element-wise second moment and RMS-aligned step size."""

import math

import torch

from .. import sharding
from .base import BaseGP
from .newton_schulz import as_matrix, matrix_shape, newton_schulz5


ADJUST_LR_FNS = ("match_rms_adamw", "original")


def _target_norm(adjust_lr_fn: str, shape) -> float:
    m, n = shape
    if adjust_lr_fn == "original":
        return math.sqrt(min(m, n)) * math.sqrt(max(1.0, m / n))
    return 0.2 * math.sqrt(m * n)


class AdaMuon(BaseGP):
    r"""AdaMuon (Si, Zhang & Shen, 2025, "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005).

    For a weight matrix W of shape (m, n) with gradient G_t, momentum mu, second-moment decay
    beta2, learning rate lr and weight decay wd:

        M_t = mu M_{t-1} + G_t                       (M_0 = 0)
        N_t = G_t + mu M_t   if nesterov,   else   N_t = M_t
        O_t = NewtonSchulz5(sign(N_t))               (sign-stabilised orthogonal direction)
        V_t = beta2 V_{t-1} + (1 - beta2) O_t * O_t  (element-wise, V_0 = 0)
        U_t = O_t / (sqrt(V_t) + eps)
        U_t <- s(m, n) U_t / ||U_t||_F               (RMS alignment, s from ``adjust_lr_fn``)
        W_t = W_{t-1} - lr (U_t + wd W_{t-1})        (decoupled weight decay)

    The paper's sign-stabilised variant (arXiv v2 onward); the authors' released code orthogonalises N_t itself and
    bias-corrects V_t, a correction that would cancel in the RMS alignment but for eps. ``adjust_lr_fn``:
    ``"match_rms_adamw"`` (the paper's, default) ||U_t||_F = 0.2 sqrt(m n), RMS 0.2, so AdamW's learning rates and
    weight decays carry over; ``"original"`` sqrt(min(m, n)) sqrt(max(1, m/n)), Keller Jordan's Muon update's norm.
    Matrices and convolution filters only (:func:`dopr.gp.route_matrix_params` routes the rest).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_steps: int = 5, adjust_lr_fn: str = "match_rms_adamw"):
        if not (isinstance(ns_steps, int) and ns_steps >= 1):
            raise ValueError(f"Invalid number of Newton-Schulz steps: {ns_steps}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (choose from {ADJUST_LR_FNS})")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # state saved before the option existed
            group.setdefault("adjust_lr_fn", "match_rms_adamw")

    def add_param_group(self, param_group):
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if p.ndim < 2:   # a convolution's filters are the matrix (out, in x kernel), as in Muon
                raise ValueError(f"AdaMuon updates matrices and convolution filters, got shape {tuple(p.shape)}")
        super().add_param_group({**param_group, "params": params})

    def update(self, p, grad, group):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        beta2, eps = group["beta2"], group["eps"]
        state = self.state[p]
        if len(state) == 0:
            state["momentum_buffer"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        M, V = state["momentum_buffer"], state["exp_avg_sq"]
        M.mul_(mu).add_(grad)
        N = grad.add(M, alpha=mu) if group["nesterov"] else M
        # O_t = NewtonSchulz5(sign(N_t)) (FSDP2: on the gathered matrix, then this rank's rows)
        O = sharding.on_whole_matrix(
            lambda n: newton_schulz5(torch.sign(as_matrix(n)), steps=group["ns_steps"]).view_as(n), N, p)
        V = sharding.local(V)
        V.mul_(beta2).addcmul_(O, O, value=1.0 - beta2)
        U = O / (V.sqrt() + eps)
        U.mul_(_target_norm(group["adjust_lr_fn"], matrix_shape(p.shape)) / sharding.norm(U, p).clamp_min(eps))
        w = sharding.local(p)
        w.mul_(1.0 - lr * wd)
        w.add_(U.to(p.dtype), alpha=-lr)
