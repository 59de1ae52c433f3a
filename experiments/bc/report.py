"""Reports of the behaviour-cloning family: the paper's BC figure and tables (`bc`), and the
experts' returns table (`expert`)."""
from __future__ import annotations

import numpy as np

import dopr.gp
from dopr import optimizer_name
from experiments.common.report import (count_axis, legend, optimizers_title, points_with_divergence, save_figure,
                                       write_table)
from experiments.common.stats import best_per, bootstrap, dopr_vs_gp, group_runs

GPS = tuple(g for g in dopr.gp.GPS if g != "sgd")   # the figures' columns, of those that ran
TABLE_COLUMNS = ["optimizer", "num_trajectories", "seeds", "episodes", "return_mean", "return_q10", "return_q50",
                 "return_q90", "seed_return_min", "seed_return_median", "seed_return_max", "train_loss", "val_loss",
                 "lr", "weight_decay", "damping", "grad_ema", "precond_ema",
                 "damping_mode", "adjust_lr_fn", "input_layer", "cholesky_retries",
                 "eigh_fallbacks", "expert_return"]
DELTA_COLUMNS = ["gp", "num_trajectories", "gp_return", "dopr_return", "delta", "delta_pct", "dopr_better",
                 "quantile_bands_overlap", "seed_ranges_overlap", "gp_val_loss", "dopr_val_loss", "gp_lr", "dopr_lr"]


def _setting(s: dict) -> tuple:
    """One cell per optimizer, trajectory count, hyperparameter setting and convention (summaries written
    before the EMA rates and conventions were recorded have none: EMA 0, conventions "")."""
    conv = s.get("conventions", {})
    return (s["optim"], s["num_trajectories"], s["lr"], s["weight_decay"], s["damping"] or 0.0,
            s.get("grad_ema", 0.0), s.get("precond_ema", 0.0),
            *(conv.get(k, "") for k in ("damping_mode", "adjust_lr_fn", "input_layer")))


def cell_rows(records) -> list:
    rows = []
    for (opt_name, n, *_), ss in group_runs((r["summary"] for r in records), _setting).items():
        pooled = [x for s in ss for v in s["returns"].values() for x in v]  # seeds x checkpoints x episodes
        b = bootstrap(pooled, trials=1000, seed=0)
        per_seed = [np.mean([x for v in s["returns"].values() for x in v]) for s in ss]  # the spread the pool hides
        conv = ss[0].get("conventions", {})  # summaries before the conventions were recorded have none
        dopr_counts = [s["dopr"] for s in ss if "dopr" in s]
        rows.append({"optimizer": opt_name, "num_trajectories": n, "seeds": len(ss), "episodes": len(pooled),
                     "return_mean": b["mean"], "return_q10": b["q10"], "return_q50": b["q50"], "return_q90": b["q90"],
                     "seed_return_min": float(np.min(per_seed)), "seed_return_median": float(np.median(per_seed)),
                     "seed_return_max": float(np.max(per_seed)),
                     "train_loss": float(np.mean([s["train_loss"] for s in ss])),
                     "val_loss": float(np.mean([s["val_loss"] for s in ss])),
                     "lr": ss[0]["lr"], "weight_decay": ss[0]["weight_decay"],
                     "damping": "" if ss[0]["damping"] is None else ss[0]["damping"],
                     **{k: "" if ss[0]["damping"] is None else ss[0].get(k, 0.0) for k in ("grad_ema", "precond_ema")},
                     **{k: conv.get(k, "") for k in ("damping_mode", "adjust_lr_fn", "input_layer")},
                     **{k: sum(c[k] for c in dopr_counts) if dopr_counts else "" for k in ("cholesky_retries",
                                                                                          "eigh_fallbacks")},
                     "expert_return": ss[0]["expert_return"]})
    return rows


