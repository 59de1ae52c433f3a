"""Reports of the appendix family: moment grafting (`grafting`), the table and the paper's figure."""
from __future__ import annotations

import math
import statistics
from collections import Counter

import matplotlib

from experiments.common.report import write_table

matplotlib.use("Agg")

#: each reading of experiments/appendix/grafting.py's `evaluate`: (its role, the model, maps and images it scores);
#: the verdict follows the paper's reading, the others are labelled as what they are
READING = {"transformed": ("reference", "Transformed, transformed images"),
           "grafted_on_transformed": ("paper's reading", "Grafted, maps on, transformed images"),
           "grafted_on_original": ("in-distribution scoring", "Grafted, maps on, original images"),
           "grafted_off": ("maps off", "Grafted, maps off, transformed images"),
           "original": ("baseline", "Original, transformed images"),
           "original_on_original": ("in-distribution control", "Original, original images"),
           "original_maps_on_transformed": ("maps' control", "Original, the same maps on, transformed images")}
#: the keys of runs made before the paper's reading was scored: their "maps on" fed the original images
OLD_KEYS = {"gap_ratio_on": "gap_ratio_grafted_on_original", "gap_ratio_off": "gap_ratio_grafted_off"}


def upgraded(values: dict) -> dict:
    """A run's summary or metrics row with the keys of the earlier two-reading runs renamed to what they
    score (`..._grafted_on` -> `..._grafted_on_original`, `OLD_KEYS`); newer keys pass unchanged."""
    out = {}
    for k, v in values.items():
        new = OLD_KEYS.get(k, k + "_original" if k.endswith("_grafted_on") else k)
        out[new if new not in values else k] = v
    return out


def spread(values) -> str:
    """median [min, max] of a sample, for the tables."""
    v = sorted(values)
    return f"{statistics.median(v):.4g} [{v[0]:.4g}, {v[-1]:.4g}]"


def graft_verdict(gap_grafted: list, gap_original: list) -> str:
    """The appendix's claim, Grafted's validation loss closer to Transformed's than Original's, judged
    against the seed spread: reproduced when every seed's mean gap of Grafted lies below every seed's
    gap of Original, not reproduced when every one lies above, inconclusive when the ranges overlap."""
    if max(gap_grafted) < min(gap_original):
        return "reproduced"
    if min(gap_grafted) > max(gap_original):
        return "not reproduced"
    return "inconclusive"


