"""CPU step cost of the sample-count damping rule against the trace rule (issue 67 item 2).

    python -m benchmarks.sample_count_cost [--batch 256] [--steps 20] [--repeats 5] [--threads 1] [--out FILE.md]

DoPr-AdamW on the benchmark's residual MLP (benchmarks.bench.ResMLP), one fixed random batch, one fresh
seeded model per rule; the rules step in turn (round-robin: each repeat times --steps steps of each, the
order alternating), so that load drift hits them alike. Reports the median ms per full step (forward,
backward, step, zero_grad) over the repeats, its min-max, and the ratio of medians.
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

RULES = {"trace (damping 1e-4)": {}, "sample_count": {"damping_rule": "sample_count"}}


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
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = {name: _setup(o, args.batch) for name, o in RULES.items()}
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
             "| rule | ms / step (median) | min - max over repeats | ratio to trace |", "|---|---|---|---|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med:.2f} | {min(ts):.2f} - {max(ts):.2f} | {med / base:.3f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
