"""The step cost of the refresh policies (issue 76 item 3, "Cost"): DoPr-AdamW refreshing every k steps and under
the drift policy, against AdamW, in one run; and a projection of the policy's R onto the committed GPU rows.

    python -m benchmarks.refresh_cost [--models transformer,mlp] [--precond-every 1,3,10,30,100] [--caps 10,100]
        [--repeats 20] [--budget 15] [--threads 2] [--drift-threshold 0.1] [--gpu-report FILE.md]
        [--out results/bench/refresh_cost_cpu.md] [--smoke]

Per model, one round-robin (benchmarks.bench.Row: its own model copy, seed 0, one fixed random batch; every row
steps every round until all are done, so load drift hits them alike): AdamW, DoPr-AdamW at each k
(``refresh_policy="every"``, precond_every=k) and DoPr-AdamW under ``refresh_policy="drift"`` at each cap.
Each step is filed as a refresh step (DoPr's refresh counter moved: every group refreshed) or an other step; a
drift row files apart the steps on which the policy refreshed some groups only (DriftRow).

1. The step table: per row the median refresh and other step, their counts, t at the nominal cadence
   (((k-1) med(other) + med(refresh)) / k, as bench.py) and R = t / t_AdamW. On the fixed batch the inputs of the
   first layer never move, so a drift row refreshes at its cap (and wherever the hidden layers' inputs, which
   training moves, pass the threshold: its own refresh fraction is shown); its other step is a plain non-refresh
   step plus the policy's probe pass, so the probe overhead is (drift other - every-k other at the same k) /
   AdamW's step.
2. R under the policy: R(f) = (f t_refresh + (1 - f) t_other) / t_AdamW with the drift row's own medians, at the
   refresh fractions the policy measured in the committed studies (results/staleness/*_drift/study_runs.csv, the
   median over seeds of refresh_fraction at that cap) and at f = 0.15, issue 76's target fraction.
3. A projection (not a measurement) onto the GPU rows committed in results/bench/ (SiT-S/2 and Tool Hang,
   DoPr-AdamW and DoPr-Muon at k = 1 and 10 against their GP): t_refresh = t(k=1), t_other = (10 t(k=10) -
   t(k=1)) / 9, R_proj(f) = (f t_refresh + (1 - f) t_other) / t_GP, and the same with the CPU's probe overhead (a
   fraction of the GP's step) added to t_other, an assumption that it transfers.

``--smoke`` runs the MLP with k = 1, 2 and cap 2 for a handful of steps (seconds): a check that it runs, not a
measurement, and no verdict. A full run ends with PASS / FAIL lines for issue 76's targets.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch

import dopr
from benchmarks.bench import Row, environment, make_task, write_report

ROOT = Path(__file__).resolve().parents[1]
#: the most recent full GPU report with the SiT-S/2 and Tool Hang bench rows on main (issue 77's round, 6554eb2,
#: CUDA graphs on by default); gpu_nvidia_h200_77_eager.md is the same commit with cuda_graphs=off and the
#: later gpu_nvidia_h200_77_upcast.md a reverted trial without Tool Hang
GPU_REPORT = ROOT / "results" / "bench" / "gpu_nvidia_h200_77.md"
STUDIES = ROOT / "results" / "staleness"
#: issue 76's target refresh fraction
TARGET_FRACTION = 0.15
#: issue 76's targets: the CPU transformer under the policy, and the projections per GPU model
CPU_MAX_R = 1.10
PROJ_MAX_R = {"SiT-S/2": 1.10, "Tool Hang": 1.20}
#: GPU model -> the start of its bench heading ("#### <name>: ...") in the GPU report
GPU_MODELS = {"SiT-S/2": "SiT-S_2", "Tool Hang": "toolhang_policy"}
GPU_LABELS = [("adamw", "dopr_adamw"), ("muon", "dopr_muon")]


# ----------------------------------------------------------------------------- the inputs
def policy_fractions(root=STUDIES) -> dict:
    """{family: {cap: (median refresh_fraction over its seeds, the file)}} from each ``<family>_drift/study_runs.csv``
    under ``root`` (variant drift: the runs at ap.precond_every = cap > 1; k = 1 refreshes every step)."""
    out = {}
    for path in sorted(Path(root).glob("*_drift/study_runs.csv")):
        by_cap = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if "refresh_fraction" not in row or "ap.precond_every" not in row:
                    raise ValueError(f"{path}: no refresh_fraction / ap.precond_every column")
                cap = int(row["ap.precond_every"])
                if cap > 1 and row["refresh_fraction"] not in ("", None):
                    by_cap.setdefault(cap, []).append(float(row["refresh_fraction"]))
        family = path.parent.name[: -len("_drift")]
        out[family] = {cap: (statistics.median(v), path) for cap, v in sorted(by_cap.items())}
    return out


def gpu_step_times(path=GPU_REPORT) -> dict:
    """{model: {row label: t_step ms}} from the bench tables (header ``| optimizer | n | t_step (ms) |``) under
    each model's ``#### <name>`` heading of a GPU report; a missing heading or row is a ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GPU report")
    out, model, header = {}, None, None
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            model = next((m for m, prefix in GPU_MODELS.items() if line.startswith(f"#### {prefix}")), None)
            header = None
            continue
        if model is None or not line.startswith("|"):
            header = None   # a table ends at its first line that is not a row
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:3] == ["optimizer", "n", "t_step (ms)"]:
            header = cells
        elif header and not set(cells[0]) <= set("-:"):
            out.setdefault(model, {}).setdefault(cells[0], float(cells[2]))
    for model in GPU_MODELS:
        for gp, dp in GPU_LABELS:
            for label in (gp, dp, f"{dp} k=10"):
                if label not in out.get(model, {}):
                    raise ValueError(f"{path}: no row {label!r} in the {model} bench table "
                                     f"(heading '#### {GPU_MODELS[model]}...', header '| optimizer | n | t_step (ms) |')")
    return out