def grafting(records, out_dir, stamp) -> None:
    """Per run: final validation losses and accuracies of each reading (`READING`), and the mean |gap| of
    its loss to the Transformed model's over training; per optimizer and reading the median [min, max]
    over seeds of the gap and accuracy, how many seeds' gaps lie below Original's, and the verdict
    (`graft_verdict`) of the paper's reading; the figure: every reading's validation curve per
    optimizer, median over seeds with the min-max band. Runs made before the paper's reading was
    scored are read with their keys renamed (`upgraded`) and tabled with the readings they have."""
    import matplotlib.pyplot as plt

    from experiments.common.report import save_figure, seed_band

    records = sorted(records, key=lambda r: (r["summary"]["optim"], r["summary"]["seed"]))
    missing = [str(r.get("dir", "?")) for r in records
               if not {"val_loss_grafted_on", "val_loss_grafted_on_original"} & set(r["summary"])]
    if missing:
        raise ValueError(f"grafting report: {len(missing)} run(s) predate the two readings (no val_loss_grafted_on), "
                         f"e.g. {missing[0]}: rerun them")
    records = [{**r, "summary": upgraded(r["summary"]), "metrics": [upgraded(x) for x in r["metrics"]]} for r in records]
    # the readings every run scored (runs before the paper's reading lack it and the control)
    readings = [m for m in READING if all(f"val_loss_{m}" in r["summary"] for r in records)]
    gapped = readings[1:]
    rows = [{"optimizer": r["summary"]["optim"], "seed": r["summary"]["seed"], "lr": r["summary"]["lr"],
             "parameterization": r["summary"]["parameterization"], "batch": r["summary"]["batch"],
             "steps": r["summary"]["steps"],
             **{f"val_loss_{m}": r["summary"][f"val_loss_{m}"] for m in readings},
             **{f"val_acc_{m}": r["summary"][f"val_acc_{m}"] for m in readings},
             **{f"mean_gap_{m}": r["summary"][f"mean_gap_{m}"] for m in gapped}}
            for r in records]
    write_table(rows, list(rows[0]), out_dir / "grafting_runs", stamp,
                "Moment grafting: validation losses and accuracies (final values) and the mean |gap| of each "
                "reading's loss to Transformed's on the transformed images over training; readings: "
                + "; ".join(f"{m}: {READING[m][1]}" for m in readings))
    by_opt = {}
    for row in rows:
        by_opt.setdefault(row["optimizer"], []).append(row)
    summary = []
    for opt, rs in sorted(by_opt.items()):
        original = [r["mean_gap_original"] for r in rs]
        for m in gapped:
            gaps = [r[f"mean_gap_{m}"] for r in rs]
            summary.append({"optimizer": opt, "reading": READING[m][0], "scores": READING[m][1], "seeds": len(rs),
                            "gap_to_transformed": spread(gaps), "accuracy": spread(r[f"val_acc_{m}"] for r in rs),
                            "acc_transformed": spread(r["val_acc_transformed"] for r in rs),
                            "closer_than_original": "" if m == "original" else
                            f"{sum(g < o for g, o in zip(gaps, original))}/{len(rs)} seeds",
                            "verdict": graft_verdict(gaps, original) if m == "grafted_on_transformed" else ""})
    write_table(summary, list(summary[0]), out_dir / "grafting", stamp,
                "Moment grafting: is the Grafted model closer to the Transformed one than the Original? Mean |gap| of "
                "each reading's validation loss to Transformed's (on the transformed images) over training and final "
                "accuracy, median [min, max] over seeds; verdict (the paper's reading only): beyond the seed spread "
                "(reproduced / not reproduced) or not (inconclusive)")
    optimizers = sorted(by_opt)
    fig, axes = plt.subplots(1, len(optimizers), figsize=(5 * len(optimizers), 4), squeeze=False)
    for ax, opt in zip(axes[0], optimizers):
        runs = [r for r in records if r["summary"]["optim"] == opt]
        for i, m in enumerate(readings):
            seed_band(ax, [{x["step"]: x[f"val_loss_{m}"] for x in r["metrics"]} for r in runs], READING[m][1], f"C{i}")
        ax.set(yscale="log", xlabel="step", ylabel="validation loss",
               title=f"{opt}: median, min-max over {len(runs)} seeds")
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, out_dir / "grafting.png", stamp)


