"""Issue 48 on a BC cell: DoPr with the span solver at several caps (one sweep over ap.span_cap and seeds)
beside the committed paper grid's cell at its tuned damping. The BC report groups runs by optimizer and
trajectory count, which would pool the caps; this table keeps them apart.

    python scripts/damping_free_bc.py multirun/damping_free/humanoid_span \
        --base results/humanoid/paper_humanoid/humanoid.csv [--out results/damping_free/humanoid.md]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common.provenance import emit_report, git_revision  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sweep")
    p.add_argument("--base", required=True, help="the paper grid's table (humanoid.csv) with the damped cells")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cells = defaultdict(list)
    for summary in sorted(Path(args.sweep).glob("*/summary.json")):
        s = json.loads(summary.read_text())
        cap = next((o.split("=", 1)[1] for o in s["overrides"] if o.startswith("ap.span_cap=")), None)
        cells[(s["optim"], s["num_trajectories"], cap)].append((s["seed"], s["return_mean"], s["val_loss"]))
    base = {(r["optimizer"], int(r["num_trajectories"])): r for r in csv.DictReader(open(args.base))}
    lines = [f"`python scripts/damping_free_bc.py {args.sweep} --base {args.base}`", "",
             f"commit {git_revision()}; per-seed mean return over its evaluation episodes, median [min-max] over "
             "seeds; validation MSE, mean over seeds. The damped rows are the paper grid's cells (its table, "
             "same seeds 0-2, the tuned damping); the span rows replace the damping by solver=span at the cap.", "",
             "| optimizer | trajectories | rule | seeds | return median [min-max] | val MSE |", "|---|---|---|---|---|---|"]
    for (optim, n) in sorted({(o, n) for o, n, _ in cells}):
        b = base.get((optim, n))
        if b:
            lines.append(f"| {optim} | {n} | damping {b['damping']} ({b['damping_mode']}) | {b['seeds']} | "
                         f"{float(b['seed_return_median']):.0f} [{float(b['seed_return_min']):.0f}-"
                         f"{float(b['seed_return_max']):.0f}] | {float(b['val_loss']):.4f} |")
        for cap in sorted({c for o, m, c in cells if (o, m) == (optim, n)}, key=float):
            runs = cells[(optim, n, cap)]
            ret = [r for _, r, _ in runs]
            lines.append(f"| {optim} | {n} | span cap {cap} | {len(runs)} | {statistics.median(ret):.0f} "
                         f"[{min(ret):.0f}-{max(ret):.0f}] | {statistics.mean(v for *_, v in runs):.4f} |")
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
