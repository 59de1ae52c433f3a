"""Reports of the appendix family: moment grafting (`grafting`), the table and the paper's figure."""
from __future__ import annotations

import statistics

import matplotlib

from experiments.common.report import first_seed_panels, write_table

matplotlib.use("Agg")

MODELS = ("transformed", "grafted", "original")


def grafting(records, out_dir, stamp) -> None:
    """Per run: final validation losses and accuracies on the transformed data, the mean |gap| to the
    Transformed model's loss over training for Grafted and Original, and their ratio; per optimizer
    the median over seeds and the verdict of the appendix's claim (Grafted closer than Original in
    every seed); the figure: the three validation curves per optimizer (first seed)."""
    records = sorted(records, key=lambda r: (r["summary"]["optim"], r["summary"]["seed"]))
    rows = [{"optimizer": r["summary"]["optim"], "seed": r["summary"]["seed"], "lr": r["summary"]["lr"],
             **{f"val_loss_{m}": r["summary"][f"val_loss_{m}"] for m in MODELS},
             **{f"val_acc_{m}": r["summary"][f"val_acc_{m}"] for m in MODELS},
             "mean_gap_grafted": r["summary"]["mean_gap_grafted"],
             "mean_gap_original": r["summary"]["mean_gap_original"], "gap_ratio": r["summary"]["gap_ratio"]}
            for r in records]
    write_table(rows, list(rows[0]), out_dir / "grafting_runs", stamp,
                "Moment grafting: validation on the transformed data (final values; mean |gap| to Transformed over training)")
    by_opt = {}
    for row in rows:
        by_opt.setdefault(row["optimizer"], []).append(row)
    summary = []
    for opt, rs in sorted(by_opt.items()):
        closer = sum(r["mean_gap_grafted"] < r["mean_gap_original"] for r in rs)
        summary.append({"optimizer": opt, "seeds": len(rs),
                        "median_gap_grafted": statistics.median(r["mean_gap_grafted"] for r in rs),
                        "median_gap_original": statistics.median(r["mean_gap_original"] for r in rs),
                        "median_gap_ratio": statistics.median(r["gap_ratio"] for r in rs),
                        "median_acc_transformed": statistics.median(r["val_acc_transformed"] for r in rs),
                        "median_acc_grafted": statistics.median(r["val_acc_grafted"] for r in rs),
                        "median_acc_original": statistics.median(r["val_acc_original"] for r in rs),
                        "grafted_closer": f"{closer}/{len(rs)} seeds"})
    write_table(summary, list(summary[0]), out_dir / "grafting", stamp,
                "Moment grafting: is the Grafted model closer to the Transformed one than the Original? (median over seeds)")
    def draw(ax, name, r):
        steps = [m["step"] for m in r["metrics"]]
        for model, style in zip(MODELS, ("-", "--", ":")):
            ax.plot(steps, [m[f"val_loss_{model}"] for m in r["metrics"]], style, label=model.capitalize())
        ax.set(yscale="log", xlabel="step", ylabel="validation loss (transformed data)",
               title=f"{name}, seed {r['summary']['seed']}: gap ratio {r['summary']['gap_ratio']:.2f}")
        ax.legend()

    first_seed_panels(records, out_dir / "grafting.png", stamp, draw)
