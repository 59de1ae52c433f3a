"""Report of the SiT family, as the paper's figures ``sit_imagenet256*``: sample quality (FID, or the
analogue's FD-digits) vs training steps per optimizer and the training loss beside it (median over
seeds as the line, min and max as the band), the sample grids at an early step side by side, and the
table behind them with the DoPr-vs-GP verdict."""
from __future__ import annotations

import math
import shutil
from collections import defaultdict

import numpy as np

from dopr import optimizer_name, split_name
from experiments.common.report import legend, save_figure, seed_band, tidy_log_axis, write_table
from experiments.common.stats import dopr_vs_gp, group_runs

COLUMNS = ["task", "optimizer", "seeds", "metric", "final_min", "final_median", "final_max", "best_median",
           "diverged", "label_accuracy_median", "train_loss_median", "lr", "steps", "batch_size", "damping", "warmup_steps",
           "damping_mode", "adjust_lr_fn", "cholesky_retries", "step_time_s"]
DELTA_COLUMNS = ["task", "gp", "metric", "gp_final_median", "dopr_final_median", "delta", "dopr_better",
                 "seed_ranges_overlap", "gp_train_loss", "dopr_train_loss", "dopr_lower_loss"]


def _setting(s: dict) -> tuple:
    conv = s.get("conventions", {})
    return (s["task"], s["optim"], s["lr"], s["damping"] or 0.0, s.get("warmup_steps") or 0,
            conv.get("damping_mode", ""), conv.get("adjust_lr_fn", ""))


def _worst(quality) -> float:
    """A run that diverged before (the last) evaluation has no quality: the worst, +inf (lower is better)."""
    return math.inf if quality is None else float(quality)


def panel_title(settings) -> str:
    """The quality panel's title names the optimizers it shows: "adamw vs dopr_adamw" for a pair, the one
    name for a single-arm sweep (a tuning sweep of the GP alone is not a comparison)."""
    names = sorted({name for name, _ in settings}, key=lambda n: (split_name(n)[1], n))
    return " vs ".join(names) + ": sample quality"


def _evaluated(s: dict) -> bool:
    """A run the quality table holds: one with a sample-quality curve, or one that diverged (the worst)."""
    return bool(s.get("quality_curve")) or s.get("diverged_at") is not None


def rows(records) -> list:
    out = []
    for (task, name, *_), ss in group_runs((r["summary"] for r in records if _evaluated(r["summary"])),
                                           _setting).items():
        final = [_worst(s["quality"]) for s in ss]
        acc = [s["label_accuracy"] for s in ss if s.get("label_accuracy") is not None]
        counts = [s["dopr"] for s in ss if "dopr" in s]
        conv = ss[0].get("conventions", {})
        out.append({"task": task, "optimizer": name, "seeds": len(ss), "metric": ss[0]["quality_metric"],
                    "final_min": min(final), "final_median": float(np.median(final)), "final_max": max(final),
                    "best_median": float(np.median([_worst(s["best_quality"]) for s in ss])),
                    "diverged": sum(1 for s in ss if s.get("diverged_at") is not None),
                    "label_accuracy_median": float(np.median(acc)) if acc else "",
                    "train_loss_median": float(np.median([s["train_loss"] for s in ss])),
                    "lr": ss[0]["lr"], "steps": ss[0]["steps"], "batch_size": ss[0]["batch_size"],
                    "damping": "" if ss[0]["damping"] is None else ss[0]["damping"],
                    "warmup_steps": "" if ss[0].get("warmup_steps") is None else ss[0]["warmup_steps"],
                    "damping_mode": conv.get("damping_mode", ""), "adjust_lr_fn": conv.get("adjust_lr_fn", ""),
                    "cholesky_retries": sum(c["cholesky_retries"] for c in counts) if counts else "",
                    "step_time_s": float(np.median([s["step_time_s"] for s in ss]))})
    return out


def deltas(table: list) -> list:
    """DoPr vs its GP on the final quality (lower is better) and the final training loss."""
    out = dopr_vs_gp({(r["optimizer"], r["task"]): r for r in table}, None, "task", "final_median", "final_median",
                     intervals={"seed_ranges_overlap": ("final_min", "final_max", "seeds")},
                     carry={"train_loss": "train_loss_median"}, lower_is_better=True)
    for r in out:
        r.update(metric=next(t["metric"] for t in table if t["task"] == r["task"]),
                 dopr_lower_loss="yes" if r["dopr_train_loss"] < r["gp_train_loss"] else "no")
    return sorted(out, key=lambda r: (r["task"], r["gp"]))


UNEVALUATED_COLUMNS = ["task", "optimizer", "seeds", "lr", "steps", "train_loss_median", "why"]


def unevaluated_rows(records) -> list:
    """Finished runs without a sample-quality curve that did not diverge (sample quality off:
    task.fid.every=0 or no classifier): their training loss, and why they have no quality."""
    out = []
    for (task, name, lr), ss in group_runs((r["summary"] for r in records if not _evaluated(r["summary"])),
                                           lambda s: (s["task"], s["optim"], s["lr"])).items():
        losses = [s["train_loss"] for s in ss if s.get("train_loss") is not None]
        out.append({"task": task, "optimizer": name, "seeds": len(ss), "lr": lr, "steps": ss[0].get("steps", ""),
                    "train_loss_median": float(np.median(losses)) if losses else "",
                    "why": "no sample-quality evaluation in the run"})
    return out


