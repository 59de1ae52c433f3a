"""Aggregate sweeps into results/<task>/: tables (CSV and markdown) and figures (PNG).

    python -m experiments.report multirun/feature_learning/20261121-230000 [more sweep dirs] [--out DIR]

The tables go beside the first sweep (<sweep>/report/) unless --out says where. The committed tables
under results/ are replaced only with --replace-results, and never from debug runs (a report made
from debug runs says so in its stamp).

Each finished job (a directory with summary.json) becomes a record; records are grouped by task and
sweep and handed to the report function the task config names (`task.report`, e.g.
experiments.bc.report.bc), which writes the files that mirror the paper's figure for that task.
Every file carries a stamp naming the sweep command that made the runs, the report command and the
commit. Re-running the command rewrites the same files (idempotent).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from .provenance import git_revision, portable_command, repo_path


def _sweep_command(job: Path, root: Path) -> str:
    """The command that made the job: its sweep's (multirun.yaml in an ancestor up to `root`), else its own."""
    for d in [job, *job.parents]:
        f = d / "multirun.yaml"
        if f.exists():
            o = OmegaConf.load(f).hydra.overrides
            args = [a for a in list(o.task) + list(o.hydra) if a != "hydra.mode=MULTIRUN"]
            return portable_command("python run.py -m " + " ".join(shlex.quote(a) for a in args))
        if d == root:
            break
    overrides = job / ".hydra" / "overrides.yaml"
    args = OmegaConf.load(overrides) if overrides.exists() else []
    return portable_command("python run.py " + " ".join(shlex.quote(str(a)) for a in args))


def load_records(sweep_dirs) -> list:
    records = []
    for root in sweep_dirs:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"sweep directory not found: {root}")
        for summary in sorted(root.rglob("summary.json")):
            job = summary.parent
            cfg_file = job / ".hydra" / "config.yaml"
            metrics_file = job / "metrics.jsonl"
            records.append({
                "dir": job,
                "summary": json.loads(summary.read_text()),
                "config": OmegaConf.load(cfg_file) if cfg_file.exists() else None,
                "metrics": [json.loads(l) for l in metrics_file.read_text().splitlines() if l] if metrics_file.exists() else [],
                "command": _sweep_command(job, root),
            })
    return records


SIGNIFICANT_DIGITS = 7   # what a re-run reproduces: float32 training (eps 1.2e-7) and BLAS summation order move
                         # the 8th digit and beyond; a table rounded here reads the same after every run


def reproducible(v):
    """A float rounded to SIGNIFICANT_DIGITS (non-finite ones, ints and strings as they are)."""
    return float(f"{v:.{SIGNIFICANT_DIGITS}g}") if isinstance(v, float) and math.isfinite(v) else v


def write_table(rows: list, columns: list, path_stem: Path, stamp: str, title: str = "", markdown: bool = True) -> None:
    """rows: list of dicts. Writes <stem>.csv and (unless markdown is False) <stem>.md (the markdown names
    commands and commit)."""
    write_csv(rows, columns, path_stem.with_suffix(".csv"))
    if not markdown:
        return
    lines = [f"# {title}" if title else "", "", stamp, "", *markdown_table(rows, columns)]
    path_stem.with_suffix(".md").write_text("\n".join(lines).lstrip() + "\n")


def write_csv(rows: list, columns: list, path: Path) -> None:
    """rows (dicts) as a CSV of these columns, floats rounded to what a re-run reproduces."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: reproducible(v) for k, v in r.items()} for r in rows)


def markdown_table(rows: list, columns: list) -> list:
    """rows (dicts) as the lines of a markdown table of these columns, floats to 4 significant digits."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows)]


STAMP_POINTS = 6


DIVERGED = "diverged (x: last finite value)"


def _finite(v) -> bool:
    """A plottable number: not None, "", NaN or inf."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def split_diverged(curve: dict) -> tuple:
    """A curve ({step: value}) up to its first non-finite value (None, NaN or inf), and whether it has
    one (the run diverged there)."""
    out = {}
    for s in sorted(curve):
        if not _finite(curve[s]):
            return out, True
        out[s] = curve[s]
    return out, False


def mark_diverged(ax, x, y, color) -> None:
    """An 'x' at a diverged run's last finite value, one "diverged" entry in the legend per axes."""
    seen = getattr(ax, "_dopr_diverged_marked", False)
    ax.plot([x], [y], "x", color=color, ms=9, mew=2, zorder=5, label="_nolegend_" if seen else DIVERGED)
    ax._dopr_diverged_marked = True


