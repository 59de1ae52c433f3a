"""Issue 48's first probe: the damping-free AP rules against the tuned damping on the digits SiT
(task=sit_digits' model and data, the setting of experiments/sit/damping_probe.py, whose ``probe`` trains
each variant: batch 64, lr 1e-3, no weight EMA), DoPr-AdamW under

* damping 1e-3 tr(Sigma) (the setting that trains), 1e-4 tr(Sigma) (the one that does not:
  results/sit_digits/damping_probe.md), 1e-4 with damping_mode="trace_activations";
* solver="span" at its default floor and cap (no damping);

and AdamW alone. Prints a Markdown table: the mean training loss of the last window (median over seeds,
and the seeds' range) and the wall time per step.

    python -m experiments.studies.damping_free_probe [--steps 600] [--seeds 0] [--threads 1] [--model digits] [--out FILE]

``--model mnist`` probes task=sit_mnist's model and data instead (the 5000 28x28 digits, patch 4: 49 tokens an
image), the same batch and rate.

Each finished (variant, seed) is kept in <out>.json when --out is given; a rerun skips them.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from experiments.common.provenance import atomic_write, emit_report, git_revision
from experiments.sit.damping_probe import probe

#: name -> DoPr options (None: AdamW alone)
VARIANTS = {
    "adamw": None,
    "dopr 1e-3 trace (tuned)": {"damping": 1e-3},
    "dopr 1e-4 trace": {"damping": 1e-4},
    "dopr 1e-4 trace_activations": {"damping": 1e-4, "damping_mode": "trace_activations"},
    "dopr span (default floor, cap)": {"solver": "span"},
    # not in the default list
    "dopr 1e-3 trace_activations": {"damping": 1e-3, "damping_mode": "trace_activations"},
    "dopr span, cap 10": {"solver": "span", "span_cap": 10.0},
    "dopr span, cap 1000": {"solver": "span", "span_cap": 1000.0},
    "dopr span, cap 3": {"solver": "span", "span_cap": 3.0},
    "dopr span, cap 30": {"solver": "span", "span_cap": 30.0},
    # damping set by the health report (weak_share_bound, re-chosen every refresh): damping is the floor
    "dopr weak share 0.5, floor 1e-6": {"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.5},
    "dopr weak share 0.25, floor 1e-6": {"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.25},
    "dopr weak share 0.5, floor 1e-4": {"damping": 1e-4, "health_every": 1, "weak_share_bound": 0.5},
    "dopr weak share 0.35, floor 1e-6": {"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.35},
    # re-chosen every 10th refresh, held between (one eigendecomposition per layer per 10 steps)
    "dopr weak share 0.25, floor 1e-6, every 10": {"damping": 1e-6, "health_every": 10, "weak_share_bound": 0.25},
    "dopr weak share 0.35, floor 1e-6, every 10": {"damping": 1e-6, "health_every": 10, "weak_share_bound": 0.35},
    # the same share measured by the rational filter (no eigendecomposition), chosen on every refresh
    "dopr weak share 0.25 (filter), floor 1e-6": {"damping": 1e-6, "weak_share_bound": 0.25,
                                                  "weak_share_estimate": "filter"},
    "dopr weak share 0.5 (filter), floor 1e-6": {"damping": 1e-6, "weak_share_bound": 0.5,
                                                 "weak_share_estimate": "filter"},
    # statistics over time (direction 4): a bias-corrected EMA of Sigma, alone and under the bound
    "dopr 1e-4 trace, Sigma EMA 0.95": {"damping": 1e-4, "precond_ema": 0.95},
    "dopr 1e-4 trace, Sigma EMA 0.99": {"damping": 1e-4, "precond_ema": 0.99},
    "dopr weak share 0.5, floor 1e-6, Sigma EMA 0.95": {"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.5,
                                                       "precond_ema": 0.95},
    "dopr weak share 0.5, floor 1e-6, Sigma EMA 0.99": {"damping": 1e-6, "health_every": 1, "weak_share_bound": 0.5,
                                                       "precond_ema": 0.99},
    # the same, re-chosen every 10th refresh: the EMA's Sigma moves slowly, so a held factor may follow it
    "dopr weak share 0.5, floor 1e-6, Sigma EMA 0.99, every 10": {"damping": 1e-6, "health_every": 10,
                                                                  "weak_share_bound": 0.5, "precond_ema": 0.99},
    # issue 67: lambda from each layer's q = d / N_eff (damping_rule="sample_count", no floor), and the
    # tuned damping, each at three rates (the key "lr" is the probe's rate, not an AP option)
    **{f"dopr sample_count, lr {lr}": {"damping_rule": "sample_count", "damping": 0.0, "lr": float(lr)}
       for lr in ("3e-4", "1e-3", "3e-3")},
    **{f"dopr 1e-3 trace, lr {lr}": {"damping": 1e-3, "lr": float(lr)} for lr in ("3e-4", "1e-3", "3e-3")},
    # the rule over the library's default damping 1e-4 tr(Sigma) as its floor (one option away, no per-family value)
    **{f"dopr sample_count, floor 1e-4, lr {lr}": {"damping_rule": "sample_count", "damping": 1e-4, "lr": float(lr)}
       for lr in ("3e-4", "1e-3", "3e-3")},
    # the same with the lift at q > 1 scaled to the seen directions (damping_rule="sample_count_seen")
    **{f"dopr sample_count_seen, floor 1e-4, lr {lr}": {"damping_rule": "sample_count_seen", "damping": 1e-4,
                                                         "lr": float(lr)} for lr in ("3e-4", "1e-3", "3e-3")},
    **{f"dopr sample_count_seen, lr {lr}": {"damping_rule": "sample_count_seen", "damping": 0.0, "lr": float(lr)}
       for lr in ("3e-4", "1e-3", "3e-3")},
}
DEFAULT = list(VARIANTS)[:5]


def run_key(name: str, seed: int, args) -> str:
    """A run's key in the cache (the digits' keys carry no model, as before --model existed)."""
    return (f"{name} | seed {seed} | steps {args.steps}" + ("" if args.model == "digits" else f" | {args.model}")
            + ("" if args.device == "cpu" else f" | {args.device}"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--window", type=int, default=150, help="steps per loss window; the last one is reported")
    p.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS))
    p.add_argument("--model", choices=("digits", "mnist"), default="digits", help="the task whose model and data")
    p.add_argument("--device", default="cpu", help="where to train (the cache keys name a device other than cpu)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache_path = Path(args.out).with_suffix(".json") if args.out else None
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    last = str(args.steps - args.steps % args.window)
    for name in args.variants:
        for seed in args.seeds:
            key = run_key(name, seed, args)
            if key in cache:
                continue
            tic = time.perf_counter()
            options = dict(VARIANTS[name]) if VARIANTS[name] is not None else None
            lr = options.pop("lr", 1e-3) if options is not None else 1e-3
            curve = probe(options, None, seed, args.steps, lr=lr, model_name=args.model, every=args.window,
                          device=args.device)
            cache[key] = {"curve": curve, "step_s": (time.perf_counter() - tic) / args.steps}
            print(key, {k: round(v, 3) for k, v in curve.items()}, f"{cache[key]['step_s']:.3f} s/step",
                  file=sys.stderr, flush=True)
            if cache_path:
                atomic_write(cache_path, lambda f: f.write_text(json.dumps(cache, indent=1)))
    lines = [f"`python -m experiments.studies.damping_free_probe {shlex.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"commit {git_revision()}, torch {torch.__version__}, device {args.device}, {args.threads} thread(s); task=sit_{args.model}' model "
             f"and data, batch 64, lr 1e-3 unless the rule names another, {args.steps} steps, seeds {args.seeds}. Loss: mean training loss of "
             f"steps {int(last) - args.window + 1}-{last} (median over seeds, range); step time: wall seconds per "
             "step (data, forward, backward, AP, GP), median over seeds.", "",
             "| rule | final train loss | seed range | step time (s) |", "|---|---|---|---|"]
    for name in args.variants:
        runs = [cache[run_key(name, s, args)] for s in args.seeds]
        losses = [r["curve"][last] for r in runs]
        lines.append(f"| {name} | {statistics.median(losses):.3f} | {min(losses):.3f}-{max(losses):.3f} | "
                     f"{statistics.median(r['step_s'] for r in runs):.3f} |")
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
