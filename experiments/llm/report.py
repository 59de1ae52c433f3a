"""Reports of the LLM family. `sft`: the SFT sweep's table and the figure that mirrors the paper's
"8B SFT sweep": final accuracy against validation NLL, one point per optimizer and learning rate,
labelled by the learning rate's rank (1 = smallest), error bars one standard error (lm-eval's for a
single run; over seeds else). `pretrain`: the CPU analogue's base model."""
from __future__ import annotations

import math

import numpy as np

from dopr import split_name
from experiments.common.report import legend, save_figure, write_table
from experiments.common.stats import group_runs, mean_and_error
from experiments.common.tuning import check_one_base


def accuracies(summary: dict) -> dict:
    """{benchmark: (accuracy, standard error)} of one run."""
    if "lm_eval" in summary:
        out = {task: (v["accuracy"], v["accuracy_stderr"]) for task, v in summary["lm_eval"].items()}
        for task in list(out) if summary.get("lm_eval_steps") else ():  # the 3B figure: peak over training
            best = max([summary["lm_eval"][task]] + [s[task] for s in summary["lm_eval_steps"].values()],
                       key=lambda v: v["accuracy"])
            out[f"peak_{task}"] = (best["accuracy"], best["accuracy_stderr"])
        return out
    return {"exact_match": (summary["accuracy"], summary["accuracy_stderr"])}


def run_rows(records, benchmarks) -> list:
    """One row per run, sorted by optimizer, rate and seed: what `sweep_rows` averages, and the base it
    fine-tuned (refused when the runs' bases differ: tuning.check_one_base)."""
    check_one_base(records)
    out = []
    for s in sorted((r["summary"] for r in records), key=lambda s: (s["optim"], s["lr"], s.get("seed") or 0)):
        row = {"optimizer": s["optim"], "lr": s["lr"], "seed": s.get("seed", ""), "val_nll": s["val_nll"],
               "train_loss": s["train_loss"], **{b: accuracies(s)[b][0] for b in benchmarks}}
        out.append({**row, **{k: s[k] for k in ("wall_time_s", "git_revision") if s.get(k) is not None},
                    **({"base": s["base"]["weights_sha256"]} if s.get("base") else {})})
    return out


def sweep_rows(records) -> tuple:
    groups = group_runs((r["summary"] for r in records), lambda s: (s["optim"], s["lr"]))
    benchmarks = sorted({b for s in (r["summary"] for r in records) for b in accuracies(s)})
    rows = []
    for (opt_name, lr), runs in groups.items():
        seeds = [s["seed"] for s in runs if s.get("seed") is not None]
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"{opt_name} at lr {lr:g}: several runs with seed {max(seeds, key=seeds.count)}, so the "
                             "sweep varies another setting (weight decay, damping, ...); this table averages seeds "
                             "per optimizer and rate only: compare such settings with `python -m "
                             "experiments.common.tuning select`")
        row = {"optimizer": opt_name, "lr": lr, "seeds": len(runs)}
        row["val_nll"], row["val_nll_se"] = mean_and_error([s["val_nll"] for s in runs])
        row["train_loss"] = float(np.mean([s["train_loss"] for s in runs]))
        for b in benchmarks:
            accs = [accuracies(s)[b] for s in runs]
            row[b], row[f"{b}_se"] = mean_and_error([a for a, _ in accs], accs[0][1])
        rows.append(row)
    lrs = sorted({r["lr"] for r in rows})
    for row in rows:
        row["lr_index"] = lrs.index(row["lr"]) + 1
    return rows, benchmarks


