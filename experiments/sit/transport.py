"""SiT's transport: an interpolant x_t = alpha_t x1 + sigma_t x0 between noise x0 ~ N(0, I) (t = 0) and
data x1 (t = 1), a model trained to predict its velocity, and ODE samplers from noise to data.

Paths (willisma/SiT ``transport/path.py``): ``linear`` (alpha_t = t, sigma_t = 1 - t; SiT's default and
the paper's) and ``gvp`` (alpha_t = sin(pi t / 2), sigma_t = cos(pi t / 2)). Prediction: the velocity
u_t = alpha'_t x1 + sigma'_t x0, loss mean((v_theta(x_t, t, y) - u_t)^2) with t ~ U[0, 1] (for a velocity
model with an ODE sampler SiT trains and samples on the whole interval).

Samplers run through torchdiffeq: fixed-step ``euler``, ``heun2`` (Heun), ``midpoint``, ``rk4`` with
``steps`` steps, and the adaptive ``dopri5`` (SiT's ODE default: atol 1e-6, rtol 1e-3) on a grid of
``steps`` output times. ``nfe`` counts the model evaluations of the last call.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

PATHS = ("linear", "gvp")
FIXED = ("euler", "heun2", "midpoint", "rk4")
ADAPTIVE = ("dopri5", "dopri8", "bosh3", "adaptive_heun")


def path_coefficients(path: str, t: Tensor):
    """(alpha_t, sigma_t, alpha'_t, sigma'_t)."""
    if path == "linear":
        return t, 1 - t, torch.ones_like(t), -torch.ones_like(t)
    if path == "gvp":
        a = math.pi / 2
        return torch.sin(a * t), torch.cos(a * t), a * torch.cos(a * t), -a * torch.sin(a * t)
    raise ValueError(f"unknown path {path!r}; choose from {PATHS}")


def _expand(c: Tensor, x: Tensor) -> Tensor:
    return c.view(-1, *([1] * (x.dim() - 1)))


class Transport:
    def __init__(self, path: str = "linear") -> None:
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; choose from {PATHS}")
        self.path = path

    def interpolate(self, x0: Tensor, x1: Tensor, t: Tensor):
        """(x_t, u_t)."""
        a, s, da, ds = (_expand(c, x1) for c in path_coefficients(self.path, t))
        return a * x1 + s * x0, da * x1 + ds * x0

    def loss(self, model: Callable, x1: Tensor, y: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """The velocity-matching loss on a batch of data x1 with labels y (mean over the batch)."""
        t = torch.rand(x1.shape[0], device=x1.device, generator=generator)
        x0 = torch.randn(x1.shape, device=x1.device, generator=generator, dtype=x1.dtype)
        xt, ut = self.interpolate(x0, x1, t)
        return ((model(xt, t, y) - ut) ** 2).mean()


class Sampler:
    """ODE from t = 0 (noise) to t = 1 (data) with torchdiffeq.

    ``method`` in FIXED takes ``steps`` equal steps (Euler: ``steps`` model evaluations, Heun 2x);
    ``method`` in ADAPTIVE picks its own steps to ``atol``/``rtol``.
    """

    def __init__(self, method: str = "euler", steps: int = 250, atol: float = 1e-6, rtol: float = 1e-3) -> None:
        if method not in FIXED + ADAPTIVE:
            raise ValueError(f"unknown ODE method {method!r}; choose from {FIXED + ADAPTIVE}")
        if not (isinstance(steps, int) and steps >= 1):
            raise ValueError(f"sampling steps must be an integer >= 1, got {steps!r}")
        self.method, self.steps, self.atol, self.rtol = method, steps, atol, rtol
        self.nfe = 0

    @torch.no_grad()
    def __call__(self, velocity: Callable, x0: Tensor) -> Tensor:
        """velocity(x, t_batch) -> dx/dt; returns x at t = 1."""
        from torchdiffeq import odeint

        self.nfe = 0

        def f(t, x):
            self.nfe += 1
            return velocity(x, t.expand(x.shape[0]).to(x.dtype))

        ends = torch.tensor([0.0, 1.0], device=x0.device, dtype=x0.dtype)
        if self.method in FIXED:  # exactly `steps` equal steps; only the end point is kept
            grid = torch.linspace(0.0, 1.0, self.steps + 1, device=x0.device, dtype=x0.dtype)
            return odeint(f, x0, ends, method=self.method, options={"grid_constructor": lambda *_: grid})[-1]
        return odeint(f, x0, ends, method=self.method, atol=self.atol, rtol=self.rtol)[-1]


def sample(model, sampler: Sampler, labels: Tensor, shape: tuple, cfg_scale: float = 1.0,
           generator: Optional[torch.Generator] = None) -> Tensor:
    """Class-conditional samples: noise of ``(len(labels), *shape)`` pushed through the learned ODE."""
    x0 = torch.randn((len(labels), *shape), device=labels.device, generator=generator)
    if cfg_scale == 1.0:
        return sampler(lambda x, t: model(x, t, labels), x0)
    return sampler(lambda x, t: model.forward_with_cfg(x, t, labels, cfg_scale), x0)
