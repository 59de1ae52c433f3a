"""Which layer's stale factor costs the outcome: a per-layer refresh cadence (issue 76 item 4).

The refresh policy ``"layers"``, registered here on the library's refresh seam (dopr/refresh_policy.py), gathers
statistics on every step and refreshes the layers whose name matches ``--stale`` every ``ap.precond_every``-th
step, every other layer on every step. Comparing a run with only the input layer stale against one with only the
hidden layers stale says where the drift that a stale factor misses lives.

    python -m experiments.studies.layer_cadence run --stale '^inp$' -- task=humanoid \\
        +tuned/humanoid_peers_protocol=dopr_adamw task.num_trajectories=20 ap.precond_every=10 seed=0 \\
        hydra.run.dir=multirun/layer_cadence/inp_k10_s0
    python -m experiments.studies.layer_cadence report multirun/layer_cadence/* --out results/staleness/humanoid_layers.md

``run`` is run.py with ``ap.refresh_policy=layers`` added; it writes ``layer_cadence.json`` (the pattern and each
layer's refreshes over its steps, as the policy counted them) beside the run's summary.json. ``report`` tabulates
the runs: pattern, k, seed, each layer's refresh fraction, the run's metrics.
"""
from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
from pathlib import Path

from dopr.refresh_policy import RefreshPolicy, register_policy
from experiments.common.provenance import git_revision

#: the policies of this process (one per DoPr), whose counts ``run`` writes out
POLICIES: list = []
#: layers matching it refresh every k-th step; set by ``run --stale``
STALE = re.compile("$^")


@register_policy("layers")
class LayerCadence(RefreshPolicy):
    """Gathers every step; a group whose layer names match :data:`STALE` is due every ``precond_every``-th step,
    any other group on every step."""

    def __init__(self, options) -> None:
        super().__init__(options)
        self.k, self.counts = options.precond_every, {}
        POLICIES.append(self)

    def gathers(self, step: int) -> bool:
        return True

    def due(self, step: int, keys) -> set:
        out = {key for key in keys if step % self.k == 0 or not any(STALE.search(n) for n in key)}
        for key in keys:
            done, seen = self.counts.get(key, (0, 0))
            self.counts[key] = (done + (key in out), seen + 1)
        return out

    def refresh_fractions(self) -> dict:
        return {",".join(key): done / seen for key, (done, seen) in self.counts.items()}


def run(stale: str, overrides: list) -> Path:
    """run.py with the policy on; returns the run's folder (its hydra.run.dir, which must be given)."""
    global STALE
    dirs = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    if not dirs:
        raise SystemExit("refused: name the run's folder (hydra.run.dir=...): layer_cadence.json goes beside its summary")
    STALE = re.compile(stale)
    sys.argv = ["run.py", *overrides, "ap.refresh_policy=layers"]
    try:
        runpy.run_path("run.py", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    folder = Path(dirs[0])
    counts = {}
    for policy in POLICIES:
        counts.update({",".join(key): list(c) for key, c in policy.counts.items()})
    (folder / "layer_cadence.json").write_text(json.dumps({"stale": stale, "k": POLICIES[0].k if POLICIES else None,
                                                           "refreshes_over_steps": counts}, indent=1))
    return folder


def report(folders: list, out: Path) -> str:
    """A markdown table of the runs (a folder without layer_cadence.json and summary.json is refused)."""
    rows = []
    for folder in map(Path, folders):
        if not (folder / "layer_cadence.json").is_file() or not (folder / "summary.json").is_file():
            raise SystemExit(f"refused: {folder} holds no finished layer_cadence run (layer_cadence.json, summary.json)")
        lc, s = json.loads((folder / "layer_cadence.json").read_text()), json.loads((folder / "summary.json").read_text())
        fractions = ", ".join(f"{name} {d / n:.2f}" for name, (d, n) in lc["refreshes_over_steps"].items())
        metrics = ", ".join(f"{m} {s[m]:.4g}" for m in ("return_mean", "val_loss", "quality") if s.get(m) is not None)
        stale = lc["stale"].replace("|", "\\|")
        rows.append(f"| `{stale}` | {lc['k']} | {s['seed']} | {fractions} | {metrics} | `{folder}` |")
    text = ("`python -m experiments.studies.layer_cadence report " + " ".join(map(str, folders)) + "` at commit `"
            + git_revision() + "`; each run by `python -m experiments.studies.layer_cadence run --stale <stale layers> "
            "-- <its overrides>` (its summary.json lists them)\n\n"
            "| stale layers | k | seed | refreshed (per layer) | outcome | run |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    r = sub.add_parser("run", help="one run.py job with the per-layer cadence")
    r.add_argument("--stale", required=True, help="a regular expression: the layers refreshed every k-th step")
    r.add_argument("overrides", nargs="+", help="run.py's overrides (after --), hydra.run.dir included")
    t = sub.add_parser("report", help="the table of finished runs")
    t.add_argument("folders", nargs="+")
    t.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    if args.stage == "run":
        print(f"wrote {run(args.stale, args.overrides) / 'layer_cadence.json'}")
    else:
        print(report(args.folders, args.out))


if __name__ == "__main__":
    main()
