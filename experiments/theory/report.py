"""Reports of the theory family: the LDS proposition and construction (`lds`), feature learning
(`feature_learning`) and activation invariance (`invariance`): the tables and figures that mirror
the paper's."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import matplotlib
import numpy as np

from dopr import split_name
from experiments.common.report import (first_seed_panels, legend, line_with_divergence, save_figure, seed_band,
                                       write_table)

matplotlib.use("Agg")


MC_COLUMNS = ["seed", "n_state", "n_action", "horizon", "n_rollouts", "perturbation", "rho_demo", "rho_K",
              "mc_gamma_rel_err_max", "mc_gamma_max_abs_z", "lval_closed", "mc_lval_rel_err", "mc_lval_z",
              "lideal_closed", "mc_lideal_rel_err", "mc_lideal_z", "ttf_paper_T", "ttf_w2_T",
              "mc_ttf_paper_rel_err", "mc_ttf_w2_rel_err"]
TABLE_COLUMNS = ["alpha", "epsilon", "theta", "lval_theta", "lval_psi", "lideal_theta", "lideal_psi",
                 "lval_ratio_psi_over_theta", "lideal_ratio_theta_over_psi", "inf_f_lideal", "inf_f_paper_bound",
                 "inf_f_over_lideal_psi", "paper_regime", "corrected_regime", "ordering_holds",
                 "feature_ordering_holds", "ttf_psi_paper", "ttf_psi_w2", "closed_form_rel_err"]


def _read_csv(path: Path) -> list:
    def conv(v):
        try:
            return int(v)
        except ValueError:
            return float(v)

    with open(path, newline="") as f:
        return [{k: conv(v) for k, v in r.items()} for r in csv.DictReader(f)]


def lds(records, out_dir, stamp) -> None:
    """construction.{csv,md} (the T = inf construction grid; deterministic, taken from the lowest seed),
    monte_carlo.{csv,md} (closed forms vs Monte Carlo, one row per seed) and lds_construction.png."""
    rows = report_tables(records, out_dir, stamp)
    return report_figure(rows, Path(out_dir) / "lds_construction.png", stamp)


def report_tables(records, out_dir, stamp) -> list:
    out_dir = Path(out_dir)
    records = sorted(records, key=lambda r: (r["summary"].get("seed", 0), str(r["dir"])))
    mc_rows = [{k: r["summary"].get(k, "") for k in MC_COLUMNS} for r in records]
    write_table(mc_rows, MC_COLUMNS, out_dir / "monte_carlo", stamp,
                "Proposition LDS: closed forms vs Monte Carlo rollouts (relative errors, z-scores)")
    rows = _read_csv(Path(records[0]["dir"]) / "construction.csv")
    write_table(rows, TABLE_COLUMNS, out_dir / "construction", stamp,
                "Appendix construction (T = inf): L_val and L_ideal of K_theta vs K_psi; "
                "paper_regime = the Proposition's printed conditions, corrected_regime = alpha << eps, "
                "sin theta << alpha^2/eps^2 (factor 10)")
    return rows


def report_figure(rows, path, stamp) -> None:
    import matplotlib.pyplot as plt

    alphas = sorted({r["alpha"] for r in rows})
    epsilons = sorted({r["epsilon"] for r in rows})
    fig, axes = plt.subplots(2, len(alphas), figsize=(4.2 * len(alphas), 7.5), squeeze=False)
    cmap = plt.get_cmap("plasma")
    for j, a in enumerate(alphas):
        ax, bx = axes[0, j], axes[1, j]
        sub = sorted((r for r in rows if r["alpha"] == a and r["epsilon"] == epsilons[0]), key=lambda r: r["theta"])
        th = [r["theta"] for r in sub]
        ax.plot(th, [r["lideal_theta"] for r in sub], "r-o", ms=3, label=r"$L_{ideal}(K_\theta)$")
        ax.plot(th, [r["lval_theta"] for r in sub], "r--s", ms=3, label=r"$L_{val}(K_\theta)$")
        ax.plot(th, [r["inf_f_lideal"] for r in sub], "m:^", ms=3, label=r"$\inf_F L_{ideal}(F G_\theta)$")
        ax.plot(th, [r["inf_f_paper_bound"] for r in sub], color="0.5", lw=0.8, label=r"$\alpha^2/(4\sin\theta)$")
        for k, e in enumerate(epsilons):
            col = cmap(0.85 * k / max(1, len(epsilons) - 1))
            sub_e = sorted((r for r in rows if r["alpha"] == a and r["epsilon"] == e), key=lambda r: r["theta"])
            ax.axhline(sub_e[0]["lval_psi"], color=col, lw=1.2,
                       label=rf"$L_{{val}}=L_{{ideal}}(K_\psi)$, $\epsilon$={e:g}")
            bx.plot([r["theta"] for r in sub_e], [r["ordering_margin"] for r in sub_e], "-o", ms=3, color=col,
                    label=rf"$\epsilon$={e:g}")
            corr = [r for r in sub_e if r["corrected_regime"]]
            bx.plot([r["theta"] for r in corr], [r["ordering_margin"] for r in corr], "o", ms=8, mfc="none",
                    color=col)
            printed = [r for r in sub_e if r["paper_regime"]]
            bx.plot([r["theta"] for r in printed], [r["ordering_margin"] for r in printed], "x", ms=8, color=col)
        ax.set(xscale="log", yscale="log", xlabel=r"$\theta$", title=rf"$\alpha$ = {a:g}:  losses at T = $\infty$")
        bx.axhline(1.0, color="k", lw=0.8)
        bx.set(xscale="log", yscale="log", xlabel=r"$\theta$", title=rf"$\alpha$ = {a:g}:  mismatch margin")
    axes[0, 0].set_ylabel("loss")
    axes[1, 0].set_ylabel("margin (> 1: mismatch holds)")
    # the legends beside the last column (every column has the same entries), not over the first one's data
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    axes[1, -1].legend(fontsize=7, title="o: corrected regime\nx: printed regime", title_fontsize=7,
                       loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(r"margin = min($L_{val}(K_\psi)/L_{val}(K_\theta)$, $L_{ideal}(K_\theta)/L_{ideal}(K_\psi)$)"
                 r"; > 1 means $L_{val}(K_\theta) < L_{val}(K_\psi)$ and $L_{ideal}(K_\psi) < L_{ideal}(K_\theta)$",
                 fontsize=9, y=0.995)
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    return save_figure(fig, path, stamp)


SHOWN_RATES = 2   # an optimizer with more rates in the sweep (a tuning sweep) is drawn at its best only


def feature_learning(records, out_dir, stamp):
    """Per optimizer: the learning rate with the lowest median final validation loss (the table marks it),
    then the median and 10/90% quantiles over seeds of both metrics over training (the paper's figure),
    for every rate of an optimizer that ran at most SHOWN_RATES of them, else for its best."""
    import matplotlib.pyplot as plt

    by = {}
    for r in records:
        s = r["summary"]
        by.setdefault(s["optim"], {}).setdefault(s["lr"], []).append(r)
    rows, best = [], {}
    for opt_name, lrs in sorted(by.items()):
        for lr, rs in sorted(lrs.items()):
            vals = [r["summary"]["val_loss"] for r in rs]
            dists = [r["summary"]["subspace_distance"] for r in rs]
            med = float(np.median(vals)) if all(math.isfinite(v) for v in vals) else float("inf")
            rows.append({"optimizer": opt_name, "lr": lr, "seeds": len(rs), "val_loss_median": med,
                         "subspace_distance_median": float(np.median(dists)), "best": ""})
        best[opt_name] = min(lrs, key=lambda lr: next(r["val_loss_median"] for r in rows if r["optimizer"] == opt_name and r["lr"] == lr))
        for row in rows:
            if row["optimizer"] == opt_name and row["lr"] == best[opt_name]:
                row["best"] = "*"
    write_table(rows, ["optimizer", "lr", "seeds", "val_loss_median", "subspace_distance_median", "best"],
                out_dir / "feature_learning", stamp,
                "Feature learning: final validation loss and subspace distance (median over seeds; * = best lr)")

    # drawn: every rate of an optimizer that ran at most SHOWN_RATES of them (a protocol sweep: DoPr at its
    # own and at its GP's chosen rate; hiding one would hide an arm), else its best (a tuning sweep); one
    # colour per GP, its DoPr variant solid beside the GP dashed
    gps = sorted({split_name(n)[0] for n in by})
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4))
    for opt_name in sorted(by, key=lambda n: (gps.index(split_name(n)[0]), split_name(n)[1])):
        gp_rates = list(by.get(split_name(opt_name)[0], {})) if split_name(opt_name)[1] else []
        lrs = (sorted(by[opt_name], key=lambda lr: (gp_rates == [lr], lr)) if len(by[opt_name]) <= SHOWN_RATES
               else [best[opt_name]])   # DoPr at its own rate first (solid), at its GP's dotted
        for k, lr in enumerate(lrs):
            rs = by[opt_name][lr]
            what = f"lr {lr:g}" + ("" if len(lrs) == len(by[opt_name]) else f", best of {len(by[opt_name])} rates")
            gp = split_name(opt_name)[0]
            if len(lrs) > 1 and gp != opt_name and list(by.get(gp, {})) == [lr]:   # DoPr at its GP's rate
                what += f" = {gp}'s"
            label = f"{opt_name} ({what}, {len(rs)} seed{'s' if len(rs) != 1 else ''})"
            style = ("-" if split_name(opt_name)[1] else "--") if k == 0 else ":"
            for ax, key in zip(axes, ("val_loss", "subspace_distance")):
                seed_band(ax, [{m["step"]: m[key] for m in r["metrics"] if key in m} for r in rs], label,
                          f"C{gps.index(split_name(opt_name)[0])}", quantiles=(0.1, 0.9), linestyle=style)
    axes[0].set(yscale="log", xlabel="step", ylabel="validation loss",
                title="in-distribution validation loss (median, 10-90% of seeds)")
    axes[1].set(xlabel="step", ylabel=r"dist$(G_\theta, G_\star)$", title="feature subspace distance")
    legend(axes[1], fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1),   # beside the curves, not over them
           also=axes[0])
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save_figure(fig, out_dir / "feature_learning.png", stamp)


def invariance(records, out_dir, stamp) -> None:
    """The paper's figure: both trajectories per optimizer, and the table of the largest gap."""
    records = sorted(records, key=lambda r: (r["summary"]["optim"], r["summary"]["seed"]))
    rows = [{"optimizer": r["summary"]["optim"], "seed": r["summary"]["seed"], "lr": r["summary"]["lr"],
             "final_val_original": r["summary"]["val_loss_original"],
             "final_val_transformed": r["summary"]["val_loss_transformed"],
             "max_relative_gap": r["summary"]["max_relative_gap"]} for r in records]
    write_table(rows, list(rows[0]), out_dir / "invariance", stamp,
                "Activation invariance: validation loss on x vs on Qx+d (largest relative gap over training)")

    def draw(ax, name, r):
        for key, fmt, color, label in (("val_loss_original", "-", "C0", "original x"),
                                       ("val_loss_transformed", "--", "C1", "transformed Qx+d")):
            line_with_divergence(ax, {m["step"]: m[key] for m in r["metrics"] if key in m}, fmt, color, label)
        ax.set(yscale="log", xlabel="step", ylabel="validation loss",
               title=f"{name}, seed {r['summary']['seed']}: max relative gap {r['summary']['max_relative_gap']:.1e}")
        legend(ax)

    return first_seed_panels(records, out_dir / "invariance.png", stamp, draw, sharey=True)