def mark_diverged_at_edge(ax, x, color, text="diverged") -> None:
    """A point whose value is not finite (a diverged cell): an 'x' at its x on the top edge of the axes."""
    seen = getattr(ax, "_dopr_diverged_marked", False)
    ax.plot([x], [0.97], "x", color=color, ms=9, mew=2, zorder=5, clip_on=False,
            transform=ax.get_xaxis_transform(), label="_nolegend_" if seen else f"{text} (x on the top edge)")
    ax._dopr_diverged_marked = True


def line_with_divergence(ax, curve: dict, fmt: str, color, label: str) -> None:
    """One run's curve ({step: value}) up to its first non-finite value, an 'x' at its last finite value
    where it diverged; a single point drawn as a marker."""
    c, diverged = split_diverged(curve)
    steps = sorted(c)
    ax.plot(steps, [c[s] for s in steps], fmt, color=color, label=label, marker="o" if len(steps) == 1 else None)
    if diverged and steps:
        mark_diverged(ax, steps[-1], c[steps[-1]], color)


def seed_band(ax, curves: list, label: str, color, quantiles=(0.0, 1.0), linestyle="-") -> None:
    """Curves of several seeds ({step: value} each): the median as the line, the quantiles (min..max)
    as the band, on the steps every seed that did not diverge has. A seed whose curve holds a non-finite
    value diverged: its finite part is drawn thin and ends in an 'x' (a "diverged" entry in the legend),
    and the label counts it. A single common step (one evaluation) is drawn as a point with its band as
    a bar."""
    import numpy as np

    parts = [split_diverged(c) for c in curves]
    kept = [c for c, d in parts if not d and c]
    diverged = [c for c, d in parts if d]
    if diverged:
        label = f"{label}, {len(diverged)} of {len(curves)} diverged"
    if kept:
        steps = sorted(set.intersection(*(set(c) for c in kept)))
        y = np.array([[c[s] for s in steps] for c in kept])
        med, lo, hi = np.median(y, 0), np.quantile(y, quantiles[0], 0), np.quantile(y, quantiles[1], 0)
        if len(steps) == 1:
            note = "one evaluation point"
            ax.errorbar(steps, med, yerr=[med - lo, hi - med], fmt="o", color=color, ms=6, capsize=3,
                        label=f"{label[:-1]}; {note})" if label.endswith(")") else f"{label} ({note})")
            left, right = ax.get_xlim()
            ax.set_xlim(min(left, 0), max(right, steps[0] * 1.1))
        else:
            ax.plot(steps, med, linestyle, label=label, color=color)
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2)
    else:
        ax.plot([], [], linestyle, color=color, label=label)   # its legend entry
    for c in diverged:
        if c:
            steps = sorted(c)
            ax.plot(steps, [c[s] for s in steps], color=color, lw=0.8, alpha=0.7)
            mark_diverged(ax, steps[-1], c[steps[-1]], color)
        else:   # diverged before its first logged value: nothing finite to mark
            ax.annotate(f"{label.split(',')[0]}: diverged before its first value", (0.02, 0.02),
                        xycoords="axes fraction", fontsize=7, color=color)


def tidy_log_axis(ax) -> None:
    """A log-scale y axis spanning less than a decade gets plain numbers (381.76, not 3.8176 x 10^2 on
    every minor tick); call it after drawing."""
    from matplotlib.ticker import MaxNLocator, NullFormatter, NullLocator, ScalarFormatter

    lo, hi = ax.get_ylim()
    if ax.get_yscale() != "log" or not (0 < lo < hi < 10 * lo):
        return
    ax.yaxis.set_major_locator(MaxNLocator(5))
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def legend(ax, also=None, **kw):
    """ax.legend with the "diverged" entries last (after the optimizers they belong to); `also`: another
    axes whose entries join (once per label)."""
    handles, labels = ax.get_legend_handles_labels()
    if also is not None:
        for h, label in zip(*also.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("diverged"))
    return ax.legend([handles[i] for i in order], [labels[i] for i in order], **kw)


