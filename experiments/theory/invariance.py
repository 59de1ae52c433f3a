"""Activation invariance of DoPr (Proposition "PrecondInvariance", appendix "Activation Invariance").

Two copies of one MLP see x and x_t = Q x + d; the second's first layer is (W Q^-1, b - W Q^-1 d), so
their pre-activations, and outputs, are identical at initialisation. Batches correspond exactly.
Under DoPr the two validation-loss trajectories stay identical; under SGD they drift apart.
"""
from __future__ import annotations

import torch
from torch import nn


def mlp(t, dtype) -> nn.Sequential:
    return nn.Sequential(nn.Linear(t.d_in, t.width), nn.SiLU(), nn.Linear(t.width, t.width), nn.SiLU(),
                         nn.Linear(t.width, t.d_out)).to(dtype)


def make_data(t, gen, dtype):
    """x with covariance eigenvalues logspace(0, 2) (1 to 100), y = M2 GeLU(M1 x), and x_t = Q x + d."""
    d = t.d_in
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    o = torch.linalg.qr(randn(d, d))[0]
    x = randn(t.n_samples, d) @ (o @ torch.diag(torch.logspace(0, 2, d, dtype=torch.float64).sqrt()) @ o.T)
    m1, m2 = randn(t.teacher_width, d) / d**0.5, randn(t.d_out, t.teacher_width) / t.teacher_width**0.5
    y = nn.functional.gelu(x @ m1.T) @ m2.T
    u = torch.linalg.qr(randn(d, d))[0]
    q = u @ torch.diag(torch.linspace(1, 100, d, dtype=torch.float64)) @ u.T
    shift = randn(d)
    return x.to(dtype), (x @ q.T + shift).to(dtype), y.to(dtype), q.to(dtype), shift.to(dtype)


def run(cfg, run) -> dict:
    t = cfg.task
    dtype = getattr(torch, t.dtype)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    x, xt, y, q, shift = make_data(t, gen, dtype)
    n_train = int(0.8 * t.n_samples)
    torch.manual_seed(int(cfg.seed))
    original = mlp(t, dtype)
    transformed = mlp(t, dtype)
    transformed.load_state_dict(original.state_dict())
    with torch.no_grad():
        w_qinv = original[0].weight @ torch.linalg.inv(q)
        transformed[0].weight.copy_(w_qinv)
        transformed[0].bias.copy_(original[0].bias - w_qinv @ shift)
    pairs = [(original, x), (transformed, xt)]
    opts = [run.build_optimizer(m) for m, _ in pairs]
    perm = torch.randperm(n_train, generator=gen)
    val = lambda m, inp: ((m(inp[n_train:]) - y[n_train:]) ** 2).mean().item()
    step, gap = 0, 0.0
    bar = run.progress(t.epochs * t.steps_per_epoch)
    for epoch in range(t.epochs):
        for i in range(t.steps_per_epoch):
            idx = perm[(i * t.batch_size) % n_train:][: t.batch_size]
            for (m, inp), opt in zip(pairs, opts):
                loss = ((m(inp[idx]) - y[idx]) ** 2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            step += 1
            bar.update()
            if step % t.val_every and step != t.epochs * t.steps_per_epoch:
                continue
            with torch.no_grad():
                a, b = val(original, x), val(transformed, xt)
            gap = max(gap, abs(a - b) / abs(a))
            run.log({"val_loss_original": a, "val_loss_transformed": b, "relative_gap": abs(a - b) / abs(a)}, step)
    bar.close()
    return {"val_loss_original": a, "val_loss_transformed": b, "max_relative_gap": gap, "lr": float(cfg.optim.lr)}
