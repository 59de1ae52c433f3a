"""Train a flow policy on a robomimic image dataset; roll the EMA policy out every ``eval_every`` steps.

    python run.py task=robomimic_toolhang +tuned/robomimic_toolhang=dopr_adamw task.dataset=<image_abs.hdf5>
    python run.py task=robomimic_lift task.dataset=data/robomimic/lift/image_abs.hdf5 debug=default

The loop follows much-ado-about-noising ``examples/train_robomimic.py`` and ``mip/agent.py``: flow loss,
gradient clipping to ``grad_clip_norm`` (the norm before clipping is logged), optimizer step, cosine
decay of the rate over all steps to 0 (``CosineAnnealingLR(T_max=gradient_steps)``; its
``warmup_ratio`` belongs to flow-map training, not to the rate), EMA of the weights (``ema_rate``
0.995) after every step; every ``eval_every`` steps (20k) the EMA policy is rolled out with
``sample_steps`` Euler steps and the best success rate so far is kept. Batches come from a
``DataLoader`` with a ``DistributedSampler`` (one shuffle per epoch, ``set_epoch``); a resumed job
skips the batches its epoch had already drawn, so it sees the same data order as an unbroken one.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..common.checkpoint import TrainingState
from ..common.distributed import data_loader
from ..common.ema import WeightEMA
from ..common.loop import Schedule, every, resumable_batches
from ..common.provenance import atomic_write
from ..common.schedules import build_schedule
from .data import RobomimicDataset, read_env_args
from .policy import FlowPolicy, PolicyRunner


def build_policy(t, dataset: RobomimicDataset) -> FlowPolicy:
    low_dim = {k: int(dataset.low_dim_shape(k)[-1]) for k in t.low_dim}
    return FlowPolicy(list(t.cameras), low_dim, dataset.action_dim, t.horizon, t.obs_steps, t.action_steps,
                      encoder=OmegaConf.to_container(t.encoder, resolve=True),
                      unet=OmegaConf.to_container(t.unet, resolve=True), loss_scale=t.loss_scale,
                      sample_start=t.sample_start)


def datasets(t):
    kwargs = dict(cameras=list(t.cameras), low_dim_keys=list(t.low_dim), horizon=t.horizon, obs_steps=t.obs_steps,
                  action_steps=t.action_steps, rotation_6d=t.rotation_6d, max_demos=t.max_demos,
                  normalization=t.normalization, image_size=t.image_size, resize=t.resize)
    train = RobomimicDataset(t.dataset, split=t.train_split, **kwargs)
    valid = (RobomimicDataset(t.dataset, split=t.valid_split, normalizer=train.normalizer, **kwargs)
             if t.valid_split else None)
    return train, valid


def to_device(batch, device):
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


@torch.no_grad()
def validation_loss(policy, dataset, t, device, seed: int) -> float:
    """The flow loss of ``policy`` on ``dataset`` with fixed noise (seeded), center crops (eval mode)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=t.batch_size, shuffle=False, num_workers=0)
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = policy.training
    policy.eval()
    total, n = 0.0, 0
    for batch in itertools.islice(loader, t.valid_batches):
        batch = to_device(batch, device)
        total += policy.loss(batch, gen).item() * len(batch["actions"])
        n += len(batch["actions"])
    policy.train(was_training)
    return total / max(n, 1)


def evaluate(t, policy, normalizer, device, seed: int, step: int, out_dir: Path) -> dict:
    """Success rate of ``policy`` per number of sampling steps (rollouts in the real simulator)."""
    from .env import rollout  # robosuite and rendering only when evaluating

    env_args = read_env_args(t.dataset)
    out = {}
    for steps in t.sample_steps:
        runner = PolicyRunner(policy, normalizer, int(steps), device, t.rotation_6d)
        video_dir = out_dir / "videos" / f"step{step}_sample{steps}" if t.video_episodes else None
        r = rollout(runner, env_args, list(t.cameras), list(t.low_dim), episodes=t.eval_episodes,
                    max_steps=t.eval_max_steps, obs_steps=t.obs_steps, action_steps=t.action_steps,
                    n_envs=t.eval_envs, seed=seed, video_dir=video_dir, video_episodes=t.video_episodes,
                    fast_render=t.fast_render, image_size=t.image_size,   # rendered at the training size
                    progress=f"evaluating: {t.eval_episodes} episodes, {steps} sampling steps")
        out[f"success_{steps}"] = float(r["success_rate"])
        out[f"successes_{steps}"] = [bool(s) for s in r["successes"]]
        out[f"env_steps_per_s_{steps}"] = float(r["steps_per_second"])
        out[f"policy_s_{steps}"] = float(r["policy_seconds"])
        out[f"env_s_{steps}"] = float(r["env_seconds"])
    return out


