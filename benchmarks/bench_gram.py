"""Sigma = z^T z of half-precision activations on a GPU, three ways (issue 77): what dopr.statistics.gram should
do with bf16 z on the device.

    python -m benchmarks.bench_gram [--device cuda] [--shapes 65536x385,65536x1537] [--repeats 20] [--out FILE.md]

  out_dtype bmm   the chunks of 4096 rows in one batched bf16 GEMM with a float32 output (torch.bmm(out_dtype=))
  out_dtype mm    the same chunks, one bf16 GEMM each with a float32 output, summed
  upcast          z.float(), then the float32 batched GEMM over the chunks (dopr.statistics._gram_device)
Each is exact on the inputs (bf16 products are exact in float32); the report gives the median ms and the largest
difference from the float64 gram, relative to its largest entry.
"""
from __future__ import annotations

import argparse
import statistics as st
import time

import torch

CHUNK = 4096


def routes(z):
    c, d = z.shape[0] // CHUNK, z.shape[1]
    head = z[:c * CHUNK].reshape(c, CHUNK, d)
    return {
        "out_dtype bmm": lambda: torch.bmm(head.mT, head, out_dtype=torch.float32).sum(0),
        "out_dtype mm": lambda: sum(torch.mm(ch.mT, ch, out_dtype=torch.float32) for ch in z.split(CHUNK)),
        "upcast": lambda: (lambda h: torch.bmm(h.mT, h).sum(0))(head.float()),
    }


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="65536x385,65536x1537,8192x4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    lines = [f"device {args.device}, torch {torch.__version__}", "", "| z | route | ms (median) | rel. error vs float64 |",
             "|---|---|---|---|"]
    for shape in args.shapes.split(","):
        n, d = map(int, shape.split("x"))
        z = torch.randn(n, d, device=args.device).to(torch.bfloat16)
        ref = z.double().T @ z.double()
        for name, fn in routes(z).items():
            try:
                fn()
                sync()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = fn()
                    sync()
                    times.append(1e3 * (time.perf_counter() - t0))
                err = float((out.double() - ref).abs().max() / ref.abs().max())
                lines.append(f"| {n}x{d} | {name} | {st.median(times):.3f} | {err:.1e} |")
            except Exception as exc:   # an op the device's torch lacks: the row says so
                lines.append(f"| {n}x{d} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | |")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
