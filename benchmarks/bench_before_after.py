"""The CPU step benchmarks of two commits side by side, in one run: each benchmark runs on the old
commit (a temporary git worktree) and then on this checkout, with the same command.

    python -m benchmarks.bench_before_after --before 705145b --out results/bench/before_after_cpu.md
        [--only dopr,sit,robomimic]

The benchmarks are the committed ones (results/bench/cpu.md, results/sit/bench_step_cpu.md,
results/robomimic/bench_step_cpu.md), same arguments. Within a benchmark the GP and its DoPr rows
step in turn, so R (DoPr's step over its GP's) is what compares across the two commits; absolute
times move with the machine's load, which each report's header records.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> the module and arguments of the committed benchmark (its --out added here)
BENCHES = {
    "dopr": ["benchmarks.bench"],
    "sit": ["benchmarks.bench_family", "sit", "--batch", "16", "--gps", "adamw,muon", "--precond-every", "1,10",
            "--repeats", "3", "--budget", "1", "--threads", "1"],
    "robomimic": ["benchmarks.bench_family", "robomimic", "--batch", "256", "--gps", "adamw,muon",
                  "--precond-every", "1", "--repeats", "2", "--budget", "1", "--threads", "1"],
}


def run(tree: Path, bench: list, out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled"}
    if bench[0] == "benchmarks.bench" and not (tree / "benchmarks" / "bench.py").exists():
        bench = ["dopr.bench", *bench[1:]]   # a commit from before the bench left the library
    if bench[0] == "benchmarks.bench_family" and not (tree / "benchmarks" / "bench_family.py").exists():
        bench = [f"experiments.{bench[1]}.bench", "step", *bench[2:]]   # from before the family's step moved here
    subprocess.run([sys.executable, "-m", *bench, "--out", str(out)], cwd=tree, env=env, check=True)
    return out.read_text()


def rows(report: str) -> dict:
    """{(model header, optimizer): (t_step ms, R)} of a benchmarks.bench report."""
    out, model = {}, None
    for line in report.splitlines():
        if line.startswith("### "):
            model = line[4:].split(":")[0]
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if model and len(cells) >= 4 and re.fullmatch(r"[\d.]+", cells[2] or "x"):
            out[(model, cells[0])] = (float(cells[2]), cells[3])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the old commit")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default=",".join(BENCHES))
    args = p.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = "-dirty" if subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() else ""
    lines = [f"`python -m benchmarks.bench_before_after --before {args.before} --out {args.out}"
             + (f" --only {args.only}" if args.only != ",".join(BENCHES) else "") + "`", "",
             f"before: {args.before}; after: {head}{dirty}. Each benchmark ran on the old commit, then on this one.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=ROOT, check=True)
        try:
            for name in args.only.split(","):
                reports = {which: run(tree, BENCHES[name], Path(tmp) / f"{name}_{which}.md")
                           for which, tree in (("before", old), ("after", ROOT))}
                a, b = rows(reports["before"]), rows(reports["after"])
                lines += [f"## {name}: `python -m {' '.join(BENCHES[name])}`", "",
                          "| model | optimizer | t_step before (ms) | R before | t_step after (ms) | R after |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {m} | {o} | {a[(m, o)][0]:.1f} | {a[(m, o)][1]} | {b[(m, o)][0]:.1f} | {b[(m, o)][1]} |"
                          for (m, o) in a if (m, o) in b]
                for which in ("before", "after"):
                    header = next(ln for ln in reports[which].splitlines() if ln.startswith("commit "))
                    lines += ["", f"{which}: {header}"]
                lines.append("")
                print("\n".join(lines), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
