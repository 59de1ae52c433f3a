"""Report of the image-policy family, as the paper's robomimic figures: success rate vs training
steps per optimizer (median over seeds as the line, min and max as the band), the best checkpoint's
success rate with the paper's bootstrap, the training loss, and the table behind them."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from experiments.common.report import legend, save_figure, seed_band, write_table
from experiments.common.stats import bootstrap, dopr_vs_gp, group_runs

COLUMNS = ["task", "optimizer", "seeds", "best_success_mean", "best_q10", "best_q50", "best_q90",
           "seed_best_min", "seed_best_median", "seed_best_max", "best_steps", "final_success_median",
           "train_loss_median", "val_loss_median", "lr", "weight_decay", "grad_clip_norm", "steps", "damping",
           "grad_ema", "precond_ema", "damping_mode", "adjust_lr_fn", "cholesky_retries", "step_time_s"]
RUN_COLUMNS = ["task", "optimizer", "seed", "best_success", "best_step", "final_success", "train_loss", "val_loss",
               "lr", "weight_decay", "step_time_s", "git_revision"]
DELTA_COLUMNS = ["task", "gp", "gp_best_median", "dopr_best_median", "delta", "dopr_better", "seed_ranges_overlap",
                 "gp_train_loss", "dopr_train_loss"]


def _setting(s: dict) -> tuple:
    conv = s.get("conventions", {})
    return (s["task"], s["optim"], s["lr"], s["weight_decay"], s["damping"] or 0.0, s.get("grad_ema", 0.0),
            conv.get("damping_mode", ""), conv.get("adjust_lr_fn", ""))


def rows(records) -> list:
    out = []
    for (task, name, *_), ss in group_runs((r["summary"] for r in records if r["summary"]["evals"]),
                                           _setting).items():
        pooled = [x for s in ss for x in s["best_successes"]]  # each seed's best checkpoint, its episodes
        b = bootstrap(pooled, trials=1000, seed=0) if len(pooled) > 1 else {k: float(np.mean(pooled)) for k in
                                                                              ("mean", "q10", "q50", "q90")}
        best = [s["best_success"] for s in ss]
        final = [s["success_curve"][max(s["success_curve"], key=int)] for s in ss]
        counts = [s["dopr"] for s in ss if "dopr" in s]
        conv = ss[0].get("conventions", {})
        out.append({"task": task, "optimizer": name, "seeds": len(ss), "best_success_mean": b["mean"],
                    "best_q10": b["q10"], "best_q50": b["q50"], "best_q90": b["q90"],
                    "seed_best_min": min(best), "seed_best_median": float(np.median(best)),
                    "seed_best_max": max(best), "best_steps": " ".join(str(s["best_step"]) for s in ss),
                    "final_success_median": float(np.median(final)),
                    "train_loss_median": float(np.median([s["train_loss"] for s in ss])),
                    "val_loss_median": (float(np.median([s["val_loss"] for s in ss]))
                                        if all(s["val_loss"] is not None for s in ss) else ""),
                    "lr": ss[0]["lr"], "weight_decay": ss[0]["weight_decay"],
                    "grad_clip_norm": ss[0]["grad_clip_norm"], "steps": ss[0]["steps"],
                    "damping": "" if ss[0]["damping"] is None else ss[0]["damping"],
                    **{k: "" if ss[0]["damping"] is None else ss[0][k] for k in ("grad_ema", "precond_ema")},
                    "damping_mode": conv.get("damping_mode", ""), "adjust_lr_fn": conv.get("adjust_lr_fn", ""),
                    "cholesky_retries": sum(c["cholesky_retries"] for c in counts) if counts else "",
                    "step_time_s": float(np.median([s["step_time_s"] for s in ss]))})
    return out


def per_seed(records) -> list:
    """One row per run (the numbers `rows` aggregates): its best and final success, training and validation loss,
    so that every median and range of the table recomputes from the committed files (issue 74 item 2)."""
    runs = sorted((r["summary"] for r in records if r["summary"]["evals"]),
                  key=lambda s: (s["task"], s["optim"], s.get("seed", 0)))
    return [{"task": s["task"], "optimizer": s["optim"], "seed": s.get("seed", ""), "best_success": s["best_success"],
             "best_step": s["best_step"], "final_success": s["success_curve"][max(s["success_curve"], key=int)],
             "train_loss": s["train_loss"], "val_loss": "" if s["val_loss"] is None else s["val_loss"],
             "lr": s["lr"], "weight_decay": s["weight_decay"], "step_time_s": s["step_time_s"],
             "git_revision": s.get("git_revision", "")} for s in runs]


def deltas(table: list) -> list:
    """DoPr vs its GP on each seed's best success rate (median over seeds) and the training loss."""
    out = dopr_vs_gp({(r["optimizer"], r["task"]): r for r in table}, None, "task", "seed_best_median",
                     "best_median", intervals={"seed_ranges_overlap": ("seed_best_min", "seed_best_max", "seeds")},
                     carry={"train_loss": "train_loss_median"})
    return sorted(out, key=lambda r: (r["task"], r["gp"]))


