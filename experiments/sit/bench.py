"""One SiT-S/2 training step, GP vs DoPr (``dopr.bench``'s rows and cost model), and the DoPr coverage
report of SiT-S/2 (what is preconditioned, what is skipped and why).

    python -m experiments.sit.bench step [--batch 256] [--gps adamw,muon] [--precond-every 1,10]
        [--repeats 3] [--device cpu|cuda] [--out results/sit/bench_step_cpu.md]
    python -m experiments.sit.bench coverage [--out results/sit/coverage_sit_s2.md]

``step``: SiT-S/2 on 32x32x4 latents (ImageNet 256 through the SD VAE), 1000 classes, one fixed random
batch, the transport loss with fixed noise and times; the DoPr rows precondition every layer (the
patch embedding by im2col: its patches do not overlap); R = t_dopr / t_gp. On CUDA the step runs under
bf16 autocast (as task=sit_imagenet trains).
"""
from __future__ import annotations

import argparse
import sys

import torch

from dopr import bench as dopr_bench

from .model import SiT_models
from .transport import Transport


class _LossModule(torch.nn.Module):
    """model(batch) -> the transport loss with the same noise and times every call."""

    def __init__(self, model, bf16: bool):
        super().__init__()
        self.model, self.bf16 = model, bf16

    def forward(self, batch):
        x1, y = batch["x1"], batch["y"]
        gen = torch.Generator(device=x1.device).manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            return Transport("linear").loss(self.model, x1, y, gen)


def step(argv) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--model", default="SiT-S/2")
    args, rest = p.parse_known_args(argv)
    cuda = "--device" in rest and rest[rest.index("--device") + 1] == "cuda"

    def make():
        torch.manual_seed(0)
        model = SiT_models[args.model](input_size=32)
        batch = {"x1": torch.randn(args.batch, 4, 32, 32), "y": torch.randint(1000, (args.batch,))}
        return _LossModule(model, cuda), batch, None, lambda loss, _: loss

    name = f"{args.model.replace('/', '_')}_b{args.batch}" + ("_bf16" if cuda else "")
    dopr_bench.register_task(name, make, {})
    dopr_bench.main(["--models", name, *rest], command=f"python -m experiments.sit.bench step {' '.join(argv)}")


def coverage(argv) -> None:
    import dopr

    from ..common.provenance import emit_report, git_revision

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="SiT-S/2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = SiT_models[args.model](input_size=32)
    opt = dopr.build(model, "dopr_adamw", lr=1e-4)
    entries = opt.coverage()
    pre = [e for e in entries if e.status == "preconditioned"]
    fixed = [n for n, q in model.named_parameters() if not q.requires_grad]
    lines = [f"`python -m experiments.sit.bench coverage {' '.join(argv)}`", "",
             f"commit {git_revision()}: DoPr coverage of {args.model} (input 32x32x4, 1000 classes), "
             f"{sum(q.numel() for q in model.parameters()) / 1e6:.2f} M parameters; "
             f"{len(pre)}/{len(entries)} modules with trainable parameters preconditioned.", "",
             "Fixed parameters (requires_grad=False, not trained, not preconditioned): "
             + ", ".join(f"`{n}` (the 2-D sine-cosine position embedding)" for n in fixed) + ".",
             "LayerNorms have no affine parameters (elementwise_affine=False) and no parameters to precondition.",
             "", "```", opt.coverage_table(), "```"]
    opt.close()
    emit_report(lines, args.out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in ("step", "coverage"):
        raise SystemExit(__doc__)
    (step if argv[0] == "step" else coverage)(argv[1:])


if __name__ == "__main__":
    main()
