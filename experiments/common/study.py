"""A study at the committed setting (docs/protocol.md): an arm's committed tuned config (a selection made by the
tuning protocol, not tuned again) run at each value of one axis on the fresh seeds, each value against the first
by the protocol's rule: better or worse where the fresh seeds' ranges do not overlap, inconclusive where they do
(tuning.spread_verdict), judged by the selection's metric.

    python -m experiments.common.study multirun/protocol/feature_learning/staleness/protocol/dopr_adamw \
        --selection results/feature_learning/protocol/selection.json --axis ap.precond_every \
        --values 1,3,10,30,100 --arms dopr_adamw --seeds 1,2,3 --out results/staleness/feature_learning

(`python -m experiments.common.protocol report <task> --variant <study>` writes this line.) Writes study.md (a table
per arm: one row per value, each metric as median [min-max] over the seeds, the verdict against the first value),
study.csv (the same rows, numbers) and study_runs.csv (one row per run: arm, value, seed, metrics, the share of
layer-steps that refreshed a factor, wall_time_s).
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .report import load_records, make_stamp, markdown_table, write_csv
from .tuning import (chosen_settings, matches_setting, override_text, parse_override, parse_value, report, same_value,
                     seed_list, spread_verdict, task_tuning)


def axis_value(record: dict, axis: str):
    """The value of `axis` a run trained with: its resolved config's, else its command line's."""
    if record.get("config") is not None:
        value = OmegaConf.select(record["config"], axis, default=None)
        if value is not None:
            return value
    over = dict(parse_override(o) for o in record["summary"].get("overrides", []))
    return parse_value(over[axis]) if axis in over else None


def _without(selection: dict, axis: str) -> dict:
    """The selection with `axis` dropped from every arm's setting: the study varies it."""
    out = copy.deepcopy(selection)
    for a in out["arms"].values():
        for part in ("base", "winner"):
            a[part] = {k: v for k, v in a[part].items() if k.lstrip("+~") != axis}
    return out


def study_rows(records: list, selection: dict, arm: str, axis: str, values: list, metrics: list, seeds: list) -> list:
    """One row per value of the axis: the arm's runs at its committed setting and that value, on the seeds
    (tuning.report's row: each metric's min / median / max, the seeds, those missing), and its verdict against the
    first value by the selection's metric."""
    plain = _without(selection, axis)
    rows = []
    for v in values:
        at = [r for r in records if same_value(axis_value(r, axis), v)]
        row = next(r for r in report(at, plain, metrics, seeds) if r["arm"] == arm)
        rows.append({**row, axis: v})
    m, mode = selection["metric"], selection["mode"]
    ref = rows[0]
    for row in rows:
        partial = [r for r in (row, ref) if r.get("missing") or f"{m}_median" not in r]
        row["verdict"] = ("reference" if row is ref else
                          "no verdict (partial)" if partial else spread_verdict(row, ref, m, mode)[0])
    return rows


def run_rows(records: list, selection: dict, arm: str, axis: str, values: list, metrics: list, seeds: list) -> list:
    """One row per run the study's table counts: arm, value, seed, the metrics, wall_time_s."""
    setting = chosen_settings(_without(selection, axis))[arm]
    out = []
    for r in records:
        s, v = r["summary"], axis_value(r, axis)
        if s["optim"] == arm and s["seed"] in seeds and any(same_value(v, x) for x in values) and matches_setting(r, setting):
            out.append({"arm": arm, axis: v, "seed": s["seed"], **{m: s.get(m) for m in metrics},
                        "refresh_fraction": refresh_fraction(s), "wall_time_s": s.get("wall_time_s")})
    return sorted(out, key=lambda r: (values.index(next(x for x in values if same_value(r[axis], x))), r["seed"]))


def refresh_fraction(summary: dict):
    """The share of a DoPr run's preconditioned layer-steps that got a new factor (its counters: factorizations over
    preconditioned); None for a run without them."""
    counts = summary.get("dopr") or {}
    return counts["factorizations"] / counts["preconditioned"] if counts.get("preconditioned") else None