def r_of_f(f, t_refresh, t_other, t_gp) -> float:
    """R at refresh fraction f: (f t_refresh + (1 - f) t_other) / t_gp."""
    return (f * t_refresh + (1 - f) * t_other) / t_gp


def projection(times: dict, fractions: dict, probe: float | None) -> list:
    """Rows {model, gp, t_gp, t_refresh, t_other, f_label, f, R, R_probe} from ``gpu_step_times`` and
    {label: f}; ``probe``: the CPU's probe overhead as a fraction of the GP's step (None: not measured)."""
    rows = []
    for model, t in times.items():
        for gp, dp in GPU_LABELS:
            t_gp, t1, t10 = t[gp], t[dp], t[f"{dp} k=10"]
            t_other = (10 * t10 - t1) / 9
            for label, f in fractions.items():
                rows.append({"model": model, "gp": gp, "dopr": dp, "t_gp": t_gp, "t_refresh": t1, "t_other": t_other,
                             "f_label": label, "f": f, "R": r_of_f(f, t1, t_other, t_gp),
                             "R_probe": None if probe is None else r_of_f(f, t1, t_other + probe * t_gp, t_gp)})
    return rows


# ----------------------------------------------------------------------------- the CPU run
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


class DriftRow(Row):
    """A DoPr row under ``refresh_policy="drift"``: DoPr counts a refresh only when every group refreshed (the cap),
    so Row files a step where the policy refreshed some groups (factorizations moved, refreshes did not) as an
    other step; here it goes to ``partial`` instead, and ``other`` keeps the steps that only probed."""

    def __init__(self, *a, **kw):
        self.partial = []
        super().__init__(*a, **kw)
        self.label += " drift"

    def step(self, record=True):
        counts = self.opt.stats()
        before = (counts["refreshes"], counts["factorizations"])
        n_other = len(self.other)
        super().step(record)
        counts = self.opt.stats()
        if (record and len(self.other) > n_other and counts["refreshes"] == before[0]
                and counts["factorizations"] > before[1]):
            self.partial.append(self.other.pop())

    def done(self, repeats, budget):
        """Row.done; or, should the policy refresh some group on nearly every step (no probe-only step to time),
        3 max(repeats, k) steps in all."""
        n = len(self.refresh) + len(self.other) + len(self.partial)
        return super().done(repeats, budget) or n >= 3 * max(repeats, self.k)