def sft(records, out_dir, stamp) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = records[0]["summary"]["task"]
    rows, benchmarks = sweep_rows(records)
    base = {(r["optimizer"], r["lr"]): r for r in rows}
    for row in rows:  # DoPr's gain over its GP at the same learning rate
        name, ap = split_name(row["optimizer"])
        gp = base.get((name, row["lr"]))
        for b in benchmarks:
            row[f"{b}_delta"] = row[b] - gp[b] if ap and gp else ""
    columns = ["optimizer", "lr_index", "lr", "seeds", "val_nll", "val_nll_se", "train_loss"]
    columns += [c for b in benchmarks for c in (b, f"{b}_se", f"{b}_delta")]
    write_table(rows, columns, out_dir / task, stamp,
                f"{task}: final validation NLL and accuracy per optimizer and learning rate (mean, standard error)")
    runs = run_rows(records, benchmarks)
    write_table(runs, list(dict.fromkeys(k for r in runs for k in r)), out_dir / f"{task}_runs", stamp,
                f"{task}: each run (the table's means and standard errors recompute from these)")

    fig, axes = plt.subplots(1, len(benchmarks), figsize=(4.5 * len(benchmarks), 4), squeeze=False)
    scale = nll_axis_scale([r["val_nll"] for r in rows])
    for ax, b in zip(axes[0], benchmarks):
        for k, opt_name in enumerate(sorted({r["optimizer"] for r in rows})):
            color = f"C{k}"
            mine = sorted((r for r in rows if r["optimizer"] == opt_name), key=lambda r: r["lr"])
            rs = [r for r in mine if math.isfinite(r["val_nll"])]
            if rs:
                x, y = [r["val_nll"] for r in rs], [100 * r[b] for r in rs]
                ax.errorbar(x, y, xerr=[r["val_nll_se"] for r in rs], yerr=[100 * r[f"{b}_se"] for r in rs],
                            fmt="o-", lw=0.8, ms=5, capsize=2, label=opt_name, color=color)
                for r, xi, yi in zip(rs, x, y):
                    ax.annotate(str(r["lr_index"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=color)
            else:
                ax.plot([], [], "o-", color=color, label=opt_name)
            # a rate whose NLL is not finite (diverged): an 'x' on the right edge at its accuracy, labelled
            for r in (r for r in mine if not math.isfinite(r["val_nll"])):
                seen = getattr(ax, "_dopr_diverged_marked", False)
                ax.plot([0.985], [100 * r[b]], "x", color=color, ms=9, mew=2, clip_on=False,
                        transform=ax.get_yaxis_transform(),
                        label="_nolegend_" if seen else "diverged (NLL not finite; x on the right edge)")
                ax.annotate(str(r["lr_index"]), (0.985, 100 * r[b]), xycoords=ax.get_yaxis_transform(),
                            textcoords="offset points", xytext=(-10, 4), fontsize=7, color=color)
                ax._dopr_diverged_marked = True
        ax.set(xlabel="validation NLL (per token)", ylabel=f"{b} accuracy (%)", title=b, xscale=scale)
        if scale == "linear":
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
        legend(ax, fontsize=7)
    lrs = sorted({r["lr"] for r in rows})
    fig.suptitle(f"{task}: labels = learning-rate rank: " + ", ".join(f"{i + 1}={lr:g}" for i, lr in enumerate(lrs)),
                 fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save_figure(fig, out_dir / f"{task}_nll_vs_accuracy.png", stamp)


def nll_axis_scale(nlls, spread: float = 10.0) -> str:
    """"log" where the finite, positive NLLs span more than `spread` times (one diverged rate would
    otherwise squash every other point against the axis), else "linear"."""
    finite = [v for v in nlls if math.isfinite(v) and v > 0]
    return "log" if finite and max(finite) > spread * min(finite) else "linear"


def pretrain(records, out_dir, stamp) -> None:
    rows = [{"optimizer": r["summary"]["optim"], "lr": r["summary"]["lr"], "seed": r["summary"]["seed"],
             "steps": r["summary"]["steps"], "train_loss": r["summary"]["train_loss"],
             "val_nll": r["summary"]["val_nll"], "accuracy": r["summary"]["accuracy"],
             "wall_time_s": r["summary"]["wall_time_s"],
             "weights_sha256": (r["summary"].get("base") or {}).get("weights_sha256", "")} for r in records]
    write_table(rows, list(rows[0]), out_dir / "pretrain_arith", stamp,
                "CPU analogue: the pretrained base (token NLL on held-out documents, greedy answer accuracy)")
