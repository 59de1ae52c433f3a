"""Hydra task `task=lds`: Proposition "LDS" checked against Monte Carlo rollouts on a random stable
system (experiments/theory/lds.py), and the appendix construction over its (alpha, epsilon, theta)
grid (experiments/theory/construction.py), written to construction.csv."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .construction import CONSTRUCTION_COLUMNS, construction_summary, construction_table
from .lds import monte_carlo_check, perturbed_policy, random_stable_lds


def _write_csv(rows: list, columns: list, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(float(v)) if isinstance(v, float) else v) for k, v in r.items()})


def run(cfg, run) -> dict:
    t = cfg.task
    rng = np.random.default_rng(int(cfg.seed))
    # (a) Proposition "LDS": closed forms vs Monte Carlo on a random stable LDS
    A, B, Sw, K_demo = random_stable_lds(int(t.n_state), int(t.n_action), float(t.closed_loop_radius),
                                         float(t.noise_floor), rng)
    K, delta = perturbed_policy(A, B, K_demo, float(t.perturbation), rng)
    mc, per_t = monte_carlo_check(A, B, Sw, K_demo, K, int(t.horizon), int(t.n_rollouts), rng)
    for step, row in enumerate(per_t, start=1):
        run.log(row, step)
    # (b) the appendix construction over the (alpha, epsilon, theta) grid, T = inf
    rows = construction_table([float(x) for x in t.alphas], [float(x) for x in t.epsilons],
                              [float(x) for x in t.thetas], float(t.regime_margin), int(t.inf_grid))
    _write_csv(rows, CONSTRUCTION_COLUMNS, Path(run.dir) / "construction.csv")
    return {"n_state": int(t.n_state), "n_action": int(t.n_action), "horizon": int(t.horizon),
            "n_rollouts": int(t.n_rollouts), "perturbation": delta, **mc, **construction_summary(rows)}
