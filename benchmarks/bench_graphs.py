"""The CUDA-graph replay of DoPr's refresh core (dopr/graphs.py) on a device: does it give the eager step's
M, and what does it save.

    python -m benchmarks.bench_graphs [--device cuda] [--out FILE.md] [--smoke]

1. Agreement: a model of several layer sizes (biases and none, two layers sharing an input, d = 1025 beside
   small ones), 8 steps of DoPr-AdamW at k = 1 and at k = 3 with ``cuda_graphs="auto"`` and ``"off"`` from one
   seed: every parameter after every step, bit for bit, and the graph counters (steps from a plan, captures).
2. Cost (``benchmarks.gpu_check``'s part ``graphs`` adds SiT-S/2 and Tool Hang at batch 256): AdamW and DoPr-AdamW
   at k = 1 eager and replayed, round-robin as benchmarks.bench times its rows; t, R against AdamW.

``--smoke`` runs on the CPU, where dopr.graphs runs a plan's core eagerly on its static buffers (the plan logic,
not the capture): seconds.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import dopr
from dopr import graphs


class Sizes(nn.Module):
    """Layers of several sizes: a bias and none on one G shape, two layers reading one input, d = 1025."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(64, 256, bias=False)
        self.c = nn.Linear(256, width)
        self.d = nn.Linear(width, 256)
        self.e = nn.Linear(256, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(x))
        return self.e(torch.tanh(self.d(torch.relu(self.c(h)))))


def agreement(device: str, every: int, steps: int = 8, width: int = 1024, batch: int = 2048) -> dict:
    """Parameters after each step under cuda_graphs auto vs off: the largest difference, and the counters."""
    params, stats = {}, {}
    for mode in ("off", "auto"):
        torch.manual_seed(0)
        model = Sizes(width).to(device)
        opt = dopr.DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precond_every=every, cuda_graphs=mode)
        gen = torch.Generator(device=device).manual_seed(1)
        trace = []
        for _ in range(steps):
            x = torch.randn(batch, 64, device=device, generator=gen)   # rows > d: every layer in feature space
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trace.append([p.detach().clone() for p in model.parameters()])
        params[mode], stats[mode] = trace, opt.stats()
        opt.close()
    diff = max(float((a - b).abs().max()) for sa, sb in zip(params["off"], params["auto"]) for a, b in zip(sa, sb))
    equal = all(torch.equal(a, b) for sa, sb in zip(params["off"], params["auto"]) for a, b in zip(sa, sb))
    return {"every": every, "steps": steps, "equal": equal, "max_diff": diff,
            "graph_steps": stats["auto"]["graph_steps"], "graph_captures": stats["auto"]["graph_captures"],
            "refreshes": stats["auto"]["refreshes"]}


def cost(task: str, device: str, repeats: int, budget: float) -> list:
    """benchmarks.bench's rows of ``task`` (registered there): AdamW, DoPr-AdamW k=1 eager and replayed."""
    from benchmarks import bench as B

    rows = [B.Row(task, "adamw", 0, device), B.Row(task, "adamw", 1, device, options={"cuda_graphs": "off"}),
            B.Row(task, "adamw", 1, device, options={"cuda_graphs": "auto"})]
    rows[1].label, rows[2].label = "dopr_adamw eager", "dopr_adamw graphs"
    while not all(r.done(repeats, budget) for r in rows):
        for r in rows:
            r.step()
    out = [r.result() for r in rows]
    for r, o in zip(rows[1:], out[1:]):
        o["R"] = o["t"] / out[0]["t"]
        o.update({k: r.opt.stats()[k] for k in graphs.COUNTERS})
        o["off"] = r.opt.graphs.off or ""
        r.opt.close()
    return out


def agreement_table(results: list) -> str:
    lines = ["| k | steps | refreshes | from a plan | captures | bit for bit | max abs diff |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['every']} | {r['steps']} | {r['refreshes']} | {r['graph_steps']} | {r['graph_captures']} | "
              f"{'yes' if r['equal'] else 'NO'} | {r['max_diff']:.3g} |" for r in results]
    return "\n".join(lines)


def cost_table(name: str, rows: list) -> str:
    lines = [f"{name}:", "", "| graphs row | n | t_step (ms) | R vs AdamW | from a plan | captures | eager because |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['n']} | {1e3 * r['t']:.2f} | {r.get('R', float('nan')):.3f} | "
                     f"{r.get('graph_steps', '')} | {r.get('graph_captures', '')} | {r.get('off', '')} |")
    eager = next((r for r in rows if r["label"] == "dopr_adamw eager"), None)
    replay = next((r for r in rows if r["label"] == "dopr_adamw graphs"), None)
    if eager and replay:
        lines += ["", f"Replayed / eager step: {replay['t'] / eager['t']:.3f}"]
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="the CPU, small widths, plans run eagerly (seconds)")
    args = p.parse_args(argv)
    if args.smoke:
        graphs.DEVICES = graphs.DEVICES | {args.device}
    width = 64 if args.smoke else 1024
    results = [agreement(args.device, k, steps=4 if args.smoke else 8, width=width, batch=512 if args.smoke else 2048)
               for k in (1, 3)]
    text = "\n".join(["## The replayed refresh against the eager one (benchmarks/bench_graphs.py)", "",
                      f"device {args.device}, torch {torch.__version__}; model Sizes(width={width}), DoPr-AdamW, "
                      f"batch {512 if args.smoke else 2048}", "", agreement_table(results)])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    bad = [r for r in results if not r["equal"] or (args.device == "cuda" and r["graph_captures"] < 1)]
    if bad:
        print(f"[bench_graphs] FAIL: {bad}", file=sys.stderr)
        raise SystemExit(1)
    return text


if __name__ == "__main__":
    main()