def best_multiplier_shift(rows: list) -> dict:
    """The metric that decides "transfer": per (optimizer, parameterisation), the multiplier log2 k with
    the lowest final training loss (median over seeds) at each width, and how far it moves across
    the widths (max - min, in factors of 2). A non-finite loss never wins. Beside it: `edge`, the
    widths whose best k is the smallest or largest k tried there (the grid is too narrow to place
    the optimum, so the shift is a lower bound), and `regret`, the widest width's loss at the
    narrowest width's best k over its own best loss (1.0: tuning the narrow model transfers exactly)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["optimizer"], r["parameterization"], r["width"], r["k"]), []).append(r["train_loss"])
    loss_at: dict = {}
    for key, losses in cells.items():
        finite = [v for v in losses if v == v and v != float("inf")]
        loss_at[key] = statistics.median(finite) if len(finite) == len(losses) else float("inf")
    grid: dict = {}
    for (opt, par, width, k) in loss_at:
        grid.setdefault((opt, par), {}).setdefault(width, []).append(k)
    out: dict = {}
    for (opt, par), widths in sorted(grid.items()):
        best = {w: min(sorted(ks), key=lambda k: loss_at[(opt, par, w, k)]) for w, ks in sorted(widths.items())}
        narrow, wide = min(best), max(best)
        wide_best = loss_at[(opt, par, wide, best[wide])]
        at_narrow = loss_at.get((opt, par, wide, best[narrow]), float("inf"))
        out[(opt, par)] = {"best_k": best, "shift": max(best.values()) - min(best.values()),
                           "edge": [w for w, k in best.items() if k in (min(widths[w]), max(widths[w]))],
                           "regret": at_narrow / wide_best if wide_best > 0 else float("nan")}
    return out


MUP_ROW = ("optimizer", "parameterization", "weight_decay_scaling", "width", "k", "lr", "seed", "train_loss")


def mup_rows(records) -> list:
    """One row per width-sweep run: what `mup_runs.csv` holds."""
    return [{"optimizer": r["summary"]["optim"], "parameterization": r["summary"]["parameterization"],
             "weight_decay_scaling": r["summary"]["weight_decay_scaling"], "width": r["summary"]["width"],
             "k": r["summary"]["multiplier_log2"], "lr": r["summary"]["lr"], "seed": r["summary"]["seed"],
             "train_loss": r["summary"]["train_loss"]} for r in records]


def read_mup_rows(csv_path, where: dict) -> list:
    """The rows of a committed `mup_runs.csv` whose columns equal `where` (e.g. {"parameterization":
    "mup"}): the half of a sweep that a re-run left unchanged, kept beside the re-run half."""
    import csv

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in (*MUP_ROW, *where) if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"{csv_path} has no column(s) {missing}: not a mup_runs.csv")
    kept = [r for r in rows if all(r[c] == v for c, v in where.items())]
    if not kept:
        raise ValueError(f"no row of {csv_path} has {where}")
    return [{"optimizer": r["optimizer"], "parameterization": r["parameterization"],
             "weight_decay_scaling": r["weight_decay_scaling"], "width": int(r["width"]), "k": float(r["k"]),
             "lr": float(r["lr"]), "seed": int(r["seed"]), "train_loss": float(r["train_loss"])} for r in kept]


def mup(records, out_dir, stamp, kept_rows=()) -> None:
    """The width sweep: per run its final training loss (mean over the last epoch); per optimizer and
    parameterisation the best multiplier per width and its shift across widths (the transfer metric);
    the paper's figure: training loss vs multiplier, one curve per width, SP beside muP, one row per
    optimizer; and, where the sweep varies the weight-decay scaling, the hidden layer's
    update-to-weight ratio over training. `kept_rows`: rows of an earlier `mup_runs.csv`
    (`read_mup_rows`) reported beside the runs (a cell in both is refused)."""
    import matplotlib.pyplot as plt

    from experiments.common.report import save_figure

    rows = sorted([*mup_rows(records), *kept_rows],
                  key=lambda r: (r["optimizer"], r["parameterization"], r["width"], r["k"], r["seed"]))
    clash = {key for key, n in Counter((r["optimizer"], r["parameterization"], r["weight_decay_scaling"], r["width"],
                                        r["k"], r["seed"]) for r in rows).items() if n > 1}
    if clash:
        raise ValueError(f"the kept rows and the runs both hold {sorted(clash)[:3]}: keep one source per cell")
    write_table(rows, list(rows[0]), out_dir / "mup_runs", stamp,
                "muP width sweep: final training loss (mean over the last epoch) per run")
    widths = sorted({r["width"] for r in rows})
    cmap = plt.get_cmap("viridis")
    if len({r["k"] for r in rows}) > 1:
        shifts = best_multiplier_shift(rows)
        summary = [{"optimizer": opt, "parameterization": par,
                    **{f"best_k_w{w}": k for w, k in v["best_k"].items()}, "shift_log2": v["shift"],
                    "regret": v["regret"],
                    "grid_edge": ("widths " + ", ".join(map(str, v["edge"])) + ": widen the grid") if v["edge"] else ""}
                   for (opt, par), v in shifts.items()]
        columns = ["optimizer", "parameterization"] + sorted({c for s in summary for c in s if c.startswith("best_k")},
                                                             key=lambda c: int(c[8:])) + ["shift_log2", "regret", "grid_edge"]
        write_table(summary, columns, out_dir / "mup_transfer", stamp,
                    "muP transfer: the best learning-rate multiplier log2 k per width, how far it moves (shift), and the "
                    "widest width's loss at the narrowest width's best k over its best loss (regret)")
        optimizers = sorted({r["optimizer"] for r in rows})
        pars = [p for p in ("sp", "mup") if any(r["parameterization"] == p for r in rows)]
        fig, axes = plt.subplots(len(optimizers), len(pars), figsize=(5 * len(pars), 3.6 * len(optimizers)), squeeze=False)
        for i, opt in enumerate(optimizers):
            for j, par in enumerate(pars):
                ax = axes[i][j]
                for c, w in enumerate(widths):
                    pts: dict = {}
                    for r in rows:
                        if (r["optimizer"], r["parameterization"], r["width"]) == (opt, par, w):
                            pts.setdefault(r["k"], []).append(r["train_loss"])
                    ks = sorted(pts)
                    ax.plot(ks, [statistics.median(pts[k]) for k in ks], "o-", ms=3,
                            color=cmap(c / max(1, len(widths) - 1)), label=f"width {w}")
                ax.set(yscale="log", xlabel="log2 learning-rate multiplier k", ylabel="final training loss",
                       title=f"{opt}, {'muP' if par == 'mup' else 'SP'}")
                ax.legend(fontsize=7)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        save_figure(fig, out_dir / "mup_lr_sweep.png", stamp)
    # the weight-decay panel: one parameterisation run with several decay rules (a width sweep has SP
    # at "constant" beside muP at "mup": that is not this panel)
    scalings: dict = {}
    for r in records:
        scalings.setdefault(r["summary"]["parameterization"], set()).add(r["summary"]["weight_decay_scaling"])
    if any(len(v) > 1 for v in scalings.values()):
        ratio_rows = []
        for r in sorted(records, key=lambda r: (r["summary"]["optim"], r["summary"]["weight_decay_scaling"],
                                                r["summary"]["width"], r["summary"]["seed"])):
            s = r["summary"]
            curve = list(s["update_ratio_curve"].values())
            tail = curve[-max(1, len(curve) // 10):]
            ratio_rows.append({"optimizer": s["optim"], "weight_decay_scaling": s["weight_decay_scaling"],
                               "width": s["width"], "seed": s["seed"], "train_loss": s["train_loss"],
                               "final_update_ratio": statistics.mean(tail)})
        write_table(ratio_rows, list(ratio_rows[0]), out_dir / "mup_update_ratio", stamp,
                    "Weight-decay scaling: the hidden layer's ||dW||_F / ||W||_F, mean over the last 10% of steps")
        spread = []
        for opt in sorted({r["optimizer"] for r in ratio_rows}):
            for scaling in sorted({r["weight_decay_scaling"] for r in ratio_rows}):
                by_w = {}
                for r in ratio_rows:
                    if (r["optimizer"], r["weight_decay_scaling"]) == (opt, scaling):
                        by_w.setdefault(r["width"], []).append(r["final_update_ratio"])
                if by_w:
                    med = {w: statistics.median(v) for w, v in sorted(by_w.items())}
                    spread.append({"optimizer": opt, "weight_decay_scaling": scaling,
                                   **{f"ratio_w{w}": v for w, v in med.items()},
                                   "widest_over_narrowest": med[max(med)] / med[min(med)]})
        write_table(spread, list(dict.fromkeys(c for row in spread for c in row)), out_dir / "mup_update_ratio_width",
                    stamp, "Weight-decay scaling: final update-to-weight ratio per width (median over seeds) and "
                    "the widest width's over the narrowest's (1: width-independent)")
        ratio_opts = sorted({r["optimizer"] for r in ratio_rows})
        fig, axes = plt.subplots(1, len(ratio_opts), figsize=(6 * len(ratio_opts), 4), squeeze=False)
        for ax, opt in zip(axes[0], ratio_opts):
            for r in sorted(records, key=lambda r: (r["summary"]["weight_decay_scaling"] != "mup", r["summary"]["width"])):
                s = r["summary"]
                if s["optim"] != opt:
                    continue
                curve = s["update_ratio_curve"]
                ax.plot([int(k) for k in curve], list(curve.values()), lw=0.8,
                        color=cmap(widths.index(s["width"]) / max(1, len(widths) - 1)),
                        ls="-" if s["weight_decay_scaling"] == "mup" else "--",
                        label=f"w={s['width']}, decay {'x w (muP)' if s['weight_decay_scaling'] == 'mup' else 'constant'}")
            ax.set(yscale="log", xlabel="step", ylabel="||dW||_F / ||W||_F (hidden layer)", title=opt)
            ax.legend(fontsize=6)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        save_figure(fig, out_dir / "mup_update_ratio.png", stamp)


def ap_variant(summary: dict) -> str:
    """The AP variant of a conv_digits run, read from the routing the optimizer built: none (the GP
    alone), full (im2col, Cholesky), sua or rank1_diag."""
    route = summary.get("ap_routing") or {}
    if not route:
        return "none"
    if any(m.startswith("conv2d-sua") for m in route["layers"].values()):
        return "sua" if route["solver"] == "cholesky" else f"sua+{route['solver']}"
    return "full" if route["solver"] == "cholesky" else route["solver"]


def conv(records, out_dir, stamp) -> None:
    """conv_digits (experiments/appendix/conv.py): per run the final validation loss and accuracy; per arm
    (optimizer, AP variant, rate, dropout) the median [min, max] over seeds."""
    rows = [{"optimizer": r["summary"]["optim"], "ap": ap_variant(r["summary"]), "lr": r["summary"]["lr"],
             "dropout": r["summary"]["dropout"], "seed": r["summary"]["seed"],
             **{k: r["summary"][k] for k in ("val_loss", "val_accuracy", "train_loss", "diverged_at")}}
            for r in sorted(records, key=lambda r: (r["summary"]["optim"], ap_variant(r["summary"]),
                                                    r["summary"]["lr"], r["summary"]["dropout"], r["summary"]["seed"]))]
    write_table(rows, list(rows[0]), out_dir / "conv_runs", stamp,
                "conv_digits: final validation loss and accuracy per run (ap: the AP variant the optimizer built)")
    arms = {}
    for row in rows:
        arms.setdefault(tuple(row[k] for k in ("optimizer", "ap", "lr", "dropout")), []).append(row)
    worst = lambda v: math.inf if v is None else v   # a diverged run has no loss: the worst
    summary = [{"optimizer": o, "ap": a, "lr": lr, "dropout": d, "seeds": " ".join(str(r["seed"]) for r in rs),
                "val_loss": spread(worst(r["val_loss"]) for r in rs),
                "val_accuracy": spread(r["val_accuracy"] or 0.0 for r in rs)}
               for (o, a, lr, d), rs in arms.items()]
    write_table(summary, list(summary[0]), out_dir / "conv", stamp,
                "conv_digits per arm: median [min, max] over seeds of the final validation loss and accuracy")
    changes = dropout_changes(rows)
    if changes:
        write_table(changes, list(changes[0]), out_dir / "dropout", stamp,
                    "conv_digits, dropout: per optimizer, the change of the final validation loss and accuracy that "
                    "dropout makes on each seed (with minus without, same seed and rate), median [min, max] over seeds")


def dropout_changes(rows: list) -> list:
    """Per (optimizer, AP variant, rate) and dropout rate p > 0: the per-seed change of the validation loss and
    accuracy from dropout 0 to p (paired by seed), as median [min, max]; [] without such pairs."""
    by = {(r["optimizer"], r["ap"], r["lr"], r["dropout"], r["seed"]): r for r in rows}
    out = []
    for o, a, lr, p in sorted({k[:4] for k in by if k[3] > 0}):
        seeds = sorted(k[4] for k in by if k[:4] == (o, a, lr, p) and (o, a, lr, 0.0, k[4]) in by)
        if not seeds:
            continue
        pairs = [(by[(o, a, lr, 0.0, s)], by[(o, a, lr, p, s)]) for s in seeds]
        loss = [(d["val_loss"] if d["val_loss"] is not None else math.inf) - n["val_loss"] for n, d in pairs]
        acc = [(d["val_accuracy"] or 0.0) - n["val_accuracy"] for n, d in pairs]
        out.append({"optimizer": o, "ap": a, "lr": lr, "dropout": p, "seeds": " ".join(map(str, seeds)),
                    "val_loss_change": spread(loss), "val_accuracy_change": spread(acc),
                    "val_loss_without": spread(n["val_loss"] for n, _ in pairs),
                    "val_loss_with": spread(d["val_loss"] if d["val_loss"] is not None else math.inf for _, d in pairs)})
    return out


def main(argv=None) -> None:
    """`python -m experiments.appendix.report <width-sweep dirs> --keep <mup_runs.csv> --keep-where
    parameterization=mup --out <dir>`: the width-sweep report over re-run jobs plus the unchanged rows
    of a committed table (when only one half of a sweep had to be re-run)."""
    import argparse
    import shlex
    import sys
    from pathlib import Path

    from experiments.common.report import in_repo, load_records, make_stamp, output_root

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("sweeps", nargs="+", help="width-sweep (multirun) directories")
    ap.add_argument("--keep", required=True, type=Path, help="a committed mup_runs.csv")
    ap.add_argument("--keep-where", action="append", default=[], metavar="COLUMN=VALUE",
                    help="keep only the rows with this value (repeatable), e.g. parameterization=mup")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replace-results", action="store_true", help="allow --out results/... (committed tables)")
    args = ap.parse_args(argv)
    where = {}
    for item in args.keep_where:
        column, sep, value = item.partition("=")
        if not sep or not column:
            ap.error(f"--keep-where {item!r}: expected COLUMN=VALUE")
        where[column] = value
    if not args.keep.is_file():
        ap.error(f"--keep {args.keep}: no such file")
    kept = read_mup_rows(args.keep, where)
    records = load_records(args.sweeps)
    if not records:
        raise SystemExit(f"no finished job (summary.json) under {args.sweeps}")
    out = output_root(args.out, args.sweeps, records, args.replace_results)
    command = "python -m experiments.appendix.report " + " ".join(
        shlex.quote(in_repo(a)) for a in (argv if argv is not None else sys.argv[1:]))
    condition = ", ".join(f"{c} = {v}" for c, v in where.items()) or "all rows"
    earlier = args.keep.with_suffix(".md")
    origin = next((line.split(" Tables by ")[0] for line in earlier.read_text().splitlines()
                   if line.startswith("Runs made by ")), "") if earlier.is_file() else ""
    stamp = make_stamp(records, command) + (f" Beside them {len(kept)} rows kept from `{in_repo(str(args.keep))}` "
                                             f"({condition}){'; earlier r' + origin[1:].rstrip('.') if origin else ''}.")
    out.mkdir(parents=True, exist_ok=True)
    mup(records, out, stamp, kept_rows=kept)  # `kept` was read before anything is written: --out may be its folder
    print(f"{len(records)} runs + {len(kept)} kept rows -> {out}")


if __name__ == "__main__":
    main()