def optimizers_title(names) -> str:
    """A panel's title naming the optimizers it shows, GPs first: "adamw vs dopr_adamw" for a pair, the one
    name for a single arm (a DoPr-AdamW-only run is "dopr_adamw", never its GP's name)."""
    from dopr import split_name

    return " vs ".join(sorted(set(names), key=lambda n: (split_name(n)[1], n)))


def points_with_divergence(ax, x, y, fmt, color, label, **kw) -> None:
    """A line over x of the finite y; each non-finite y (a diverged cell) an 'x' on the top edge."""
    xs = [a for a, b in zip(x, y) if _finite(b)]
    ax.plot(xs, [b for b in y if _finite(b)], fmt, color=color, label=label, **kw)
    for a, b in zip(x, y):
        if not _finite(b):
            mark_diverged_at_edge(ax, a, color)


def count_axis(ax, counts, label: str) -> None:
    """An axis of a few integer settings (trajectory counts): a tick at each, half a spacing of margin
    (one setting: its value +-10%), never the fractional ticks matplotlib gives a single value."""
    counts = sorted(set(counts))
    pad = 0.5 * min((b - a for a, b in zip(counts, counts[1:])), default=max(1.0, 0.2 * abs(counts[0])))
    ax.set_xticks(counts)
    ax.set_xticklabels([f"{c:g}" for c in counts])
    ax.set_xlim(counts[0] - pad, counts[-1] + pad)
    ax.set_xlabel(label)


def stamp_figure(fig, stamp: str) -> None:
    """The stamp under the figure, wrapped to its width (saved with a tight box, so it adds height
    instead of covering the lowest axes, however many commands it names)."""
    chars = max(40, int(fig.get_figwidth() * 72 / (STAMP_POINTS * 0.6)))  # a 6 pt glyph is ~3.6 pt wide
    text = "\n".join(textwrap.wrap(stamp.replace("`", ""), chars))
    fig.text(0.01, -0.01, text, fontsize=STAMP_POINTS, color="0.4", ha="left", va="top")


def save_figure(fig, path: Path, stamp: str, dpi: int = 100):
    """Stamp the figure with the commands and commit, write it (100 dpi: line plots stay small), close it;
    the figure is returned (its axes, titles and legends stay readable after closing: what the tests
    check)."""
    import matplotlib.pyplot as plt

    stamp_figure(fig, stamp)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return fig