def _quality_curve(s: dict) -> dict:
    """{step: quality}; a diverged run's ends in NaN at the step it diverged (drawn as an 'x')."""
    curve = {int(k): v for k, v in (s.get("quality_curve") or {}).items()}
    if s.get("diverged_at") is not None:
        curve[int(s["diverged_at"])] = math.nan
    return curve


def quality(records, out_dir, stamp):
    """sit_quality.{md,csv}, sit_deltas.{md,csv}, sit_quality.png (quality vs steps over loss vs steps,
    one column per GP pair, as the paper's figure) and sit_samples.png (each optimizer's grid, seed 0,
    at the earliest step with a grid). Rehearsals (rehearse=true) get the rehearsal table instead, runs
    without sample quality a table of their training loss (sit_unevaluated). Returns the quality figure
    (None where no run has a quality curve)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    rehearsals = [r for r in records if r["summary"].get("rehearsal")]
    if rehearsals:
        from experiments.common.rehearsal import report as rehearsal_report

        rehearsal_report(rehearsals, out_dir, stamp)
        records = [r for r in records if not r["summary"].get("rehearsal")]
    other = unevaluated_rows(records)
    if other:
        write_table(other, UNEVALUATED_COLUMNS, out_dir / "sit_unevaluated", stamp,
                    "Runs without sample quality (none measured, none diverged): training loss only")
    table = rows(records)
    if not table:
        return None
    metric = table[0]["metric"] if table else "quality"
    write_table(table, COLUMNS, out_dir / "sit_quality", stamp,
                f"Sample quality ({metric}, lower is better) at the last step, min/median/max over seeds")
    names = [r["optimizer"] for r in table]
    if len(names) == len(set(names)):   # one setting per optimizer: DoPr vs its GP is well defined
        write_table(deltas(table), DELTA_COLUMNS, out_dir / "sit_deltas", stamp,
                    f"DoPr vs its GP: median over seeds of the final {metric} and training loss")
    # several settings of one optimizer (a protocol sweep: DoPr at its own and at the GP's rate): no
    # deltas table (the protocol's report pairs the chosen settings); one band per setting in the figure
    by_opt = defaultdict(list)
    for r in records:
        if _evaluated(r["summary"]):
            by_opt[(r["summary"]["optim"], r["summary"]["lr"])].append(r)
    gps = sorted({split_name(n)[0] for n, _ in by_opt})
    fig, axes = plt.subplots(2, len(gps), figsize=(5.5 * len(gps), 7.5), squeeze=False, sharex="col")
    for j, gp in enumerate(gps):
        settings = sorted(key for key in by_opt if key[0] in (gp, optimizer_name(gp, True)))
        several = len(settings) > len({name for name, _ in settings})
        for k, (name, lr) in enumerate(settings):
            rs = by_opt[(name, lr)]
            color, label = f"C{k}", f"{name}, lr {lr:g}" if several else name
            seed_band(axes[0, j], [_quality_curve(r["summary"]) for r in rs],
                      f"{label} ({len(rs)} seed{'s' if len(rs) != 1 else ''})", color)
            seed_band(axes[1, j], [{m["step"]: m["train_loss"] for m in r["metrics"] if "train_loss" in m} for r in rs],
                      label, color)
        axes[0, j].set(title=panel_title(settings), xlabel="training step", ylabel=metric,
                       yscale="log")
        axes[1, j].set(title="training loss (min/median/max over seeds)", xlabel="training step",
                       ylabel="velocity loss", yscale="log")
        legend(axes[0, j], fontsize=8)
        if getattr(axes[1, j], "_dopr_diverged_marked", False):
            legend(axes[1, j], fontsize=8)
        axes[0, j].tick_params(labelbottom=True)
        for i in (0, 1):
            tidy_log_axis(axes[i, j])
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    quality_fig = save_figure(fig, out_dir / "sit_quality.png", stamp)

    grids = {}
    for (name, lr), rs in sorted(by_opt.items()):
        r = min(rs, key=lambda r: r["summary"]["seed"])
        lrs = {l for n, l in by_opt if n == name}
        name = f"{name}_lr{lr:g}" if len(lrs) > 1 else name
        found = sorted(r["dir"].glob("samples_step*.png"), key=lambda p: int(p.stem.removeprefix("samples_step")))
        if found:
            grids[name] = found[0]
    if not grids:   # the committed sweeps' grids are kept out of git (runs/MANIFEST.csv lists them)
        print("sit report: no samples_step*.png in the job folders, sit_samples.png not drawn; the committed "
              "sweeps' grids are listed in runs/MANIFEST.csv")
    if grids:
        fig, axes = plt.subplots(1, len(grids), figsize=(3.2 * len(grids), 3.9), squeeze=False)
        for ax, (name, path) in zip(axes[0], grids.items()):
            ax.imshow(mpimg.imread(path))
            ax.set_title(f"{name}\n{path.stem.removeprefix('samples_')}", fontsize=9)
            ax.axis("off")
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        save_figure(fig, out_dir / "sit_samples.png", stamp)
        for name, path in grids.items():
            shutil.copyfile(path, out_dir / f"sit_samples_{name}.png")
    return quality_fig
