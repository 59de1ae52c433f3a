"""Issue 48 on a BC cell: DoPr under a damping-free rule at several settings (one sweep over the span
solver's ap.span_cap, or over ap.weak_share_bound, and seeds) beside the committed paper grid's cell at
its tuned damping. The BC report groups runs by optimizer and trajectory count, which would pool the
settings; this table keeps them apart (:func:`rule`).

    python -m experiments.studies.damping_free_bc multirun/damping_free/humanoid_span [more sweeps] \
        --base results/humanoid/paper_humanoid/humanoid.csv [--out results/damping_free/humanoid.md]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

from experiments.common.provenance import emit_report, git_revision


def rule(overrides) -> tuple:
    """(sort key, label) of a run's damping-free rule, read from its overrides: "span cap 3",
    "weak share 0.5, floor 1e-06" ("weak share 0.25 (filter), ..." where the share is the Cholesky filter's), either with ", Σ EMA 0.99" where the run set a statistics EMA, or "the
    tuned damping, Σ EMA 0.99" (the EMA alone, the control); a run with none of them is refused (it would
    be mistaken for a rule)."""
    o = dict(x.split("=", 1) for x in overrides if "=" in x)
    ema = o.get("ap.precond_ema")
    suffix = f", Σ EMA {ema}" if ema else ""
    if "ap.span_cap" in o:
        return (0, float(o["ap.span_cap"]), float(ema or 0), 0), f"span cap {o['ap.span_cap']}{suffix}"
    if "ap.weak_share_bound" in o:
        floor = o.get("ap.damping", "the preset's")
        filtered = o.get("ap.weak_share_estimate", "spectrum") == "filter"
        return ((1, float(o["ap.weak_share_bound"]), float(ema or 0), int(filtered)),
                f"weak share {o['ap.weak_share_bound']}{' (filter)' if filtered else ''}, floor {floor}{suffix}")
    if ema:
        return (2, 0.0, float(ema), 0), f"the tuned damping{suffix}"
    raise SystemExit("a run with none of ap.span_cap, ap.weak_share_bound, ap.precond_ema among its overrides: "
                     f"{overrides}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sweeps", nargs="+", help="sweep directories (their runs are pooled, each kept by its rule)")
    p.add_argument("--base", required=True, help="the paper grid's table (humanoid.csv) with the damped cells")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cells = defaultdict(list)
    for summary in sorted(s for sweep in args.sweeps for s in Path(sweep).glob("*/summary.json")):
        s = json.loads(summary.read_text())
        cells[(s["optim"], s["num_trajectories"], rule(s["overrides"]))].append((s["seed"], s["return_mean"], s["val_loss"]))
    base = {(r["optimizer"], int(r["num_trajectories"])): r for r in csv.DictReader(open(args.base))}
    lines = [f"`python -m experiments.studies.damping_free_bc {' '.join(args.sweeps)} --base {args.base}`", "",
             f"commit {git_revision()}; per-seed mean return over its evaluation episodes, median [min-max] over "
             "seeds; validation MSE, mean over seeds. The damped rows are the paper grid's cells (its table, "
             "same seeds 0-2, the tuned damping); the other rows replace the damping by the rule they name "
             "(solver=span at the cap; or the damping set by the health report, weak_share_bound, above the floor), "
             "with a statistics EMA (precond_ema) where the row names one.", "",
             "| optimizer | trajectories | rule | seeds | return median [min-max] | val MSE |", "|---|---|---|---|---|---|"]
    for (optim, n) in sorted({(o, n) for o, n, _ in cells}):
        b = base.get((optim, n))
        if b:
            lines.append(f"| {optim} | {n} | damping {b['damping']} ({b['damping_mode']}) | {b['seeds']} | "
                         f"{float(b['seed_return_median']):.0f} [{float(b['seed_return_min']):.0f}-"
                         f"{float(b['seed_return_max']):.0f}] | {float(b['val_loss']):.4f} |")
        for r in sorted({c for o, m, c in cells if (o, m) == (optim, n)}):
            runs = cells[(optim, n, r)]
            ret = [v for _, v, _ in runs]
            lines.append(f"| {optim} | {n} | {r[1]} | {len(runs)} | {statistics.median(ret):.0f} "
                         f"[{min(ret):.0f}-{max(ret):.0f}] | {statistics.mean(v for *_, v in runs):.4f} |")
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
