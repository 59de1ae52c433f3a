"""Issue 48 on SiT digits under the tuning protocol: a DoPr rule's tune (one sweep over the learning rate on
the tuning seed) and its fresh seeds, beside the committed protocol of AdamW and damped DoPr-AdamW (the same
grid, tuning seed and fresh seeds). The protocol's own `tuning select` pairs each DoPr arm with its GP's
tune; the GP's tune is committed (`results/sit_digits/protocol/selection.json`) and its code is untouched
by the rule, so this table reads it from there rather than re-running it.

    python -m experiments.studies.damping_free_sit_digits --rule "span cap 3" \
        --tune multirun/damping_free/sit_digits_tune_span_cap3 \
        --fresh multirun/damping_free/sit_digits_protocol_span_cap3 \
        --committed results/sit_digits/protocol [--out results/damping_free/sit_digits_cap3.md]

--tune and --fresh take several folders (a sweep run in lanes), pooled; a learning rate tuned twice is refused.
Where the tune's runs are no longer on disk (a session's multirun/ does not outlive it), ``--tuned-lr LR
--tune-source "<where its table is committed>"`` takes the rate it chose instead, and the table says so.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from experiments.common.provenance import emit_report, git_revision

METRICS = ("quality", "best_quality", "train_loss")


def _runs(sweeps: list) -> list:
    """The runs of one or more sweep folders (e.g. a tune split into lanes by learning rate), pooled."""
    runs = []
    for sweep in sweeps:
        found = [json.loads(p.read_text()) for p in sorted(Path(sweep).glob("*/summary.json"))]
        if not found:
            raise SystemExit(f"no */summary.json under {sweep}")
        runs += found
    return runs


def _lr(summary: dict) -> float:
    return float(summary["lr"])


def _rule(summary: dict) -> list:
    """The run's DoPr overrides (ap.*): what makes it this rule."""
    return sorted(o for o in summary["overrides"] if o.startswith("ap."))


def _spread(values: list) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return (f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}], "
            f"mean {statistics.fmean(values):.3f} ± {se:.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rule", required=True, help="the rule's name in the table, e.g. 'span cap 3'")
    tuned = p.add_mutually_exclusive_group(required=True)
    tuned.add_argument("--tune", nargs="+", help="the rule's tuning sweep(s) (seed 0, the learning-rate grid)")
    tuned.add_argument("--tuned-lr", type=float, help="the rate the rule's tune chose, where its runs are gone "
                       "(with --tune-source)")
    p.add_argument("--tune-source", help="where the tune behind --tuned-lr is committed (its table)")
    p.add_argument("--fresh", required=True, nargs="+", help="the rule's fresh-seed sweep(s) at its chosen rate")
    p.add_argument("--committed", required=True, help="the committed protocol folder (selection.json, protocol.csv)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    selection = json.loads((Path(args.committed) / "selection.json").read_text())
    metric, mode = selection["metric"], selection["mode"]
    if args.tuned_lr is not None and not args.tune_source:
        raise SystemExit("--tuned-lr needs --tune-source: where the tune that chose it is committed")
    tune = _runs(args.tune) if args.tune else []
    if tune and {s["seed"] for s in tune} != set(selection["seeds"]):
        raise SystemExit(f"the rule's tune ran seeds {sorted({s['seed'] for s in tune})}, the committed "
                         f"protocol tuned on {selection['seeds']}")
    twice = sorted({_lr(s) for s in tune if [_lr(t) for t in tune].count(_lr(s)) > 1})
    if twice:
        raise SystemExit(f"the rule's tune ran lr {twice} more than once (overlapping lanes?): one run per rate")
    pick = min if mode == "min" else max
    chosen = pick(tune, key=lambda s: s[metric]) if tune else None
    chosen_lr = _lr(chosen) if tune else args.tuned_lr
    fresh = _runs(args.fresh)
    rules = {tuple(_rule(s)) for s in tune + fresh}
    if len(rules) != 1:
        raise SystemExit(f"the runs carry different DoPr overrides: {sorted(rules)}")
    lrs = {_lr(s) for s in fresh}
    if lrs != {chosen_lr}:
        raise SystemExit(f"the fresh seeds ran lr {sorted(lrs)}, the tune chose {chosen_lr}")
    seeds = sorted(s["seed"] for s in fresh)
    if set(seeds) & set(selection["seeds"]):
        raise SystemExit(f"fresh seeds {seeds} overlap the tuning seeds {selection['seeds']}")
    tune_args = (f"--tune {' '.join(args.tune)}" if tune else
                 f"--tuned-lr {args.tuned_lr:g} --tune-source '{args.tune_source}'")
    lines = [f"`python -m experiments.studies.damping_free_sit_digits --rule '{args.rule}' {tune_args} "
             f"--fresh {' '.join(args.fresh)} "
             f"--committed {args.committed}`", "",
             f"commit {git_revision()}; {metric} ({mode}) on tuning seeds {selection['seeds']}, the rule's rate chosen "
             f"by it; fresh seeds {seeds}: median [min-max], mean ± standard error. The adamw and dopr_adamw rows "
             f"are the committed protocol ({args.committed}); the rule's runs override {' '.join(_rule(fresh[0]))}.", "",
             "## Tune", "", "| rule | lr | " + metric + " |", "|---|---|---|"]
    for arm in ("adamw", "dopr_adamw"):
        for t in sorted(selection["arms"][arm]["trials"], key=lambda t: float(t["setting"]["optim.lr"])):
            lines.append(f"| {arm} (committed) | {float(t['setting']['optim.lr']):g} | {t['value']:.3f} |")
    for s in sorted(tune, key=_lr):
        lines.append(f"| dopr_adamw, {args.rule} | {_lr(s):g} | {s[metric]:.3f}" + (" (chosen)" if s is chosen else "")
                     + " |")
    if not tune:
        lines.append(f"| dopr_adamw, {args.rule} | {chosen_lr:g} | chosen; the tune's runs are not on disk, its "
                     f"table is in {args.tune_source} |")
    lines += ["", "## Fresh seeds", "", "| arm | lr | seeds | " + " | ".join(METRICS) + " |",
              "|---|---|---|" + "---|" * len(METRICS)]
    committed = list(csv.DictReader(open(Path(args.committed) / "protocol.csv")))
    for row in committed:
        if row["arm"] in ("adamw", "dopr_adamw"):
            cells = [f"{float(row[m + '_median']):.3f} [{float(row[m + '_min']):.3f}-{float(row[m + '_max']):.3f}], "
                     f"mean {float(row[m + '_mean']):.3f} ± {float(row[m + '_se']):.3f}" for m in METRICS]
            lines.append(f"| {row['arm']} (committed) | {row['setting']} | {row['seeds']} | " + " | ".join(cells) + " |")
    lines.append(f"| dopr_adamw, {args.rule} | optim.lr={chosen_lr:g} | {' '.join(map(str, seeds))} | "
                 + " | ".join(_spread([s[m] for s in fresh]) for m in METRICS) + " |")
    lines += ["", "Per seed (" + args.rule + "): " + "; ".join(
        f"seed {s['seed']}: {metric} {s[metric]:.3f}, train_loss {s['train_loss']:.4f}, step {s['step_time_s']:.3f} s"
        for s in sorted(fresh, key=lambda s: s["seed"]))]
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
