"""Time one real BC job (1000 training steps + 100 evaluation episodes of the EMA policy) per optimizer.

    python -m benchmarks.bench_bc --task humanoid --threads 2 --out results/bench/bc_humanoid.md

Each job is the suite's own (`run.py task=<task> optim=<optim>` with the paper's settings and the
committed expert's demonstrations), run in this process one after another; the table gives its
training time, evaluation time and wall time from summary.json. The header records the commit and
the load average, since other processes on a shared machine change the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from experiments.common.launch import run_job
from experiments.common.provenance import emit_report, git_revision

ROOT = Path(__file__).resolve().parents[1]
OPTIMS = ("adamw", "dopr_adamw", "muon", "dopr_muon", "signum", "dopr_signum", "adamuon", "dopr_adamuon")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="humanoid")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optims", default=",".join(OPTIMS))
    p.add_argument("--num-trajectories", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for name in a.optims.split(","):
            cfg = compose("config", overrides=[f"task={a.task}", f"+tuned/{a.task}={name}", f"task.threads={a.threads}",
                                               f"task.num_trajectories={a.num_trajectories}"])
            run_job(cfg, Path(tmp) / name)
            s = json.loads((Path(tmp) / name / "summary.json").read_text())
            rows.append((name, s["train_time_s"], s["eval_time_s"], s["wall_time_s"], s["return_mean"]))
    load1 = os.getloadavg()[0]
    rev = git_revision()
    cmd = (f"python -m benchmarks.bench_bc --task {a.task} --threads {a.threads} --num-trajectories {a.num_trajectories}"
           + (f" --optims {a.optims}" if a.optims != ",".join(OPTIMS) else "") + (f" --out {a.out}" if a.out else ""))
    lines = [f"# One BC job ({a.task}, {a.num_trajectories} trajectories): 1000 training steps + 100 evaluation episodes", "",
             f"Made by `{cmd}` at commit `{rev}`; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{a.threads} threads; load average {load0:.2f} at start, {load1:.2f} at end.", "",
             "Training time in s for 1000 steps is also the step time in ms.", "",
             "| optimizer | training s | evaluation s | job wall s | return |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {tr:.1f} | {ev:.1f} | {w:.1f} | {r:.0f} |" for n, tr, ev, w, r in rows]
    emit_report(lines, a.out)


if __name__ == "__main__":
    main()
