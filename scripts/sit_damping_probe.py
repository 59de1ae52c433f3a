"""Why DoPr with the paper's damping fails on the digits SiT (task=sit_digits): 600 steps of the
analogue's model and data (seed 0, batch 64, lr 1e-3, no EMA, no evaluation) per variant, the mean
training loss over the last 150 steps.

    python scripts/sit_damping_probe.py [--steps 600] [--out results/sit_digits/damping_probe.md]

Variants: AdamW; DoPr-AdamW at damping 1e-4 / 1e-3 / 1e-2 tr(Sigma) on every layer; DoPr-AdamW at 1e-4
with one module group left to a plain AdamW (the timestep MLP's first layer, the whole timestep MLP,
the adaLN modulations, the label table); DoPr-AdamW at 1e-4 after 100 / 300 GP-only steps (warmup_steps).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dopr  # noqa: E402
from experiments.common.provenance import emit_report, git_revision  # noqa: E402
from experiments.sit.data import digits  # noqa: E402
from experiments.sit.model import build_model  # noqa: E402
from experiments.sit.transport import Transport  # noqa: E402

VARIANTS = [("adamw", None, (), 0), ("dopr_adamw", 1e-4, (), 0), ("dopr_adamw", 1e-3, (), 0),
            ("dopr_adamw", 1e-2, (), 0), ("dopr_adamw", 1e-4, ("t_embedder.mlp.0",), 0),
            ("dopr_adamw", 1e-4, ("t_embedder",), 0), ("dopr_adamw", 1e-4, ("adaLN_modulation",), 0),
            ("dopr_adamw", 1e-4, ("y_embedder",), 0), ("dopr_adamw", 1e-4, (), 100), ("dopr_adamw", 1e-4, (), 300)]


def probe(name, damping, plain, warmup, steps, lr=1e-3):
    x, y = digits()
    torch.manual_seed(0)
    model = build_model("custom", input_size=8, in_channels=1, num_classes=10, depth=4, hidden_size=96, num_heads=4,
                        patch_size=2)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rest = [p for n, p in params if not any(k in n for k in plain)]
    left = [p for n, p in params if any(k in n for k in plain)]
    opts = [torch.optim.AdamW(rest, lr=lr, weight_decay=0.0)]
    if name == "dopr_adamw":
        opts[0] = dopr.DoPr(model, opts[0], damping=damping, warmup_steps=warmup)
    if left:
        opts.append(torch.optim.AdamW(left, lr=lr, weight_decay=0.0))
    transport, gen = Transport("linear"), torch.Generator().manual_seed(0)
    window, curve = [], {}
    for step in range(1, steps + 1):
        idx = torch.randint(len(y), (64,), generator=gen)
        loss = transport.loss(model, x[idx], y[idx], gen)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        window.append(loss.item())
        if step % 150 == 0:
            curve[step] = sum(window) / len(window)
            window = []
    return curve


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [f"`python scripts/sit_damping_probe.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"commit {git_revision()}, torch {torch.__version__}, {args.threads} thread(s); task=sit_digits' model "
             f"(depth 4, width 96, patch 2) and data, seed 0, batch 64, lr 1e-3, no weight EMA.", "",
             "| optimizer | damping (x tr Sigma) | left to plain AdamW | GP-only warm-up steps | "
             + " | ".join(f"loss {s - 149}-{s}" for s in range(150, args.steps + 1, 150)) + " |",
             "|---|---|---|---|" + "---|" * (args.steps // 150)]
    for name, damping, plain, warmup in VARIANTS:
        tic = time.perf_counter()
        curve = probe(name, damping, plain, warmup, args.steps)
        lines.append(f"| {name} | {damping if damping else '-'} | {', '.join(plain) or '-'} | {warmup or '-'} | "
                     + " | ".join(f"{v:.3f}" for v in curve.values()) + " |")
        print(lines[-1], f"({time.perf_counter() - tic:.0f} s)", file=sys.stderr, flush=True)
    emit_report(lines, args.out)


if __name__ == "__main__":
    main()