def success(records, out_dir, stamp):
    """robomimic_success.{md,csv}, robomimic_runs.{md,csv} (per seed), robomimic_deltas.{md,csv}, robomimic_success.png (best success so far
    and success vs steps, min/median/max over seeds) and robomimic_train_loss.png; returns both figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(records)
    write_table(table, COLUMNS, out_dir / "robomimic_success", stamp,
                "Best-checkpoint success rate (bootstrap over the best checkpoints' episodes, and per seed)")
    write_table(per_seed(records), RUN_COLUMNS, out_dir / "robomimic_runs", stamp,
                "Each run's best and final success rate and losses (the table's medians and ranges recompute from these)")
    write_table(deltas(table), DELTA_COLUMNS, out_dir / "robomimic_deltas", stamp,
                "DoPr vs its GP: median over seeds of the best success rate")
    by_opt = defaultdict(list)
    for r in records:
        s = r["summary"]
        if s["evals"]:
            by_opt[(s["task"], s["optim"])].append(r)
    tasks = sorted({k[0] for k in by_opt})
    colors = {n: f"C{i}" for i, n in enumerate(sorted({k[1] for k in by_opt}))}
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7.5), squeeze=False)
    for j, task in enumerate(tasks):
        for (t, name), rs in sorted(by_opt.items()):
            if t != task:
                continue
            curves = [{int(k): v for k, v in r["summary"]["success_curve"].items()} for r in rs]
            best_so_far = [dict(zip(sorted(c), np.maximum.accumulate([c[k] for k in sorted(c)]))) for c in curves]
            seed_band(axes[0, j], best_so_far, f"{name} ({len(rs)} seeds)", colors[name])
            seed_band(axes[1, j], curves, name, colors[name])
        axes[0, j].set(title=f"{task}: best success rate so far", xlabel="training step", ylabel="success rate")
        axes[1, j].set(title=f"{task}: success rate at each checkpoint", xlabel="training step",
                       ylabel="success rate")
        legend(axes[0, j], fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    success_fig = save_figure(fig, out_dir / "robomimic_success.png", stamp)

    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 4.5), squeeze=False)
    for j, task in enumerate(tasks):
        for (t, name), rs in sorted(by_opt.items()):
            if t == task:
                curves = [{m["step"]: m["train_loss"] for m in r["metrics"] if "train_loss" in m} for r in rs]
                seed_band(axes[0, j], curves, name, colors[name])
        axes[0, j].set(title=f"{task}: training loss (min/median/max over seeds)", xlabel="training step",
                       ylabel="flow loss", yscale="log")
        legend(axes[0, j], fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return success_fig, save_figure(fig, out_dir / "robomimic_train_loss.png", stamp)
