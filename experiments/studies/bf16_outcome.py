"""Does bf16 autocast change what DoPr trains to (issue 61 item 8)? The table of a sweep of the SiT digits
task at 1000 steps, float32 against bf16 autocast (on the CPU too: ``task.bf16=any_device``), AdamW and
DoPr-AdamW, two seeds:

    python run.py -m task=sit_digits '+tuned/sit_digits=adamw,dopr_adamw' seed=0,1 \
        task.bf16=false,any_device task.steps=1000 hydra.sweep.dir=multirun/bf16_outcome
    python -m experiments.studies.bf16_outcome multirun/bf16_outcome --out results/numerics/bf16_outcome.md

Per optimizer and precision: the final FD-digits and training loss of each seed. The verdict: bf16 is worse
"beyond the seed spread" when every bf16 seed is worse than every float32 seed (the two ranges do not
overlap); DoPr's bf16 gap is then compared with AdamW's.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import yaml

METRICS = (("quality", "FD-digits"), ("train_loss", "training loss"))


def jobs(sweep: Path) -> list:
    """[(optimizer, precision, seed, summary)] of every finished job under `sweep`."""
    out = []
    for summary in sorted(sweep.glob("*/summary.json")):
        s = json.loads(summary.read_text())
        overrides = yaml.safe_load((summary.parent / ".hydra" / "overrides.yaml").read_text()) \
            if (summary.parent / ".hydra" / "overrides.yaml").exists() else []
        bf16 = next((o.split("=", 1)[1] for o in overrides if o.startswith("task.bf16=")), None)
        if bf16 is None:
            raise SystemExit(f"{summary.parent}: no task.bf16 override in .hydra/overrides.yaml")
        precision = "float32" if bf16.lower() == "false" else "bf16 autocast"
        out.append((s["optim"], precision, int(s["seed"]), s))
    if not out:
        raise SystemExit(f"no finished job (summary.json) under {sweep}")
    return out


def verdict(f32: list, b16: list) -> str:
    if min(b16) > max(f32):
        return "worse beyond the seed spread"
    if max(b16) < min(f32):
        return "better beyond the seed spread"
    return "within the seed spread"


def table(rows: list) -> str:
    by = defaultdict(dict)
    for optim, precision, seed, s in rows:
        by[(optim, precision)][seed] = s
    lines = ["| optimizer | precision | seeds | " + " | ".join(f"{label} per seed" for _, label in METRICS) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    for (optim, precision), seeds in sorted(by.items()):
        cells = [", ".join(f"{seeds[k][m]:.4g}" for k in sorted(seeds)) for m, _ in METRICS]
        lines.append(f"| {optim} | {precision} | {', '.join(map(str, sorted(seeds)))} | " + " | ".join(cells) + " |")
    lines += ["", "| optimizer | metric | float32 range | bf16 range | bf16 - float32 (mean) | bf16 against float32 |",
              "|---|---|---|---|---|---|"]
    for optim in sorted({o for o, _ in by}):
        f32, b16 = by.get((optim, "float32"), {}), by.get((optim, "bf16 autocast"), {})
        if not f32 or not b16:
            continue
        for m, label in METRICS:
            a, b = [s[m] for s in f32.values()], [s[m] for s in b16.values()]
            gap = sum(b) / len(b) - sum(a) / len(a)
            lines.append(f"| {optim} | {label} | {min(a):.4g}-{max(a):.4g} | {min(b):.4g}-{max(b):.4g} | "
                         f"{gap:+.3g} | {verdict(a, b)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not args.sweep.is_dir():
        raise SystemExit(f"no sweep folder {args.sweep}")
    rows = jobs(args.sweep)
    revisions = sorted({s.get("git_revision", "?") for *_, s in rows})
    text = (f"# bf16 autocast against float32: the SiT digits task, 1000 steps\n\n"
            f"Runs at {', '.join(revisions)}: `python run.py -m task=sit_digits '+tuned/sit_digits=adamw,dopr_adamw' "
            f"seed=0,1 task.bf16=false,any_device task.steps=1000`; table by `python -m experiments.studies.bf16_outcome`.\n\n"
            + table(rows) + "\n")
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