def bc(records, out_dir, stamp) -> None:
    """The paper's BC figure (return vs number of trajectories per GP, plain vs DoPr: the median, min
    and max over seeds of each seed's mean return as line and band, the bootstrap 10/50/90 quantiles as
    error bars beside them; train and validation loss), the table behind it, DoPr-vs-GP deltas and
    timings. Returns the figure."""
    task = records[0]["summary"]["task"]
    env = records[0]["summary"]["env"]
    rows = cell_rows(records)
    write_table(rows, TABLE_COLUMNS, out_dir / task, stamp,
                f"{env} behaviour cloning: bootstrap return (m = half the pooled episodes, 1000 trials), "
                f"per-seed mean return (min/median/max), train/validation MSE (mean over seeds), the conventions "
                f"that ran, DoPr's Cholesky retries (10x damping each) and eigh fallbacks summed over seeds")

    # per optimizer and trajectory count, its best setting (a sweep over hyperparameters: the best)
    by = best_per(rows, lambda r: (r["optimizer"], r["num_trajectories"]), "return_mean")
    deltas = dopr_vs_gp(by, GPS, "num_trajectories", "return_mean", "return",
                        intervals={"quantile_bands_overlap": ("return_q10", "return_q90"),
                                   "seed_ranges_overlap": ("seed_return_min", "seed_return_max", "seeds")},
                        carry=("val_loss", "lr"))
    if deltas:
        write_table(deltas, DELTA_COLUMNS, out_dir / f"{task}_dopr_vs_gp", stamp,
                    f"{env}: DoPr variant minus its GP (bootstrap mean return; where the sweep varies "
                    f"hyperparameters, each optimizer's best setting)")

    timing = []
    for opt_name, ss in group_runs((r["summary"] for r in records), lambda s: (s["optim"],)).items():
        timing.append({"optimizer": opt_name[0], "jobs": len(ss),
                       "train_s_median": float(np.median([s["train_time_s"] for s in ss])),
                       "eval_s_median": float(np.median([s["eval_time_s"] for s in ss])),
                       "wall_s_median": float(np.median([s["wall_time_s"] for s in ss])),
                       "wall_s_max": float(np.max([s["wall_time_s"] for s in ss]))})
    write_table(timing, ["optimizer", "jobs", "train_s_median", "eval_s_median", "wall_s_median", "wall_s_max"],
                out_dir / f"{task}_timing", stamp,
                f"{env}: seconds per BC job (1000 steps + evaluation episodes), 1 torch thread per job")

    return figure(by, env, rows[0]["expert_return"], out_dir / f"{task}.png", stamp)


