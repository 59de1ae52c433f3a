"""Report statistics shared by the families: the paper's bootstrap, mean and standard error,
grouping runs by optimizer and hyperparameters, the best setting per optimizer, and the DoPr-vs-GP
comparison."""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import numpy as np

from dopr import optimizer_name, split_name


def bootstrap(outcomes, trials: int = 1000, sample_size: Optional[int] = None, seed: int = 0) -> dict:
    """Algorithm "Bootstrap Mean Estimation": outcomes pooled over checkpoints (and seeds); `trials`
    subsets of size m drawn without replacement; mean and 10/50/90 quantiles of the subset means.
    m defaults to half the pool (the paper does not give m)."""
    x = np.asarray(outcomes, dtype=np.float64).ravel()
    if x.size < 2:
        raise ValueError(f"bootstrap needs at least 2 outcomes, got {x.size}")
    m = sample_size or max(1, x.size // 2)
    if not 1 <= m <= x.size:
        raise ValueError(f"sample_size must be in [1, {x.size}], got {m}")
    rng = np.random.default_rng(seed)
    # argsort of uniform keys = one random permutation per trial; its first m entries are a subset
    idx = np.argsort(rng.random((trials, x.size)), axis=1)[:, :m]
    means = x[idx].mean(1)
    q10, q50, q90 = np.quantile(means, [0.1, 0.5, 0.9])
    return {"mean": float(means.mean()), "q10": float(q10), "q50": float(q50), "q90": float(q90), "m": m}


def mean_and_error(values, single_error: float = float("nan")) -> tuple:
    """Mean and its standard error over seeds (`single_error`, e.g. the run's own, for one run)."""
    v = np.asarray(values, dtype=float)
    if len(v) == 1:
        return float(v[0]), single_error
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v)))


def group_runs(summaries: Iterable[dict], key: Callable[[dict], tuple]) -> dict:
    """{key(summary): [summaries]} in sorted key order: one group per optimizer and hyperparameter
    setting (the seeds of a setting together)."""
    groups: dict = {}
    for s in summaries:
        groups.setdefault(key(s), []).append(s)
    return dict(sorted(groups.items()))


def best_per(rows: Iterable[dict], key: Callable[[dict], tuple], score: str) -> dict:
    """{key(row): the row with the highest `score`}: each optimizer's best setting (the first of ties)."""
    best: dict = {}
    for r in rows:
        k = key(r)
        if k not in best or r[score] > best[k][score]:
            best[k] = r
    return best


def overlap(lo_a, hi_a, lo_b, hi_b) -> str:
    return "yes" if lo_a <= hi_b and lo_b <= hi_a else "no"


#: an interval over seeds where an optimizer ran one seed: a point, whose overlap says nothing about the spread
ONE_SEED = "1 seed: no spread"


def dopr_vs_gp(best: dict, gps: Optional[Iterable[str]], cell: str, score: str, name: str,
               intervals: dict = None, carry=(), lower_is_better: bool = False) -> list:
    """DoPr minus its GP per cell. `best`: {(optimizer, cell value): row}; for each GP in `gps` (None:
    every optimizer that is not dopr_*) and each cell where both `gp` and `dopr_gp` ran: gp_<name>,
    dopr_<name>, delta, delta_pct, dopr_better (a lower score is better when `lower_is_better`), one
    <label> yes/no column per `intervals` entry {label: (low key, high key)} (whether the two
    optimizers' intervals overlap; {label: (low key, high key, seed-count key)} for an interval over seeds,
    ONE_SEED where either optimizer ran a single seed), and gp_<k>, dopr_<k> for each key in `carry` (or
    each {k: row key} of a dict)."""
    if gps is None:
        gps = sorted({k[0] for k in best if not split_name(k[0])[1]})
    carry = carry if isinstance(carry, dict) else {k: k for k in carry}
    out = []
    cells = sorted({k[1] for k in best})
    for gp in gps:
        for c in cells:
            base, dp = best.get((gp, c)), best.get((optimizer_name(gp, True), c))
            if not (base and dp):
                continue
            a, b = base[score], dp[score]
            row = {"gp": gp, cell: c, f"gp_{name}": a, f"dopr_{name}": b, "delta": b - a,
                   "delta_pct": 100 * (b - a) / abs(a) if a else math.nan,
                   "dopr_better": "yes" if (b < a if lower_is_better else b > a) else "no"}
            for label, (lo, hi, *seeds) in (intervals or {}).items():
                single = seeds and min(int(base[seeds[0]]), int(dp[seeds[0]])) < 2
                row[label] = ONE_SEED if single else overlap(dp[lo], dp[hi], base[lo], base[hi])
            for k, key in carry.items():
                row[f"gp_{k}"], row[f"dopr_{k}"] = base[key], dp[key]
            out.append(row)
    return out