def bench_rows(name, args, every, caps) -> list:
    """One round-robin of AdamW, DoPr-AdamW at each k and DoPr-AdamW drift at each cap; a dict per row."""
    print(f"[refresh_cost] {name}: AdamW, DoPr-AdamW at k = {every}, drift at caps {caps} ...", file=sys.stderr, flush=True)
    rows = [Row(name, "adamw", 0, "cpu")] + [Row(name, "adamw", k, "cpu") for k in every]
    drift = {"refresh_policy": "drift", "drift_threshold": args.drift_threshold}
    rows += [DriftRow(name, "adamw", cap, "cpu", options=drift) for cap in caps]
    while not all(r.done(args.repeats, args.budget) for r in rows):
        for r in rows:
            r.step()
    out = []
    for i, r in enumerate(rows):
        refresh, other = _median(r.refresh), _median(r.other)
        t = refresh if r.k == 1 else ((r.k - 1) * other + refresh) / r.k
        stats = r.opt.stats() if isinstance(r.opt, dopr.DoPr) else {}
        out.append({"label": r.label, "policy": "gp" if i == 0 else ("drift" if r.label.endswith("drift") else "every"),
                    "k": r.k, "refresh": refresh, "other": other, "n_refresh": len(r.refresh), "n_other": len(r.other),
                    "t": t, "fraction": stats.get("refresh_fraction_all"),
                    "partial": _median(getattr(r, "partial", [])), "n_partial": len(getattr(r, "partial", []))})
    for r in rows[1:]:
        r.opt.close()
    t_gp = out[0]["t"]
    every_other = {row["k"]: row["other"] for row in out if row["policy"] == "every" and row["n_other"]}
    for row in out:
        row["R"] = row["t"] / t_gp
        if row["policy"] == "drift" and row["k"] in every_other:
            row["probe"] = (row["other"] - every_other[row["k"]]) / t_gp
    return out


def _shown(path) -> str:
    """A path relative to the repository where it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _ms(x):
    return "" if x != x else f"{1e3 * x:.1f}"


def step_table(rows) -> str:
    cols = ["optimizer", "policy", "k / cap", "n refresh", "n other", "refresh step (ms)", "other step (ms)",
            "t (ms)", "R vs AdamW", "n partial", "partial refresh step (ms)", "refresh fraction here",
            "probe overhead (% of AdamW step)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        gp = r["policy"] == "gp"
        cells = [r["label"], r["policy"], "" if gp else str(r["k"]), str(r["n_refresh"]) if not gp else "",
                 str(r["n_other"]) if not gp else "", "" if gp else _ms(r["refresh"]), "" if gp else _ms(r["other"]),
                 _ms(r["t"]), "" if gp else f"{r['R']:.3f}",
                 str(r["n_partial"]) if r["policy"] == "drift" else "", _ms(r["partial"]) if r["policy"] == "drift" else "",
                 "" if r["fraction"] is None or r["policy"] != "drift" else f"{r['fraction']:.3f}",
                 f"{100 * r['probe']:+.1f}" if "probe" in r else ""]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def policy_rows(model, rows, fractions) -> list:
    """R(f) of each drift row at each family's median f at its cap and at TARGET_FRACTION."""
    t_gp, out = rows[0]["t"], []
    full = next((r["refresh"] for r in rows if r["policy"] == "every" and r["k"] == 1), None)
    for r in rows:
        if r["policy"] != "drift" or not r["n_refresh"] or not r["n_other"]:
            continue
        points = [(f"{family} (`{_shown(path)}`)", f)
                  for family, caps in fractions.items() if r["k"] in caps for f, path in [caps[r["k"]]]]
        points.append((f"issue 76's target", TARGET_FRACTION))
        for label, f in points:
            out.append({"model": model, "cap": r["k"], "source": label, "f": f,
                        "R": r_of_f(f, r["refresh"], r["other"], t_gp), "target": label.startswith("issue"),
                        "R_full": None if full is None else r_of_f(f, full, r["other"], t_gp)})
    return out


def policy_table(rows) -> str:
    out = ["| model | cap | refresh fraction from | f | R(f) vs AdamW | R(f), t_refresh of the k=1 row |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['model']} | {r['cap']} | {r['source']} | {r['f']:.3f} | {r['R']:.3f} | "
            f"{'' if r['R_full'] is None else format(r['R_full'], '.3f')} |" for r in rows]
    return "\n".join(out)


