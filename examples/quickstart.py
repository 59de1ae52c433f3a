"""DoPr as a drop-in optimizer: AdamW vs DoPr-AdamW on a regression with anisotropic inputs.

    python examples/quickstart.py

Prints DoPr's coverage report, then the training and validation loss of both optimizers.
"""
import torch
from torch import nn

import dopr


def make_data(n, generator):
    d = 32
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
    scales = torch.logspace(0, -3, d)  # input covariance with condition number 1e6
    x = torch.randn(n, d, generator=generator) * scales @ rotation.T
    teacher = rotation @ (torch.randn(d, 4, generator=generator) / scales[:, None])  # every direction matters
    return x, torch.tanh(x @ teacher)


def main(steps=300):
    # matrices this small run fastest on one thread (measured on a 2-core VM: 17.6 s, vs 59-97 s with
    # torch's default of one thread per core)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = make_data(4096, g)
    xv, yv = x[-1024:], y[-1024:]
    x, y = x[:-1024], y[:-1024]
    for ap in (None, {"damping": 1e-4}):   # AdamW alone, then DoPr over it
        name = dopr.optimizer_name("adamw", ap)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
        opt = dopr.build(model, "adamw", ap=ap, lr=1e-3, weight_decay=0.0)
        if isinstance(opt, dopr.DoPr):
            print("coverage:\n  " + opt.coverage_table().replace("\n", "\n  "))
        for step in range(steps):
            idx = torch.randint(0, len(x), (256,), generator=g)
            loss = ((model(x[idx]) - y[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val = ((model(xv) - yv) ** 2).mean().item()
        print(f"{name:>11}: train loss {loss.item():.4f}  validation loss {val:.4f}  after {steps} steps")


if __name__ == "__main__":
    main()
