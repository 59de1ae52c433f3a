"""SiT-S/2's training step as a model of ``benchmarks.bench`` (GP vs DoPr, its rows and cost model), the DoPr
coverage report of SiT-S/2 (what is preconditioned, what is skipped and why), and a job's step with subnormal
floats kept and flushed.

    python -m benchmarks.bench_family sit [--batch 256] [--gps adamw,muon] [--precond-every 1,10]
        [--repeats 3] [--device cpu|cuda] [--out results/sit/bench_step_cpu.md]
    python -m experiments.sit.bench coverage [--out results/sit/coverage_sit_s2.md]
    python -m experiments.sit.bench denormal RUN_DIR [RUN_DIR ...] [--steps 10] [--repeats 2] [--out ...]

The step (:func:`bench_model`, which benchmarks/ registers: experiments import nothing of benchmarks/):
SiT-S/2 on 32x32x4 latents (ImageNet 256 through the SD VAE), 1000 classes, one fixed random
batch, the transport loss with fixed noise and times; the DoPr rows precondition every layer (the
patch embedding by im2col: its patches do not overlap); R = t_dopr / t_gp. On CUDA the step runs under
bf16 autocast (as task=sit_imagenet trains).

``denormal``: a training job's step from its checkpoint (model and optimizer state, one batch of its
data, one thread) with subnormal floats kept and flushed to zero (``flush_denormal``), and how many
subnormal values the checkpoint holds.
"""
from __future__ import annotations

import argparse
import sys

import torch

from experiments.common.optim import optim_name

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


def loss_module(model, bf16: bool) -> torch.nn.Module:
    """The bench's module of `model`: module(batch) -> the transport loss (bf16 autocast on CUDA if `bf16`)."""
    return _LossModule(model, bf16)


def bench_model(batch: int = 256, model: str = "SiT-S/2", bf16: bool = False, size: int = 32, build=None):
    """A model of ``benchmarks.bench``: (name, make, DoPr options), ``make()`` -> (module, batch, None, loss_fn)
    for `model` (``build()`` instead, if given) on `size` x `size` x 4 latents, 1000 classes, one fixed random
    batch; `bf16`: the loss under bf16 autocast on CUDA."""

    def make():
        torch.manual_seed(0)
        net = build() if build is not None else SiT_models[model](input_size=size)
        x = {"x1": torch.randn(batch, 4, size, size), "y": torch.randint(1000, (batch,))}
        return loss_module(net, bf16), x, None, lambda loss, _: loss

    return f"{model.replace('/', '_')}_b{batch}" + ("_bf16" if bf16 else ""), make, {}


def coverage(argv) -> None:
    import dopr

    from ..common.provenance import emit_report, git_revision

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="SiT-S/2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = SiT_models[args.model](input_size=32)
    opt = dopr.build(model, "adamw", ap={}, lr=1e-4)
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


def _subnormals(obj) -> int:
    tiny = torch.finfo(torch.float32).tiny
    if torch.is_tensor(obj):
        return int(((obj != 0) & (obj.abs() < tiny)).sum()) if obj.is_floating_point() else 0
    if isinstance(obj, dict):
        return sum(_subnormals(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_subnormals(v) for v in obj)
    return 0


def denormal(argv) -> None:
    import copy
    import time
    from pathlib import Path

    from omegaconf import OmegaConf

    from ..common.provenance import emit_report, git_revision
    from ..common.run import build_optimizer, load_plain, numpy_array_globals
    from .train import build, training_data

    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="job folders holding .hydra/config.yaml and checkpoint.pt")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement (after 2 untimed)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for folder in map(Path, args.runs):
        missing = [f for f in (".hydra/config.yaml", "checkpoint.pt") if not (folder / f).exists()]
        if missing:
            raise SystemExit(f"{folder} has no {' or '.join(missing)}: denormal times a job's step from its "
                             "checkpoint (a job folder of a run with task.checkpoint_every)")
        cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
        state = load_plain(folder / "checkpoint.pt", map_location="cpu", allowed=numpy_array_globals())["state"]
        counts = _subnormals(state["optimizer"]), _subnormals(state["model"])   # before any step touches them
        dataset, _ = training_data(cfg.task)
        pick = torch.randint(len(dataset), (int(cfg.task.batch_size),), generator=torch.Generator().manual_seed(0))
        x, y = dataset.tensors[0][pick], dataset.tensors[1][pick]
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for flush in (False, True):
                torch.set_flush_denormal(flush)
                torch.manual_seed(0)
                model = build(cfg.task, torch.device("cpu"))
                opt = build_optimizer(model, cfg)
                model.load_state_dict(state["model"])
                opt.load_state_dict(copy.deepcopy(state["optimizer"]))   # the step updates the state in place
                transport, gen = Transport(cfg.task.path), torch.Generator().manual_seed(1)
                for i in range(args.steps + 2):
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    transport.loss(model, x, y, gen).backward()
                    t1 = time.perf_counter()
                    opt.step()
                    if i >= 2:
                        times[flush].append((t1 - t0, time.perf_counter() - t1))
                getattr(opt, "close", lambda: None)()   # DoPr removes its hooks; a plain GP has none
        torch.set_flush_denormal(False)
        med = {f: [sorted(t[k] for t in times[f])[len(times[f]) // 2] * 1e3 for k in (0, 1)] for f in times}
        rows.append(f"| {folder} (step {state['step']}, {optim_name(cfg.optim)} lr {cfg.optim.lr}) | "
                    f"{counts[0]} / {counts[1]} | "
                    f"{med[False][0]:.0f} + {med[False][1]:.0f} | {med[True][0]:.0f} + {med[True][1]:.0f} | "
                    f"{sum(med[False]) / sum(med[True]):.2f}x |")
    lines = [f"`python -m experiments.sit.bench denormal {' '.join(argv)}`", "",
             f"commit {git_revision()}, torch {torch.__version__}, one thread: a training step (forward + backward, "
             f"then the optimizer step; median of {args.steps} x {args.repeats} steps, ms) from each job's checkpoint, "
             "subnormal floats kept vs flushed to zero (`flush_denormal`, the default since this table).", "",
             "| job (checkpoint) | subnormal values: optimizer state / model | kept: fwd+bwd + step | "
             "flushed: fwd+bwd + step | kept / flushed |", "|---|---|---|---|---|", *rows]
    emit_report(lines, args.out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"coverage": coverage, "denormal": denormal}
    if not argv or argv[0] not in commands:
        raise SystemExit(__doc__)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
