"""Feature learning: validation loss versus subspace distance (the paper's appendix of that name).

A two-layer linear learner F_theta G_theta fits y = F_* G_* x + eps with highly anisotropic inputs.
Validation loss converges for every optimizer; the subspace distance
dist(G_theta, G_*) = || P_rowspace(G_theta) (I - G_*^T G_*) ||_op shows whether the features were
learned. The AP learns as if the inputs were isotropic (Proposition "SGD and AP feature learning").
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn

from experiments.common import interrupt
from experiments.common.checkpoint import TrainingState


def subspace_distance(g_theta: torch.Tensor, g_star: torch.Tensor) -> float:
    """|| P_G P_perp ||_op with P_G the projection onto rowsp(G_theta), P_perp onto rowsp(G_*)^perp."""
    q, _ = torch.linalg.qr(g_theta.T.double())
    p_perp = torch.eye(g_star.shape[1], dtype=torch.float64) - g_star.T.double() @ g_star.double()
    return torch.linalg.matrix_norm(q @ q.T @ p_perp, ord=2).item()


def tail_change(steps, values, total_steps: int, frac: float = 0.1) -> float:
    """(max - min) / min of the logged values at steps >= (1 - frac) * total_steps: how much the validation
    loss still moves over the run's last `frac` of steps (a decrease, or an oscillation). inf when a value
    is not finite, nan with fewer than two logged points in that window."""
    start = (1 - frac) * total_steps
    tail = [float(v) for s, v in zip(steps, values) if s >= start]
    if len(tail) < 2:
        return float("nan")
    if not all(math.isfinite(v) for v in tail):
        return float("inf")
    return (max(tail) - min(tail)) / min(tail)


def converged(steps, values, total_steps: int, noise_floor: float, frac: float = 0.1,
              max_change: float = 0.1, floor_factor: float = 2.0) -> bool:
    """The validation loss has converged: it moves by less than `max_change` (relative, tail_change) over
    the last `frac` of steps AND ends within `floor_factor` of the noise floor sigma^2 d_y (the Bayes
    loss: a plateau far above it is not convergence of the fit)."""
    change = tail_change(steps, values, total_steps, frac)
    return bool(math.isfinite(change) and change < max_change and math.isfinite(values[-1])
                and values[-1] <= floor_factor * noise_floor)


class Problem:
    """The data-generating process of one seed (train task only: the metrics are in-distribution)."""

    def __init__(self, t, generator: torch.Generator, dtype=torch.float32):
        dx, dy, k = t.d_x, t.d_y, t.k
        randn = lambda *s: torch.randn(*s, generator=generator, dtype=torch.float64)
        f0 = randn(dy, k)
        b = randn(dy, dy)
        self.f_star = torch.linalg.matrix_exp(t.rotation * (b - b.T)) @ f0
        self.g_star = torch.linalg.qr(randn(dx, k))[0].T  # uniform row-orthonormal k x d_x
        o = torch.linalg.qr(randn(dx, dx))[0]
        self.sigma_sqrt = o @ torch.diag(torch.logspace(0, t.anisotropy_decades, dx, dtype=torch.float64).sqrt()) @ o.T
        self.noise_std, self.dtype, self.gen = t.noise_std, dtype, generator

    def sample(self, n: int):
        signs = torch.randint(0, 2, (n, self.sigma_sqrt.shape[0]), generator=self.gen).double() * 2 - 1
        x = signs @ self.sigma_sqrt  # Sigma^{1/2} is symmetric
        y = x @ (self.f_star @ self.g_star).T + self.noise_std * torch.randn(n, self.f_star.shape[0], generator=self.gen, dtype=torch.float64)
        return x.to(self.dtype), y.to(self.dtype)


class TwoLayerLinear(nn.Module):
    def __init__(self, d_x: int, k: int, d_y: int):
        super().__init__()
        self.G = nn.Linear(d_x, k, bias=False)
        self.F = nn.Linear(k, d_y, bias=False)

    def forward(self, x):
        return self.F(self.G(x))


def run(cfg, run) -> dict:
    t = cfg.task
    dtype = getattr(torch, t.dtype)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    problem = Problem(t, gen, dtype)
    torch.manual_seed(int(cfg.seed))  # identical initialisation for every optimizer of a seed
    model = TwoLayerLinear(t.d_x, t.k, t.d_y).to(dtype)
    opt = run.build_optimizer(model)
    x_val, y_val = problem.sample(t.n_val)
    loss_fn = lambda x, y: ((model(x) - y) ** 2).sum(1).mean()
    state = TrainingState(model=model, optimizer=opt, generators={"data": gen})
    start, extra = state.resume(run)  # a requeued (preempted) job continues where it stopped
    history = dict((extra or {}).get("val_history", {"steps": [], "values": []}))  # for the convergence rule
    bar = run.progress(t.steps, initial=start)
    for step in range(start, t.steps + 1):
        if ((t.checkpoint_every and step % t.checkpoint_every == 0) or interrupt.due()) and step > start:
            state.save(run, step, val_history=history)
        if step % t.log_every == 0 or step == t.steps:
            with torch.no_grad():
                val = loss_fn(x_val, y_val).item()
            w = model.G.weight.detach()
            dist = subspace_distance(w, problem.g_star) if torch.isfinite(w).all() else float("nan")
            run.log({"val_loss": val, "subspace_distance": dist}, step)
            history["steps"].append(step)
            history["values"].append(val)
            if not math.isfinite(val):
                break
        if step == t.steps:
            break
        if t.step_delay_s:
            time.sleep(t.step_delay_s)
        x, y = problem.sample(t.batch_size)
        loss = loss_fn(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.update()
    bar.close()
    floor = t.noise_std**2 * t.d_y
    c = t.get("convergence", {})
    rule = dict(frac=float(c.get("frac", 0.1)), max_change=float(c.get("max_change", 0.1)),
                floor_factor=float(c.get("floor_factor", 2.0)))
    ok = converged(history["steps"], history["values"], t.steps, floor, **rule)
    return {"val_loss": val, "subspace_distance": dist, "lr": float(cfg.optim.lr), "noise_floor": floor,
            "val_loss_tail_change": tail_change(history["steps"], history["values"], t.steps, rule["frac"]),
            "converged": float(ok)}