def figure(by: dict, env: str, expert_return: float, path, stamp: str):
    """The paper's BC figure from each optimizer's best cell per trajectory count ({(optimizer, n): row}):
    one column per GP that ran, titled by the optimizers it shows; per optimizer the per-seed mean
    return's median as the line (min..max as the band) and the bootstrap q10..q90 as a bar around its
    q50 (a short tick) a few points to the side of the line's point; train and validation MSE below. A
    cell whose value is not finite (a diverged run) is an 'x' on the panel's top edge."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import offset_copy

    gps = [gp for gp in GPS if any(k[0] in (gp, optimizer_name(gp, True)) for k in by)]
    counts = sorted({n for _, n in by})
    fig, axes = plt.subplots(3, len(gps), figsize=(max(3.6 * len(gps), 5.0), 8.5), squeeze=False, sharex=True)
    for j, gp in enumerate(gps):
        shown = []
        for name, style, shift in ((gp, "--", -4), (optimizer_name(gp, True), "-", 4)):
            pts = sorted((n, r) for (o, n), r in by.items() if o == name)
            if not pts:
                continue
            shown.append(name)
            x = [n for n, _ in pts]
            c = "C0" if style == "--" else "C1"
            ax = axes[0, j]
            seeds = sorted({r["seeds"] for _, r in pts})
            label = f"{name} ({'/'.join(map(str, seeds))} seed{'s' if seeds != [1] else ''})"
            points_with_divergence(ax, x, [r["seed_return_median"] for _, r in pts], style, c, label, marker="o", ms=4)
            ok = [(n, r) for n, r in pts if all(np.isfinite([r[k] for k in ("seed_return_min", "seed_return_max",
                                                                             "return_q10", "return_q50", "return_q90")]))]
            if ok:
                xo = np.array([n for n, _ in ok], dtype=float)
                ax.fill_between(xo, [r["seed_return_min"] for _, r in ok], [r["seed_return_max"] for _, r in ok],
                                color=c, alpha=0.2)
                q50 = np.array([r["return_q50"] for _, r in ok])
                err = [q50 - [r["return_q10"] for _, r in ok], np.array([r["return_q90"] for _, r in ok]) - q50]
                # the bar beside its point by a few points on the page, whatever the axis' range
                ax.errorbar(xo, q50, yerr=err, fmt="_", ms=7, color=c, elinewidth=1.5, capsize=2,
                            transform=offset_copy(ax.transData, fig=fig, x=shift, units="points"))
            for i, key in ((1, "train_loss"), (2, "val_loss")):
                points_with_divergence(axes[i, j], x, [r[key] for _, r in pts], style, c, name, marker="o", ms=4)
        axes[0, j].set_title(optimizers_title(shown))
        legend(axes[0, j], fontsize=7)
        for i in (1, 2):
            axes[i, j].set_yscale("log")
            if any(getattr(axes[i, j], "_dopr_diverged_marked", False) for i in (1, 2)):
                legend(axes[i, j], fontsize=7)
        count_axis(axes[2, j], counts, "number of trajectories")
    axes[0, 0].set_ylabel("return: seeds min/median/max (line, band),\nbootstrap q10/q50/q90 (bar beside)",
                          fontsize=8)
    axes[1, 0].set_ylabel("train MSE")
    axes[2, 0].set_ylabel("validation MSE")
    fig.suptitle(f"{env} behaviour cloning (expert return {expert_return:.0f})")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save_figure(fig, path, stamp)


def expert(records, out_dir, stamp) -> None:
    """The SAC experts: final return of the published actor per environment and seed."""
    rows = [{"env": s["env"], "seed": s["seed"], "return_mean": s["return_mean"], "return_std": s["return_std"],
             "expert_step": s["expert_step"], "train_steps": s["train_steps"],
             "best_eval_return": s["best_eval_return"], "wall_time_s": s["wall_time_s"]}
            for s in sorted((r["summary"] for r in records), key=lambda s: (s["env"], s["seed"]))]
    write_table(rows, list(rows[0]), out_dir / "expert", stamp,
                "SAC experts: return of the better of the best and last actor over the final evaluation episodes")


def sensitivity(records, out_dir, stamp) -> None:
    """sweep=humanoid_sensitivity: every cell's table, and return against AP damping per DoPr
    variant and trajectory count (EMA 0 and 0.9 as two lines: seeds min/median/max, bootstrap q10-q90
    bars), the plain GP's per-seed min/median/max as a grey band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = records[0]["summary"]["task"]
    env = records[0]["summary"]["env"]
    rows = cell_rows(records)
    write_table(rows, TABLE_COLUMNS, out_dir / f"{task}_sensitivity", stamp,
                f"{env}: DoPr over AP damping x EMA of G and Sigma, the plain GPs beside them (bootstrap return, "
                f"per-seed mean return min/median/max, DoPr's Cholesky retries summed over seeds)")
    counts = sorted({r["num_trajectories"] for r in rows})
    gps = [gp for gp in GPS if any(r["optimizer"] == optimizer_name(gp, True) for r in rows)]
    fig, axes = plt.subplots(len(counts), len(gps), figsize=(4.2 * len(gps), 3.6 * len(counts)), squeeze=False)
    for i, n in enumerate(counts):
        for j, gp in enumerate(gps):
            ax = axes[i, j]
            for base in (r for r in rows if r["optimizer"] == gp and r["num_trajectories"] == n):
                ax.axhspan(base["seed_return_min"], base["seed_return_max"], color="0.85", label=f"{gp} (seeds)")
                ax.axhline(base["seed_return_median"], color="0.5", lw=1)
            for ema, style in ((0.0, "-o"), (0.9, "--s")):
                pts = sorted((r["damping"], r) for r in rows if r["optimizer"] == optimizer_name(gp, True)
                             and r["num_trajectories"] == n and r["grad_ema"] == ema)
                if not pts:
                    continue
                x = np.array([d for d, _ in pts])
                line, = ax.plot(x, [r["seed_return_median"] for _, r in pts], style, ms=4, label=f"{optimizer_name(gp, True)}, EMA {ema:g}")
                c = line.get_color()
                ax.fill_between(x, [r["seed_return_min"] for _, r in pts], [r["seed_return_max"] for _, r in pts],
                                color=c, alpha=0.15)
                q50 = np.array([r["return_q50"] for _, r in pts])
                ax.errorbar(x * (1.08 if ema else 0.93), q50,
                            yerr=[q50 - [r["return_q10"] for _, r in pts], np.array([r["return_q90"] for _, r in pts]) - q50],
                            fmt="none", ecolor=c, capsize=2)
            ax.set(xscale="log", xlabel=r"AP damping $\gamma$ ($\gamma\,$tr$(\Sigma)$)", title=f"{gp}, {n} trajectories")
            ax.legend(fontsize=6)
        axes[i, 0].set_ylabel("return (seeds min/median/max)")
    fig.suptitle(f"{env}: DoPr's sensitivity to damping and EMA (expert return {rows[0]['expert_return']:.0f})")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, out_dir / f"{task}_sensitivity.png", stamp)
