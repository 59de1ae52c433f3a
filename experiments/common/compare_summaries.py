"""Do two sets of runs give the same results? Compares the numbers of each run's summary.json.

    python -m experiments.common.compare_summaries BEFORE_DIR AFTER_DIR [--out FILE.md]

Each DIR holds one run folder per job (same names in both). Every numeric leaf of summary.json is
compared but timings and provenance (keys ending in ``time_s``, ``git_revision``, ``packages``,
``overrides``, ``command``): identical, or the largest relative difference. A change that alters
the order of a float sum moves results by rounding, not by more; this table tells which it was.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

SKIP = ("git_revision", "packages", "overrides", "command", "host", "started", "finished")
#: timings: keys ending in time_s, or seconds / a rate per second of an evaluation's part (env_s_1,
#: env_steps_per_s_1, policy_s_1: robomimic's rollout timings, per camera count)
TIMING = re.compile(r"(time_s|_s|_per_s)(_\d+)?$")


def leaves(obj, prefix=""):
    """{dotted key: number} of the numeric leaves of a summary (timings and provenance left out)."""
    out = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if str(k) in SKIP or TIMING.search(str(k)):
            continue
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[key] = float(v)
        else:
            out.update(leaves(v, key))
    return out


def compare(a: dict, b: dict) -> tuple:
    """(keys compared, keys that differ, largest relative difference, keys only in one)."""
    common = sorted(set(a) & set(b))
    differ, worst = [], 0.0
    for k in common:
        x, y = a[k], b[k]
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        differ.append(k)
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-300))
    return len(common), differ, worst, sorted(set(a) ^ set(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = ["| job | numbers compared | identical | differ (largest relative difference) |", "|---|---|---|---|"]
    for run in sorted(d for d in args.before.iterdir() if (d / "summary.json").exists()):
        other = args.after / run.name / "summary.json"
        if not other.exists():
            rows.append(f"| {run.name} | - | - | no summary.json in {args.after} |")
            continue
        a, b = (leaves(json.loads(f.read_text())) for f in (run / "summary.json", other))
        n, differ, worst, only = compare(a, b)
        note = f"{len(differ)}: {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''} ({worst:.2e})" if differ else ""
        note += f"; only in one: {', '.join(only)}" if only else ""
        rows.append(f"| {run.name} | {n} | {n - len(differ)} | {note} |")
    text = "\n".join(rows) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