def _cell(row: dict, m: str) -> str:
    if f"{m}_median" not in row:
        return "no runs"
    return f"{row[f'{m}_median']:.4g} [{row[f'{m}_min']:.4g}-{row[f'{m}_max']:.4g}]"


def write_study(rows: dict, runs: list, selection: dict, axis: str, metrics: list, seeds: list, out: Path,
                stamp: str, source: str) -> None:
    """study.md (a table per arm), study.csv and study_runs.csv in `out`; rows: {arm: study_rows}."""
    m, mode = selection["metric"], selection["mode"]
    every = [r for arm_rows in rows.values() for r in arm_rows]
    stats = [f"{k}_{s}" for k in metrics for s in ("median", "min", "max")]
    write_csv(every, ["arm", axis, "seeds", "missing", "diverged", *stats, "verdict"], out / "study.csv")
    write_csv(runs, ["arm", axis, "seed", *metrics, "refresh_fraction", "wall_time_s"], out / "study_runs.csv")
    values = ", ".join(override_text(r[axis]) for r in every if r["arm"] == every[0]["arm"])
    lines = [f"# A study at the committed setting: {axis} in {{{values}}}", "", stamp, "",
             f"Each arm at its setting from {source} (not tuned again), on the fresh seeds {seeds}; each metric median "
             f"[min-max] over the seeds. Verdict per value against {axis}={override_text(every[0][axis])} by {m} "
             f"({'lower' if mode == 'min' else 'higher'} is better): better or worse where the seeds' ranges do not "
             "overlap, inconclusive where they do; none where a seed is missing (`missing`)."]
    for arm, arm_rows in rows.items():
        table = [{axis: override_text(r[axis]), "seeds": r["seeds"], **{k: _cell(r, k) for k in metrics},
                  "verdict": r["verdict"], "missing": r.get("missing", ""), "diverged": r.get("diverged", "")}
                 for r in arm_rows]
        cols = [axis, "seeds", *metrics, "verdict"] + [c for c in ("missing", "diverged") if any(t[c] for t in table)]
        lines += ["", f"## {arm}", "", *markdown_table(table, cols)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="the study's fresh-seed sweeps")
    p.add_argument("--selection", required=True, help="the committed selection.json whose settings the study reuses")
    p.add_argument("--axis", required=True, help="the config key the study varies, e.g. ap.precond_every")
    p.add_argument("--values", required=True, help="its values, the first the reference, e.g. 1,3,10,30,100")
    p.add_argument("--arms", required=True, help="the selection's arms studied, comma-separated, e.g. dopr_adamw")
    p.add_argument("--seeds", help="the fresh seeds (default: the selection's), e.g. 1,2,3")
    p.add_argument("--out", required=True, help="where study.md, study.csv, study_runs.csv go")
    args = p.parse_args(argv)
    try:
        records = load_records(args.sweeps)
    except FileNotFoundError as e:
        raise SystemExit(f"refused: {e}")
    if not records:
        raise SystemExit(f"refused: no finished job (summary.json) under {args.sweeps}")
    selection = json.loads(Path(args.selection).read_text())
    values = [parse_value(v) for v in args.values.split(",")]
    seeds = seed_list(args.seeds) if args.seeds else selection["fresh_seeds"]
    metrics = task_tuning(records).get("report", [selection["metric"]])
    command = "python -m experiments.common.study " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    try:
        arms = args.arms.split(",")
        unknown = [a for a in arms if a not in selection["arms"]]
        if unknown:
            raise ValueError(f"--arms: no arm {unknown[0]!r} in {args.selection} "
                             f"(arms: {', '.join(selection['arms'])})")
        rows = {a: study_rows(records, selection, a, args.axis, values, metrics, seeds) for a in arms}
        runs = [r for a in arms for r in run_rows(records, selection, a, args.axis, values, metrics, seeds)]
    except ValueError as e:
        raise SystemExit(f"refused: {e}")
    write_study(rows, runs, selection, args.axis, metrics, seeds, Path(args.out), make_stamp(records, command),
                args.selection)
    for arm, arm_rows in rows.items():
        for r in arm_rows:
            print(arm, f"{args.axis}={override_text(r[args.axis])}", r["seeds"], _cell(r, selection["metric"]), r["verdict"])


if __name__ == "__main__":
    main()