def projection_table(rows) -> str:
    out = ["| model | GP | t_GP (ms) | t_refresh = t(k=1) (ms) | t_other = (10 t(k=10) - t(k=1)) / 9 (ms) | f from | f "
           "| R_proj(f) | R_proj(f) + CPU probe overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        probe = "" if r["R_probe"] is None else f"{r['R_probe']:.3f}"
        out.append(f"| {r['model']} | {r['gp']} | {r['t_gp']:.1f} | {r['t_refresh']:.1f} | {r['t_other']:.1f} | "
                   f"{r['f_label']} | {r['f']:.3f} | {r['R']:.3f} | {probe} |")
    return "\n".join(out)


def target_checks(policy: list, proj: list) -> list:
    """PASS / FAIL lines: the CPU transformer's R under the policy at each cap's measured fraction (the largest
    family median, the conservative one), and the projection (with the probe where measured) per GPU model, GP
    and cap."""
    lines = []
    for cap in sorted({r["cap"] for r in policy if r["model"] == "transformer"}):
        measured = [r for r in policy if r["model"] == "transformer" and r["cap"] == cap and not r["target"]]
        if not measured:
            lines.append(f"transformer drift cap {cap}: no measured refresh fraction at this cap -> no verdict  ")
            continue
        r = max(measured, key=lambda r: r["f"])
        lines.append(f"transformer drift cap {cap}: R = {r['R']:.3f} at f = {r['f']:.3f} ({r['source'].split(' ')[0]}) "
                     f"vs {CPU_MAX_R} -> {'PASS' if r['R'] <= CPU_MAX_R else 'FAIL'}  ")
    if not policy or "transformer" not in {r["model"] for r in policy}:
        lines.append("transformer under the policy: not measured in this run -> no verdict  ")
    for (model, gp, label) in sorted({(r["model"], r["gp"], r["f_label"]) for r in proj if r["f_label"] != "target"}):
        r = next(r for r in proj if (r["model"], r["gp"], r["f_label"]) == (model, gp, label))
        value, what = (r["R_probe"], "with the CPU probe overhead") if r["R_probe"] is not None else (r["R"], "no probe")
        bar = PROJ_MAX_R[model]
        lines.append(f"projection {model} DoPr over {gp}, f = {r['f']:.3f} ({label}): R_proj = {value:.3f} ({what}) "
                     f"vs {bar} -> {'PASS' if value <= bar else 'FAIL'}  ")
    return lines


def measured_fractions(fractions) -> dict:
    """{label: f} for the projection: per cap the largest family median, and the target fraction."""
    out = {}
    for cap in sorted({c for caps in fractions.values() for c in caps}):
        family, (f, _) = max(((fam, caps[cap]) for fam, caps in fractions.items() if cap in caps), key=lambda x: x[1][0])
        out[f"cap {cap}, {family}"] = f
    out["target"] = TARGET_FRACTION
    return out


NOTES = """\
Notes. DoPr counts a refresh only when every group refreshed (the cap); a drift row's step on which the policy
refreshed some groups only (their inputs moved past the threshold: on the fixed batch the first layer's inputs
never move, the hidden layers' move as the model trains) is filed apart, "n partial", and is in neither the
refresh nor the other median; its t at the nominal cadence and its R leave them out, "refresh fraction here"
(DoPr.stats()["refresh_fraction_all"], the warm-up steps included) counts them. The refresh fractions of the
studies are fractions of layer-steps (each layer refreshes on its own); R(f) charges f of the steps a full
refresh step and the rest the policy's probe-only step, which treats a layer-step fraction as a step fraction
(an upper bound on the refresh part where fewer layers refresh at once). The probe overhead is the difference
of two medians over different steps, as noisy as either; a negative value is noise. The last column of
section 2 takes t_refresh from the k = 1 row (every layer refreshed on every step, many steps) instead of the
drift row's few cap refreshes; the verdicts use the drift row's own medians."""


def main(argv=None, command=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="transformer,mlp")
    p.add_argument("--precond-every", default="1,3,10,30,100", help="k of the refresh_policy='every' rows")
    p.add_argument("--caps", default="10,100", help="precond_every (the cap) of the refresh_policy='drift' rows")
    p.add_argument("--drift-threshold", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget", type=float, default=15.0, help="seconds per row before timing stops early")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gpu-report", default=str(GPU_REPORT), help="the GPU report the projection reads")
    p.add_argument("--studies", default=str(STUDIES), help="the folder of the <family>_drift/study_runs.csv files")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    p.add_argument("--smoke", action="store_true", help="the MLP, k = 1, 2, cap 2, 3 steps a row (seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.repeats, args.budget, args.precond_every, args.caps = "mlp", 3, 0.5, "1,2", "2"
    every, caps = [int(k) for k in args.precond_every.split(",")], [int(k) for k in args.caps.split(",")]
    if min(caps) < 2:
        p.error("--caps: a cap of 1 refreshes every step (the policy does nothing there)")
    # the inputs first: a missing row or file fails before minutes of timing
    gpu_report = Path(args.gpu_report)
    times, fractions = gpu_step_times(gpu_report), policy_fractions(args.studies)
    torch.set_num_threads(args.threads)
    commit, device_name = environment("cpu")
    load0 = os.getloadavg()[0]
    command = command or f"python -m benchmarks.refresh_cost {shlex.join(sys.argv[1:] if argv is None else argv)}"
    lines = [f"`{command}`", "",
             f"commit {commit}, {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
             f"device cpu ({device_name}), {torch.get_num_threads()} threads, repeats {args.repeats}, "
             f"budget {args.budget:g} s per row, drift_threshold {args.drift_threshold:g}", ""]
    policy, probes = [], []
    lines += ["## 1. Step times: every k and the drift policy, one round-robin per model", ""]
    for name in args.models.split(","):
        make_task(name, "cpu")   # an unknown model fails here, before the rows are built
        rows = bench_rows(name, args, every, caps)
        lines += [f"### {name}", "", step_table(rows), ""]
        policy += policy_rows(name, rows, fractions)
        probes += [(name, r["k"], r["probe"]) for r in rows if "probe" in r]
    lines[2] += f", load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    lines += ["## 2. R under the policy (CPU, the drift rows' own refresh and other medians)", "",
              "R(f) = (f t_refresh + (1 - f) t_other) / t_AdamW; f: the median over seeds of the studies' "
              "refresh_fraction at that cap, and issue 76's target 0.15.", "", policy_table(policy), ""]
    for family, by_cap in fractions.items():
        lines.append(f"- {family}: " + ", ".join(f"cap {c}: median f = {f:.3f} over `{_shown(path)}`"
                                                  for c, (f, path) in by_cap.items()))
    # the probe transferred to the GPU: the transformer's largest (its steps are the longest), else any model's
    chosen = max((p for p in probes if p[0] == "transformer"), key=lambda p: p[2], default=None) \
        or max(probes, key=lambda p: p[2], default=None)
    probe = None if chosen is None else max(chosen[2], 0.0)
    proj = projection(times, measured_fractions(fractions), probe)
    shown = _shown(gpu_report)
    lines += ["", "## 3. Projection, not a measurement: the drift policy on the committed GPU rows", "",
              f"From `{shown}` (its bench tables for SiT-S/2 and Tool Hang). Issue 76 names H100 rows; the committed "
              "GPU reports are from one NVIDIA H200, so this projects onto the H200's rows. t_refresh = t(k=1), "
              "t_other = (10 t(k=10) - t(k=1)) / 9, R_proj(f) = (f t_refresh + (1 - f) t_other) / t_GP; f per cap is the "
              "largest family median of section 2's studies. The last column adds to t_other the probe overhead measured "
              "here on the CPU, as a fraction of the GP's step"
              + (f" ({100 * probe:.1f}%: {chosen[0]}, cap {chosen[1]}, negative taken as 0)" if chosen else
                 " (not measured in this run: no every-k row at a drift row's cap)")
              + ": that it transfers to the GPU is an assumption (there the policy also reads its drift back to the host "
              "once per step).", "", projection_table(proj), "", NOTES, ""]
    lines += ["smoke run: no verdict on the targets (3 steps a row)"] if args.smoke else target_checks(policy, proj)
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
