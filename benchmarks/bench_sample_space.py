"""The step cost of DoPr's sample-space solve (dopr/sample_space.py) against the feature-space solve, where a
layer sees fewer rows n than its dimension d.

    python -m benchmarks.bench_sample_space [--cases mlp4096,lora4096] [--repeats 3] [--threads 2] [--out FILE.md]

Cases (float32, CPU):
  mlp4096   Linear(4096, 4096) - tanh - Linear(4096, 4096), batch 256: n = 256 rows for d = 4097
  lora4096  the same two Linears frozen, peft LoRA r = 64 on both, 1 x 256 tokens: lora_A n = 256 for
            d = 4096 (sample space), lora_B d = 64 (Sigma either way)

One step is zero_grad, forward, backward and the optimizer step. Rows: AdamW alone, DoPr-AdamW with
solve_space="features" (the d x d Sigma: a7af4b7's path) and with "auto" (sample space for the layers with
n < d). Times are medians over --repeats after one warm-up, the three run in turn; R is the step's time
over AdamW's. "max rel. diff." is max over layers of ||M_auto - M_features||_F / ||M_features||_F on the
first step (float32 both: each carries its own rounding, cond(Sigma + lam I) <= 1 + 1 / damping).
"""
from __future__ import annotations

import argparse
import copy
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dopr import DoPr

WIDTH, ROWS, RANK = 4096, 256, 64


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _lora():
    import peft

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.down(self.up(x).tanh())

    torch.manual_seed(0)
    model = peft.get_peft_model(Pair(), peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["up", "down"],
                                                        lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:          # peft starts lora_B at zero: give lora_A a gradient
            nn.init.normal_(p, std=0.02)
    return model


CASES = {"mlp4096": (_mlp, (ROWS, WIDTH)), "lora4096": (_lora, (1, ROWS, WIDTH))}


def _stepper(make, shape, space):
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    base = torch.optim.AdamW(params, lr=1e-4)
    opt = base if space is None else DoPr(model, base, solve_space=space)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, opt

    return step


def run_case(name: str, repeats: int) -> dict:
    make, shape = CASES[name]
    steppers = {label: _stepper(make, shape, space)
                for label, space in (("AdamW", None), ("DoPr-AdamW features", "features"), ("DoPr-AdamW auto", "auto"))}
    first = {label: step() for label, step in steppers.items()}        # warm-up
    grads = {label: copy.deepcopy(first[label][0]) for label in first}
    diff = max(float((grads["DoPr-AdamW auto"][n] - g).norm() / g.norm())
               for n, g in grads["DoPr-AdamW features"].items())
    times = {label: [] for label in steppers}
    for _ in range(repeats):
        for label, step in steppers.items():
            t = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    stats, steps = first["DoPr-AdamW auto"][1].stats(), 1 + repeats
    return {"name": name, "ms": {k: 1e3 * v for k, v in med.items()}, "diff": diff,
            "solves": (stats["sample_space_solves"] // steps, stats["factorizations"] // steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp4096,lora4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    load0 = os.getloadavg()[0]
    results = [run_case(c, args.repeats) for c in args.cases.split(",")]
    lines = [f"`python -m benchmarks.bench_sample_space {shlex.join(sys.argv[1:])}`", "",
             f"commit {commit}, torch {torch.__version__}, CPU, {args.threads} threads, repeats {args.repeats} "
             f"(median), load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end", "",
             "One step (zero_grad, forward, backward, optimizer step), float32; R = step time / AdamW's. "
             "Cases and columns: the script's docstring.", "",
             "| case | AdamW ms | DoPr features ms (R) | DoPr auto ms (R) | speed-up | groups per step in sample "
             "space / factored | max rel. diff. of M |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ms = r["ms"]
        base, feat, auto = ms["AdamW"], ms["DoPr-AdamW features"], ms["DoPr-AdamW auto"]
        lines.append(f"| {r['name']} | {base:.0f} | {feat:.0f} ({feat / base:.2f}) | {auto:.0f} ({auto / base:.2f}) "
                     f"| {feat / auto:.1f}x | {r['solves'][0]} / {r['solves'][1]} | {r['diff']:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
