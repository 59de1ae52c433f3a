"""DoPr-AdamW's CPU step against AdamW's on several commits at once, their timed steps interleaved (issue 73).

    python -m benchmarks.bench_step_compare [--commits 5165447 .] [--models transformer,mlp] [--repeats 30]
        [--warmup 3] [--threads 1] [--out results/bench/step_cpu_73.md]

Each commit (a git revision, checked out in a temporary worktree; "." is this working tree as it is) gets one
worker process per model that imports that commit's dopr (PYTHONPATH) and holds one model copy per row, same
seed, same batch: ``adamw`` (torch.optim.AdamW, lr 1e-3), ``dopr_adamw`` (dopr.DoPr on it, default options) and
``dopr_adamw features`` (the same with solve_space="features"). After --warmup untimed steps of every row, each
round times one full training step (forward, loss, backward, optimizer.step, zero_grad) of every row of every
worker, the workers in turn (the order reversed every other round), so drift and load hit all of them alike.
R is a row's step over AdamW's in the same round and worker. Reported: medians with the interquartile range
[q1-q3] over the rounds, and the load average around the run.

Models (the worker builds them; the models do not depend on the commit):
  transformer  benchmarks.bench's decoder with 2 blocks (d 256, 4 heads, ffn 1024, vocab 512), 4 x 512 tokens:
               the AP's groups have d = 257 and 1025, 2048 rows
  mlp          Linear 349 -> 256 -> 256 -> 17 (ReLU), 256 rows, MSE: d = 350, 257, 257 at n = 256 rows
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@ "   # a worker's protocol lines (anything else it prints is passed on)
ROWS = ("adamw", "dopr_adamw", "dopr_adamw features")


# ------------------------------------------------------------------------------------ the worker
def _models(name: str):
    """(model, inputs, targets, loss) for a model name, seeded (torch alone; this checkout's benchmarks.bench
    for the decoder, loaded by path so that the worker's dopr stays the commit's)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(349, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 17))
        return model, torch.randn(256, 349), torch.randn(256, 17), F.mse_loss
    spec = importlib.util.spec_from_file_location("_bench_models", ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = bench.Transformer(vocab=512, d=256, layers=2)
    tokens = torch.randint(0, 512, (4, 512)), torch.randint(0, 512, (4, 512))
    return model, *tokens, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


def worker(model_name: str, threads: int) -> None:
    """Serve the driver on stdin/stdout: ``warmup K`` (K untimed steps of every row), ``round`` (one timed step
    of every row: {row: ms}), ``quit``."""
    import torch
    import dopr

    torch.set_num_threads(threads)
    rows = {}
    for label in ROWS:
        model, x, y, loss = _models(model_name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if label != "adamw":
            opt = dopr.DoPr(model, opt, **({"solve_space": "features"} if label.endswith("features") else {}))
        rows[label] = (model, opt, x, y, loss)

    def step(label: str) -> float:
        model, opt, x, y, loss = rows[label]
        t0 = time.perf_counter()
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return 1e3 * (time.perf_counter() - t0)

    print(MARK + json.dumps({"dopr": dopr.__file__, "torch": torch.__version__, "threads": torch.get_num_threads()}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "warmup":
            for _ in range(int(cmd[1])):
                for label in rows:
                    step(label)
            print(MARK + "{}", flush=True)
        elif cmd[0] == "round":
            print(MARK + json.dumps({label: step(label) for label in rows}), flush=True)
        else:
            break


class Worker:
    """A worker process on one tree (its dopr first on the path)."""

    def __init__(self, tree: Path, model: str, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", model,
                                      "--threads", str(threads)], cwd=tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self.ask(None)
        if not Path(self.info["dopr"]).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the worker for {tree} imported dopr from {self.info['dopr']}")

    def ask(self, command):
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            print(line, end="", file=sys.stderr)
        raise RuntimeError(f"worker exited with {self.proc.wait()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------------ the driver
def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _spread(values: list, digits: int) -> str:
    """median [q1-q3]."""
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return f"{med:.{digits}f} [{q1:.{digits}f}-{q3:.{digits}f}]"


def compare(model: str, trees: dict, repeats: int, warmup: int, threads: int) -> dict:
    """{commit: {row: [ms per round]}} of one model, the workers' rounds interleaved."""
    workers = {}
    try:
        for name, tree in trees.items():
            workers[name] = Worker(tree, model, threads)
        for w in workers.values():
            w.ask(f"warmup {warmup}")
        times = {name: defaultdict(list) for name in workers}
        for rep in range(repeats):
            for name in (list(workers) if rep % 2 == 0 else list(workers)[::-1]):
                for label, ms in workers[name].ask("round").items():
                    times[name][label].append(ms)
        return times
    finally:
        for w in workers.values():
            w.close()


def report(model: str, times: dict) -> list:
    lines = [f"### {model}", "", "| commit | optimizer | t_step ms, median [q1-q3] | R against AdamW, median [q1-q3] |",
             "|---|---|---|---|"]
    for name, rows in times.items():
        for label, ms in rows.items():
            r = "" if label == "adamw" else _spread([a / b for a, b in zip(ms, rows["adamw"])], 3)
            lines.append(f"| {name} | {label} | {_spread(ms, 1)} | {r} |")
    return lines + [""]


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commits", nargs="+", default=["5165447", "."], help="git revisions; '.' is this working tree")
    p.add_argument("--models", default="transformer,mlp")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of every row first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads)
        return ""
    load0 = os.getloadavg()[0]
    dirty = "-dirty" if _git("status", "--porcelain") else ""
    names = {c: (_git("rev-parse", "--short", "HEAD") + dirty + " (this tree)" if c == "." else _git("rev-parse", "--short", c))
             for c in args.commits}
    command = f"python -m benchmarks.bench_step_compare {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()
    lines = [f"`{command}`", ""]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        try:
            for c in args.commits:
                if c == ".":
                    trees[names[c]] = ROOT
                else:
                    trees[names[c]] = Path(tmp) / names[c]
                    _git("worktree", "add", "--detach", str(trees[names[c]]), c)
            body = []
            for model in args.models.split(","):
                print(f"[bench_step_compare] {model} ...", file=sys.stderr, flush=True)
                body += report(model, compare(model, trees, args.repeats, args.warmup, args.threads))
        finally:
            for c in args.commits:
                if c != ".":
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees.get(names[c], ""))], cwd=ROOT,
                                   capture_output=True)
    import torch
    from benchmarks.bench import write_report
    lines += [f"{datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, CPU, "
              f"{args.threads} thread(s), {args.repeats} rounds after {args.warmup} untimed steps, commits "
              + ", ".join(trees) + f"; load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end", "",
              "Rows, models and R: the script's docstring.", ""] + body
    text = "\n".join(lines)
    write_report(text, args.out)
    return text


if __name__ == "__main__":
    main()
