"""One training step of the robomimic flow policy at the paper's size as a model of ``benchmarks.bench`` (GP vs
DoPr, its rows and columns), and the evaluation loop's throughput (rendering + policy) in the real simulator.

    python -m benchmarks.bench_family robomimic [--batch 256] [--task robomimic_toolhang] [--gps adamw,muon]
        [--precond-every 1,10] [--repeats 3] [--device cpu|cuda] [--out results/robomimic/bench_step_cpu.md]
    python -m experiments.robomimic.bench rollout --dataset data/robomimic/lift/image_abs.hdf5
        [--envs 1,4] [--steps 1,9] [--max-steps 48] [--out results/robomimic/bench_rollout_cpu.md]

The step (:func:`bench_model`, which benchmarks/ registers: experiments import nothing of benchmarks/):
the policy of task=robomimic_toolhang (ChiUNet 128 x [1, 2, 2] + two GroupNorm ResNet-18
encoders, two 84x84 cameras, obs_steps 2, horizon 16, 10 action dimensions) on one fixed random batch;
the DoPr rows precondition every layer with Conv2d by SUA (the paper's setting); R = t_dopr / t_gp.
``rollout``: env steps/s of ``env.rollout`` with a randomly initialised policy of task=robomimic_lift's
size (the policy's seconds and the simulator's seconds reported apart).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from ..common.provenance import ROOT, emit_report, git_revision
from . import rehearse


def task_config(task: str, overrides=()):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"task={task}", *overrides]).task


class _LossModule(torch.nn.Module):
    """model(batch) -> the flow loss, with the same flow times, noise and crops every call."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, batch):
        gen = torch.Generator(device=batch["actions"].device).manual_seed(0)
        return self.policy.loss(batch, gen)


def loss_module(policy) -> torch.nn.Module:
    """The bench's module of `policy`: module(batch) -> the flow loss, the same randomness every call."""
    return _LossModule(policy)


def paper_policy(t):
    """The task's paper-size policy, its shapes from the task config (experiments/robomimic/rehearse.py)."""
    return rehearse.paper_policy(t, *rehearse.shapes(t))


def bench_model(t, batch: int, name: str | None = None):
    """A model of ``benchmarks.bench``: (name, make, DoPr options), ``make()`` -> (module, batch, None, loss_fn)
    for the paper-size policy of task config `t` on one fixed random batch of `batch`, Conv2d by SUA; the name
    is `name`, else ``<task>_policy_b<batch>``."""

    def make():
        low_dim, action_dim = rehearse.shapes(t)
        return (loss_module(paper_policy(t)), rehearse.synthetic_batch(t, batch, low_dim, action_dim), None,
                lambda loss, _: loss)

    return name or f"{t.name}_policy_b{batch}", make, {"conv2d": "sua"}


def rollout_bench(argv) -> None:
    from .data import read_env_args
    from .env import rollout
    from .policy import PolicyRunner

    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--task", default="robomimic_lift")
    p.add_argument("--envs", default="1,4")
    p.add_argument("--steps", default="1,9", help="Euler steps of the sampler")
    p.add_argument("--max-steps", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t = task_config(args.task, [f"task.dataset={args.dataset}"])
    from .data import RobomimicDataset

    data = RobomimicDataset(t.dataset, list(t.cameras), list(t.low_dim), t.horizon, t.obs_steps, t.action_steps,
                            max_demos=4)
    torch.manual_seed(0)
    from .train import build_policy

    policy = build_policy(t, data).eval()
    env_args = read_env_args(t.dataset)
    lines = [f"`python -m experiments.robomimic.bench rollout {' '.join(argv)}`", "",
             f"commit {git_revision()}, torch {torch.__version__}, {args.threads} torch threads, task {args.task} "
             f"policy ({sum(p.numel() for p in policy.parameters()) / 1e6:.2f} M params), cameras "
             f"{list(t.cameras)}, episodes of {args.max_steps} env steps (a random policy does not finish early)", "",
             "| envs side by side | sampler steps | env steps/s | policy s per call | env s per env step |",
             "|---|---|---|---|---|"]
    for n in [int(x) for x in args.envs.split(",")]:
        for k in [int(x) for x in args.steps.split(",")]:
            runner = PolicyRunner(policy, data.normalizer, k, "cpu", t.rotation_6d)
            tic = time.perf_counter()
            r = rollout(runner, env_args, list(t.cameras), list(t.low_dim), episodes=n, max_steps=args.max_steps,
                        obs_steps=t.obs_steps, action_steps=t.action_steps, n_envs=n, seed=0)
            wall = time.perf_counter() - tic
            env_steps = sum(r["episode_lengths"])
            lines.append(f"| {n} | {k} | {env_steps / wall:.1f} | {r['policy_seconds'] / max(runner.calls, 1):.3f} | "
                         f"{r['env_seconds'] / max(env_steps, 1):.3f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", "env steps/s is wall-clock over the whole rollout call, building the environments included; "
              "the last two columns split the time spent stepping between the batched policy calls and the "
              "simulator with its rendering."]
    emit_report(lines, args.out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "rollout":
        raise SystemExit(__doc__)
    rollout_bench(argv[1:])


if __name__ == "__main__":
    main()
