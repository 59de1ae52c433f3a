"""Flow matching with the linear interpolant (Lipman et al. 2023), as in Pan et al.'s pipeline.

Convention (simchowitzlabpublic/much-ado-about-noising, ``mip/interpolant.py`` "linear",
``mip/losses.py`` ``flow_loss``, ``mip/samplers.py`` ``ode_sampler``): noise at t = 0, data at
t = 1, x_t = (1 - t) x_0 + t x_1 with x_0 ~ N(0, I) and x_1 the (normalised) action chunk; the
network regresses the velocity dx_t/dt = x_1 - x_0 at t ~ U[0, 1] (uniform, one t per sample:
no beta or logit-normal schedule), and sampling integrates dx/dt = v(x, t) from t = 0 to 1 with
``steps`` Euler steps on the uniform grid t_k = k / steps. The paper evaluates with 9 steps;
much-ado's default evaluation list is 9, 3, 1 (``get_default_step_list``).

Inherited values:
- the loss (``flow_loss`` with ``examples/configs/optimization/default.yaml`` norm_type l2,
  loss_scale 0.1): loss_scale * mean over samples and horizon of the squared error summed over the
  action dimension, i.e. loss_scale * action_dim * (per-element MSE); for Tool Hang (10 action
  dimensions) exactly the per-element MSE, for Transport (20) twice it. Its scale matters for
  gradient clipping (grad_clip_norm 10 for AdamW in the paper's tables).
- the start of sampling (``default.yaml`` sample_mode "zero"): ``ode_sampler`` starts from x_0 = 0,
  the mean of the noise, unless sample_mode is "stochastic" (then x_0 ~ N(0, I)); the evaluation
  draws noise but the "zero" mode ignores it. ``start`` selects the two.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: model(x_t (B, H, A), t (B,), cond (B, cond_dim)) -> velocity (B, H, A)
VelocityModel = Callable[[Tensor, Tensor, Tensor], Tensor]


def interpolate(noise: Tensor, actions: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 - t) x_0 + t x_1, t of shape (B,)."""
    t = t.reshape(-1, *([1] * (actions.dim() - 1)))
    return (1 - t) * noise + t * actions


def loss(model: VelocityModel, actions: Tensor, cond: Tensor, generator: torch.Generator | None = None,
         loss_scale: float = 0.1) -> Tensor:
    """loss_scale * mean_{b, h} ||model(x_t, t, cond) - (x_1 - x_0)||^2 over the action dimension.

    Draws, in this order and from ``generator``: t ~ U[0, 1) of shape (B,), then x_0 ~ N(0, I) of
    the shape of ``actions`` (B, H, A).
    """
    t = torch.rand(actions.shape[0], generator=generator, device=actions.device, dtype=actions.dtype)
    noise = torch.randn(actions.shape, generator=generator, device=actions.device, dtype=actions.dtype)
    error = model(interpolate(noise, actions, t), t, cond) - (actions - noise)
    return loss_scale * error.square().sum(-1).mean()


@torch.no_grad()
def sample(model: VelocityModel, cond: Tensor, steps: int, shape: Sequence[int],
           generator: torch.Generator | None = None, start: str = "zero") -> Tensor:
    """Euler integration of dx/dt = model(x, t, cond) from t = 0 to 1 in ``steps`` equal steps.

    ``start="zero"``: x_0 = 0 (much-ado's sample_mode "zero", deterministic); ``"noise"``:
    x_0 ~ N(0, I) drawn from ``generator``. Returns x_1, of ``shape`` (B, H, A).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if start == "zero":
        x = torch.zeros(shape, device=cond.device, dtype=cond.dtype)
    elif start == "noise":
        x = torch.randn(shape, generator=generator, device=cond.device, dtype=cond.dtype)
    else:
        raise ValueError(f"start must be 'zero' or 'noise', got {start!r}")
    dt = 1.0 / steps
    for k in range(steps):
        t = torch.full((x.shape[0],), k * dt, device=x.device, dtype=x.dtype)
        x = x + dt * model(x, t, cond)
    return x