def first_seed_panels(records: list, path: Path, stamp: str, draw, sharey: bool = False):
    """One panel per optimizer (GPs before DoPr variants), drawn by draw(ax, optimizer, record) from the
    optimizer's first run in `records` (sorted by optimizer and seed beforehand); the figure stamped,
    written to path and returned. sharey: one y axis for every panel (curves compared across panels)."""
    import matplotlib.pyplot as plt
    from dopr import split_name

    shown = {}
    for r in records:
        shown.setdefault(r["summary"]["optim"], r)
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False, sharey=sharey)
    for ax, (name, r) in zip(axes[0], sorted(shown.items(), key=lambda kv: (split_name(kv[0])[1], kv[0]))):
        draw(ax, name, r)
    if sharey:
        for ax in axes[0, 1:]:
            ax.tick_params(labelleft=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return save_figure(fig, path, stamp)


def make_stamp(records: list, report_command: str) -> str:
    """Which commands made the runs and the tables, at which commit; paths as the repository names them
    (`repo_path`: relative to the checkout, `<tmp>/...`), never the writing machine's absolute ones."""
    report_command = portable_command(report_command)
    runs = defaultdict(int)
    for r in records:
        runs[portable_command(r["command"])] += 1
    made = "; ".join(f"`{c}` ({n} run{'s' if n != 1 else ''})" for c, n in runs.items())
    debug = sum(_is_debug(r) for r in records)
    note = f" {debug} of them debug runs (debug=default: shrunk tasks, not the paper's settings)." if debug else ""
    return f"Runs made by {made}.{note} Tables by `{report_command}` at commit `{git_revision()}`."


def _is_debug(record: dict) -> bool:
    return bool(record["config"] is not None and record["config"].get("debug_run", False))


def _unfinished(sweep_dirs) -> int:
    """Jobs that started (a .hydra folder) but wrote no summary.json: failed, running or interrupted."""
    return sum(1 for root in sweep_dirs for h in Path(root).rglob(".hydra")
               if h.is_dir() and not (h.parent / "summary.json").exists())


def in_repo(arg: str) -> str:
    """A path argument as the repository sees it (results/x, not /home/me/clone/results/x): `repo_path`."""
    return repo_path(arg)


def output_root(out, sweeps, records, replace_results: bool) -> Path:
    """Where the tables go; refuses the committed results/ without the flag, and for debug runs."""
    from .provenance import ROOT

    root = Path(out) if out else Path(sweeps[0]) / "report"
    committed = (ROOT / "results").resolve()
    if root.resolve() == committed or committed in root.resolve().parents:
        debug = sum(_is_debug(r) for r in records)
        if debug:
            raise SystemExit(f"refused: {debug} of the {len(records)} runs are debug runs (debug=default), and "
                             f"{root} holds the committed tables; write them elsewhere with --out")
        if not replace_results:
            raise SystemExit(f"refused: {root} holds the committed tables (results/); pass --replace-results to "
                             "replace them with these runs, or --out elsewhere (default: beside the sweep)")
    return root


REHEARSAL_REPORT = "experiments.common.rehearsal.report"   # by name: rehearsal.py writes its table with this module


def report_function(cfg, rehearsals: bool = False):
    """The task's report function: the job config's task.report, or, for jobs made before task configs
    named one, that of the task config of the same name in conf/task/; for rehearsals (rehearse=true:
    no training curve) the rehearsal table's."""
    import hydra

    if rehearsals:
        return hydra.utils.get_method(REHEARSAL_REPORT)
    name = cfg.task.report if "report" in cfg.task else _task_config(cfg.task.name).report
    return hydra.utils.get_method(name)


def _task_config(task: str):
    from hydra import compose, initialize_config_dir

    from .provenance import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"task={task}"]).task


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="sweep (multirun) directories")
    ap.add_argument("--out", default=None, help="where the tables go (default: <first sweep>/report)")
    ap.add_argument("--replace-results", action="store_true",
                    help="allow --out results (the committed tables); never for debug runs")
    args = ap.parse_args(argv)
    absent = [s for s in args.sweeps if not Path(s).exists()]
    if absent:   # one line, not load_records' FileNotFoundError traceback
        raise SystemExit(f"sweep directory not found: {', '.join(absent)} (give the folders `python run.py -m ...` "
                         "wrote: multirun/<sweep>/<time>)")
    records = load_records(args.sweeps)
    unfinished = _unfinished(args.sweeps)
    if not records:
        raise SystemExit(f"no finished job (summary.json) under {args.sweeps}" +
                         (f" ({unfinished} started but unfinished)" if unfinished else ""))
    if unfinished:
        print(f"{unfinished} unfinished job(s) (no summary.json) left out", file=sys.stderr)
    missing = sorted({str(r["dir"]) for r in records if r["config"] is None})
    if missing:
        raise SystemExit(f"no .hydra/config.yaml (the job's config) in {missing[:3]}: cannot tell its task's report")
    by_sweep = defaultdict(list)  # results/<task>/ for a task's main sweep, results/<task>/<sweep>/ else
    for r in records:   # rehearsals (rehearse=true) apart: no training curve, their own table
        by_sweep[(r["summary"]["task"], r["config"].sweep_name, bool(r["summary"].get("rehearsal")))].append(r)
    out_root = output_root(args.out, args.sweeps, records, args.replace_results)
    command = "python -m experiments.report " + " ".join(
        shlex.quote(in_repo(a)) for a in (argv if argv is not None else sys.argv[1:]))
    for (task, sweep, rehearsals), recs in sorted(by_sweep.items()):
        out = out_root / task / ("" if sweep == task else sweep)
        out.mkdir(parents=True, exist_ok=True)
        report_function(recs[0]["config"], rehearsals)(recs, out, make_stamp(recs, command))
        print(f"{task} ({sweep}{', rehearsals' if rehearsals else ''}): {len(recs)} run{'s' if len(recs) != 1 else ''} "
              f"-> {out}")