def save_policy(path: Path, policy, normalizer, t, step: int) -> None:
    payload = {"policy": policy.state_dict(), "normalizer": normalizer.state_dict(), "step": int(step),
               "task": OmegaConf.to_container(t, resolve=True)}
    atomic_write(path, lambda p: torch.save(payload, p))


def run(cfg, run) -> dict:
    t = cfg.task
    if t.eval_every < 1:
        raise ValueError(f"task.eval_every must be >= 1, got {t.eval_every}")
    schedule = Schedule(t.steps, t.log_every, every(t.steps, t.eval_every) if t.eval_episodes > 0 else (),
                        checkpoint_every=t.checkpoint_every)
    device = run.device
    train_set, valid_set = datasets(t)  # validates the file and every key before anything trains
    torch.manual_seed(int(cfg.seed))
    policy = build_policy(t, train_set).to(device)
    ema = WeightEMA(policy, t.ema_decay)  # copied before the optimizer hooks the model
    opt = run.build_optimizer(policy)
    sched = build_schedule(opt, t.schedule, t.steps, t.warmup_frac, t.min_lr_factor)
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed))  # flow times, noise and crops
    loader = data_loader(train_set, t.batch_size, seed=int(cfg.seed), workers=t.workers,
                         pin_memory=device.type == "cuda")
    if len(loader) == 0:
        raise ValueError(f"task.batch_size={t.batch_size} is larger than the {len(train_set)} training sequences")
    clip = t.grad_clip_norm if t.grad_clip_norm else math.inf
    primary = f"success_{t.sample_steps[0]}"

    state = TrainingState(model=policy, ema=ema, optimizer=opt, scheduler=sched, generators={"flow": gen})
    start, extra = state.resume(run)
    evals, last_train_loss = extra.get("evals", {}), extra.get("train_loss")
    running, n_running = 0.0, 0
    bar = run.progress(t.steps, initial=start)
    batches = resumable_batches(loader, start)
    for step in range(start + 1, t.steps + 1):
        epoch, (batch,) = next(batches)
        with run.clock.training(device):
            loss = policy.loss(to_device(batch, device), gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), clip))
            opt.step()
            sched.step()
            ema.update()
        running, n_running = running + loss.item(), n_running + 1
        if schedule.log(step):
            row = {"train_loss": running / n_running, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
                   "epoch": epoch, "step_time_s": run.clock.train / step}
            last_train_loss, running, n_running = row["train_loss"], 0.0, 0
            if valid_set is not None:
                row["val_loss"] = validation_loss(ema.module, valid_set, t, device, seed=int(cfg.seed))
            if schedule.evaluate(step):
                with run.clock.evaluating():
                    evals[step] = evaluate(t, ema.module, train_set.normalizer, device, step=step, out_dir=run.dir,
                                           seed=t.eval_seed + 1000 * int(cfg.seed))
                row.update({k: v for k, v in evals[step].items() if not k.startswith("successes_")})
                best = max(e[primary] for e in evals.values())
                if evals[step][primary] >= best:
                    save_policy(run.dir / "best_policy.pt", ema.module, train_set.normalizer, t, step)
                bar.set_postfix(success=f"{evals[step][primary]:.2f}", best=f"{best:.2f}")
            run.log(row, step)
            bar.update(step - bar.n)
        if schedule.checkpoint(step):
            state.save(run, step, evals=evals, train_loss=last_train_loss)
    bar.close()
    save_policy(run.dir / "policy.pt", ema.module, train_set.normalizer, t, t.steps)
    return summary(t, cfg, policy, ema, train_set, valid_set, evals, last_train_loss, run.clock.train, device)


def summary(t, cfg, policy, ema, train_set, valid_set, evals: dict, train_loss, train_time: float, device) -> dict:
    primary = f"success_{t.sample_steps[0]}"
    best_step = max(evals, key=lambda s: (evals[s][primary], -s)) if evals else None
    return {
        "dataset": str(t.dataset), "train_sequences": len(train_set), "lr": float(cfg.optim.lr),
        "weight_decay": float(cfg.optim.weight_decay), "grad_clip_norm": t.grad_clip_norm, "steps": int(t.steps),
        "batch_size": int(t.batch_size), "parameters": sum(p.numel() for p in policy.parameters()),
        "train_loss": train_loss,  # the mean over the last logging window
        "val_loss": validation_loss(ema.module, valid_set, t, device, int(cfg.seed)) if valid_set is not None else None,
        "best_success": evals[best_step][primary] if evals else None, "best_step": best_step,
        "success_curve": {str(s): e[primary] for s, e in sorted(evals.items())},
        "best_successes": evals[best_step][f"successes_{t.sample_steps[0]}"] if evals else None,
        "evals": {str(s): e for s, e in sorted(evals.items())}, "step_time_s": train_time / t.steps,
    }
