"""Aggregate sweeps into results/<task>/: tables (CSV and markdown) and figures (PNG).

    python -m experiments.report multirun/feature_learning/20261121-230000 [more sweep dirs] [--out results]

Each finished job (a directory with summary.json) becomes a record; records are grouped by task and
handed to the task module's `report(records, out_dir, stamp)`, which writes the files that mirror
the paper's figure for that task. Every file carries `stamp`: the command and commit. Re-running
the command rewrites the same files (idempotent).
"""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from experiments.common.run import git_revision


def load_records(sweep_dirs) -> list:
    records = []
    for root in sweep_dirs:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"sweep directory not found: {root}")
        for summary in sorted(root.rglob("summary.json")):
            job = summary.parent
            cfg_file = job / ".hydra" / "config.yaml"
            metrics_file = job / "metrics.jsonl"
            records.append({
                "dir": job,
                "summary": json.loads(summary.read_text()),
                "config": OmegaConf.load(cfg_file) if cfg_file.exists() else None,
                "metrics": [json.loads(l) for l in metrics_file.read_text().splitlines() if l] if metrics_file.exists() else [],
            })
    return records


def write_table(rows: list, columns: list, path_stem: Path, stamp: str, title: str = "") -> None:
    """rows: list of dicts. Writes <stem>.csv and <stem>.md (the markdown names command and commit)."""
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    with open(path_stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [f"# {title}" if title else "", "", stamp, "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    path_stem.with_suffix(".md").write_text("\n".join(lines).lstrip() + "\n")


def stamp_figure(fig, stamp: str) -> None:
    fig.text(0.01, 0.005, stamp.replace("`", ""), fontsize=6, color="0.4", ha="left", va="bottom")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="sweep (multirun) directories")
    ap.add_argument("--out", default="results", help="results root (default: results)")
    args = ap.parse_args(argv)
    records = load_records(args.sweeps)
    if not records:
        raise SystemExit(f"no finished job (summary.json) under {args.sweeps}")
    by_sweep = defaultdict(list)  # results/<task>/ for a task's main sweep, results/<task>/<sweep>/ else
    for r in records:
        sweep = r["config"].sweep_name if r["config"] is not None else r["summary"]["task"]
        by_sweep[(r["summary"]["task"], sweep)].append(r)
    command = "python -m experiments.report " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    stamp = f"Made by `{command}` at commit `{git_revision()}` from {len(records)} runs."
    for (task, sweep), recs in sorted(by_sweep.items()):
        module = importlib.import_module(recs[0]["config"].task.entry.rsplit(".", 1)[0])
        out = Path(args.out) / task / ("" if sweep == task else sweep)
        out.mkdir(parents=True, exist_ok=True)
        module.report(recs, out, stamp)
        print(f"{task} ({sweep}): {len(recs)} runs -> {out}")


if __name__ == "__main__":
    main()
