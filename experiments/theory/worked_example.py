"""The worked example after Proposition "SGD and AP feature learning" (§4.1), through the library.

One linear feature G (1 x 2) learns G_* = [1, 0] from G_0 = [1/2, sqrt(3)/2] on inputs of covariance
Sigma_s = [[5, 2], [2, 1]], with F = F_* = 1 and eta = 1, on the full-batch loss L = 1/2 E ||(G - G_*) s||^2.
Its gradient is (G - G_*) Sigma_s. The GD step is plain SGD; the AP step is DoPr-SGD at damping 0, whose
preconditioned gradient is (G - G_*) Sigma_s Sigma_s^-1 = G - G_*. The subspace distance of a row-orthonormal G
is ||G P_perp||_op with P_perp the projection onto G_*'s orthogonal complement: sqrt(3)/2 at G_0. The paper:
GD leaves it about where it was (it rises to 1), one AP step contracts it by (1 - eta lambda_min(F^T F)) = 0,
to G_* itself.

The inputs are two samples with X^T X / 2 = Sigma_s exactly (a Cholesky factor), so the covariance DoPr forms is
Sigma_s to rounding; everything is float64.

    python -m experiments.theory.worked_example --out results/feature_learning/worked_example.md
"""
from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from dopr import DoPr
from dopr.gp import SGD

SIGMA_S = ((5.0, 2.0), (2.0, 1.0))
G_0 = (0.5, math.sqrt(3) / 2)
G_STAR = (1.0, 0.0)
ETA = 1.0
P_PERP = ((0.0, 0.0), (0.0, 1.0))


def distance(g: torch.Tensor) -> float:
    """||G P_perp||_op, the example's subspace distance."""
    return torch.linalg.matrix_norm(g @ torch.tensor(P_PERP, dtype=torch.float64), ord=2).item()


def step(ap: bool) -> torch.Tensor:
    """G after one full-batch step from G_0: DoPr-SGD at damping 0 (``ap``) or SGD, learning rate ETA."""
    x = torch.linalg.cholesky(torch.tensor(SIGMA_S, dtype=torch.float64)).T * math.sqrt(2)
    layer = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([G_0], dtype=torch.float64))
    sgd = SGD(layer.parameters(), lr=ETA, momentum=0.0)
    opt = DoPr(layer, sgd, damping=0.0) if ap else sgd
    target = x @ torch.tensor([G_STAR], dtype=torch.float64).T
    (0.5 * ((layer(x) - target) ** 2).mean(0).sum()).backward()
    opt.step()
    return layer.weight.detach().clone()


def table() -> list:
    """One row per step rule: the distance before and after, and the proposition's bound
    (1 - eta lambda_min(F^T F)) dist(G_0) (F = 1: 0)."""
    before = distance(torch.tensor([G_0], dtype=torch.float64))
    bound = (1 - ETA * 1.0) * before
    rows = []
    for name, ap in (("gd", False), ("ap", True)):
        g = step(ap)
        rows.append({"step": name, "dist_before": before, "dist_after": distance(g), "bound_ap": bound,
                     "g_after_0": g[0, 0].item(), "g_after_1": g[0, 1].item()})
    return rows


def main(argv=None) -> None:
    from experiments.common.provenance import emit_report, git_revision, markdown_table, portable_command

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the table there (markdown)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    command = portable_command("python -m experiments.theory.worked_example " + " ".join(argv or []))
    lines = ["# The worked example of Proposition \"SGD and AP feature learning\" (§4.1): one step", "",
             f"`{command}`, commit {git_revision()}, torch {torch.__version__}, float64. G_0 = [1/2, sqrt(3)/2], "
             "G_* = [1, 0], Sigma_s = [[5, 2], [2, 1]], F = F_* = 1, eta = 1; gd: SGD, ap: DoPr-SGD at damping 0; "
             "dist = ||G P_perp||_op; bound_ap = (1 - eta lambda_min(F^T F)) dist(G_0); g_after: G after the step.", ""]
    lines += markdown_table(table(), 17)
    emit_report(lines, args.out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
