"""CPU step cost of the damping rules: the sample-count rule and the weak-share rule's variants against
the trace rule and the plain GP (issue 67 items 2 and 4).

    python -m benchmarks.sample_count_cost [--batch 256] [--steps 20] [--repeats 5] [--threads 1]
        [--rules NAME ...] [--out FILE.md]

DoPr-AdamW on the benchmark's residual MLP (benchmarks.bench.ResMLP), one fixed random batch, one fresh
seeded model per rule; the rules step in turn (round-robin: each repeat times --steps steps of each, the
order alternating), so that load drift hits them alike. Reports the median ms per full step (forward,
backward, step, zero_grad) over the repeats, its min-max, and the ratios of medians to the trace rule and
to the plain GP (AdamW).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import dopr
from benchmarks.bench import ResMLP

#: rule name -> the AP options (None: the plain GP). The weak-share rows are the damping-free study's
#: settings (results/damping_free/README.md): floor 1e-6 tr(Sigma), bound 0.25.
_WEAK = {"damping": 1e-6, "weak_share_bound": 0.25}
RULES = {
    "trace (damping 1e-4)": {},
    "adamw (GP alone)": None,
    "sample_count": {"damping_rule": "sample_count", "damping": 0.0},
    "sample_count_seen, floor 1e-4": {"damping_rule": "sample_count_seen", "damping": 1e-4},
    "weak share 0.25 (spectrum, every refresh)": {**_WEAK, "health_every": 1},
    "weak share 0.25 (spectrum, every 10th refresh)": {**_WEAK, "health_every": 10},
    "weak share 0.25 (filter)": {**_WEAK, "weak_share_estimate": "filter"},
}


def _setup(options: dict, batch: int):
    torch.manual_seed(0)
    model = ResMLP()
    opt = dopr.build(model, "adamw", ap=options, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 348, generator=g), torch.randn(batch, 17, generator=g)

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rules", nargs="+", choices=list(RULES), default=list(RULES), metavar="NAME",
                   help="which rows to time (default all; the first is the ratios' reference)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = {name: _setup(RULES[name], args.batch) for name in args.rules}
    for s in steps.values():
        for _ in range(3):      # warm-up: state allocation, first factors
            s()
    load0, times = os.getloadavg()[0], {name: [] for name in steps}
    for r in range(args.repeats):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    base = statistics.median(times[next(iter(times))])
    lines = [f"`python -m benchmarks.sample_count_cost {shlex.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"commit {commit}{'-dirty' if dirty else ''}, {datetime.datetime.now().isoformat(timespec='seconds')}, "
             f"torch {torch.__version__}, cpu, {args.threads} thread(s), ResMLP (348-256-256-256-17), batch "
             f"{args.batch}, {args.repeats} round-robin repeats of {args.steps} steps, load average {load0:.2f} at "
             f"start, {os.getloadavg()[0]:.2f} at end", "",
             f"| rule | ms / step (median) | min - max over repeats | ratio to {next(iter(times))} | ratio to GP |",
             "|---|---|---|---|---|"]
    gp = next((n for n in times if RULES[n] is None), None)
    for name, ts in times.items():
        med = statistics.median(ts)
        to_gp = f"{med / statistics.median(times[gp]):.3f}" if gp else "-"
        lines.append(f"| {name} | {med:.2f} | {min(ts):.2f} - {max(ts):.2f} | {med / base:.3f} | {to_gp} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
