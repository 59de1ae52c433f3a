"""Feature learning: validation loss versus subspace distance (the paper's appendix of that name).

A two-layer linear learner F_theta G_theta fits y = F_* G_* x + eps with highly anisotropic inputs.
Validation loss converges for every optimizer; the subspace distance
dist(G_theta, G_*) = || P_rowspace(G_theta) (I - G_*^T G_*) ||_op shows whether the features were
learned. The AP learns as if the inputs were isotropic (Proposition "SGD and AP feature learning").
"""
from __future__ import annotations

import math
import time

import matplotlib
import numpy as np
import torch
from torch import nn

matplotlib.use("Agg")


def subspace_distance(g_theta: torch.Tensor, g_star: torch.Tensor) -> float:
    """|| P_G P_perp ||_op with P_G the projection onto rowsp(G_theta), P_perp onto rowsp(G_*)^perp."""
    q, _ = torch.linalg.qr(g_theta.T.double())
    p_perp = torch.eye(g_star.shape[1], dtype=torch.float64) - g_star.T.double() @ g_star.double()
    return torch.linalg.matrix_norm(q @ q.T @ p_perp, ord=2).item()


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
    start = 0
    resumed = run.load_checkpoint()
    if resumed is not None:  # a requeued (preempted) job continues where it stopped
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["optimizer"])
        gen.set_state(resumed["generator"])
        start = resumed["step"]
    bar = run.progress(t.steps, initial=start)
    for step in range(start, t.steps + 1):
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step > start:
            run.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "generator": gen.get_state(), "step": step})
        if step % t.log_every == 0 or step == t.steps:
            with torch.no_grad():
                val = loss_fn(x_val, y_val).item()
            w = model.G.weight.detach()
            dist = subspace_distance(w, problem.g_star) if torch.isfinite(w).all() else float("nan")
            run.log({"val_loss": val, "subspace_distance": dist}, step)
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
    return {"val_loss": val, "subspace_distance": dist, "lr": float(cfg.optim.lr),
            "noise_floor": t.noise_std**2 * t.d_y}


def report(records, out_dir, stamp) -> None:
    """Per optimizer: the learning rate with the lowest median final validation loss, then the median
    and 10/90% quantiles over seeds of both metrics over training (the paper's figure)."""
    import matplotlib.pyplot as plt

    from experiments.report import stamp_figure, write_table

    by = {}
    for r in records:
        s = r["summary"]
        by.setdefault(s["optim"], {}).setdefault(s["lr"], []).append(r)
    rows, best = [], {}
    for opt_name, lrs in sorted(by.items()):
        for lr, rs in sorted(lrs.items()):
            vals = [r["summary"]["val_loss"] for r in rs]
            dists = [r["summary"]["subspace_distance"] for r in rs]
            med = float(np.median(vals)) if all(math.isfinite(v) for v in vals) else float("inf")
            rows.append({"optimizer": opt_name, "lr": lr, "seeds": len(rs), "val_loss_median": med,
                         "subspace_distance_median": float(np.median(dists)), "best": ""})
        best[opt_name] = min(lrs, key=lambda lr: next(r["val_loss_median"] for r in rows if r["optimizer"] == opt_name and r["lr"] == lr))
        for row in rows:
            if row["optimizer"] == opt_name and row["lr"] == best[opt_name]:
                row["best"] = "*"
    write_table(rows, ["optimizer", "lr", "seeds", "val_loss_median", "subspace_distance_median", "best"],
                out_dir / "feature_learning", stamp,
                "Feature learning: final validation loss and subspace distance (median over seeds; * = best lr)")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for opt_name in sorted(best):
        rs = by[opt_name][best[opt_name]]
        steps = np.array([m["step"] for m in rs[0]["metrics"]])
        for ax, key in zip(axes, ("val_loss", "subspace_distance")):
            curves = np.array([[m[key] for m in r["metrics"]] for r in rs if len(r["metrics"]) == len(steps)])
            q10, q50, q90 = np.quantile(curves, [0.1, 0.5, 0.9], axis=0)
            line, = ax.plot(steps, q50, label=f"{opt_name} (lr {best[opt_name]:g})")
            ax.fill_between(steps, q10, q90, color=line.get_color(), alpha=0.2)
    axes[0].set(yscale="log", xlabel="step", ylabel="validation loss", title="in-distribution validation loss")
    axes[1].set(xlabel="step", ylabel=r"dist$(G_\theta, G_\star)$", title="feature subspace distance")
    axes[0].legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    stamp_figure(fig, stamp)
    fig.savefig(out_dir / "feature_learning.png", dpi=150)
    plt.close(fig)
