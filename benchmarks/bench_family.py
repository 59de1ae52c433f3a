"""A family's training step in ``benchmarks.bench``: the family's module gives the model as a plain function
(``bench_model`` of experiments/<family>/bench.py), this one registers it and runs the bench (benchmarks/
imports experiments/, never the reverse).

    python -m benchmarks.bench_family sit [--batch 256] [--model SiT-S/2] [bench.py's options: --gps adamw,muon
        --precond-every 1,10 --repeats 3 --device cpu|cuda --out results/sit/bench_step_cpu.md ...]
    python -m benchmarks.bench_family robomimic [--batch 256] [--task robomimic_toolhang] [bench.py's options]

sit: SiT on 32x32x4 latents, under bf16 autocast with --device cuda; robomimic: the task's paper-size flow
policy, Conv2d by SUA.
"""
from __future__ import annotations

import argparse
import sys

from . import bench


def sit(argv: list):
    """(name, make, DoPr options) of the SiT step, and the arguments left for bench.py."""
    from experiments.sit.bench import bench_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_family sit")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--model", default="SiT-S/2")
    args, rest = p.parse_known_args(argv)
    cuda = "--device" in rest and rest[rest.index("--device") + 1] == "cuda"
    return bench_model(args.batch, args.model, bf16=cuda), rest


def robomimic(argv: list):
    """(name, make, DoPr options) of the robomimic policy's step, and the arguments left for bench.py."""
    from experiments.robomimic.bench import bench_model, task_config

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_family robomimic")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--task", default="robomimic_toolhang")
    args, rest = p.parse_known_args(argv)
    return bench_model(task_config(args.task), args.batch), rest


#: family -> its arguments -> ((name, make, DoPr options), the arguments left for bench.py)
FAMILIES = {"sit": sit, "robomimic": robomimic}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in FAMILIES:
        raise SystemExit(__doc__)
    (name, make, options), rest = FAMILIES[argv[0]](argv[1:])
    bench.register_task(name, make, options)
    bench.main(["--models", name, *rest], command=f"python -m benchmarks.bench_family {' '.join(argv)}")


if __name__ == "__main__":
    main()
