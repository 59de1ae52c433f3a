"""Behaviour cloning on expert demonstrations (appendix "State-based Imitation Learning").

One job: the first `num_trajectories` demonstrations train a residual MLP with MSE on actions (batch
256, 1000 steps, cosine schedule with 5% warmup down to 0), an EMA copy of the weights (decay 0.99,
every step) is the policy that gets evaluated; the last `val_trajectories` demonstrations give the
validation loss. At each step in `eval_at` the EMA policy runs `eval_episodes` episodes batched
across environments; the returns go to summary.json and the report bootstraps them over checkpoints
and seeds (algorithm "Bootstrap Mean Estimation").
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from experiments.common.checkpoint import TrainingState
from experiments.common.ema import WeightEMA
from experiments.common.loop import Schedule
from experiments.common.schedules import build_schedule

from . import demos as demo_io
from .evaluate import rollout
from .expert import expert_path, generate_demos
from .policy import ResidualMLP


def check_inputs(t) -> None:
    """The task's demonstrations are there, or the expert that writes them (checked before a sweep is
    submitted, and by resolve_demos); FileNotFoundError otherwise."""
    path = Path(t.demos)
    if path.exists():
        return
    if not (t.generate_demos and path.resolve() == Path(t.expert_demos).resolve()):
        demo_io.load(path, t.env)   # its message: a mistyped or missing file of one's own is not written
    expert = expert_path(t.env, t.expert_version)
    if not expert.exists():
        raise FileNotFoundError(f"no demonstrations at {path} and no committed expert at {expert}: train one "
                                f"with `python run.py task=expert task.env={t.env}` and pass task.demos=...")


def resolve_demos(t) -> Path:
    """The task's demonstration file; written from the committed expert on first use when allowed, and
    only at `task.expert_demos` (a mistyped task.demos is refused by demos.load, not written)."""
    path = Path(t.demos)
    check_inputs(t)
    if not path.exists():
        expert = expert_path(t.env, t.expert_version)
        n = t.max_trajectories + t.val_trajectories
        print(f"writing {n} demonstrations of {t.env} from {expert} to {path}", flush=True)
        generate_demos(t.env, n, path, expert)
    return path


def mse(model, obs, act, batch: int = 8192) -> float:
    with torch.no_grad():
        total = sum(((model(obs[i:i + batch]) - act[i:i + batch]) ** 2).mean(1).sum().item()
                    for i in range(0, len(obs), batch))
    return total / len(obs)


def evaluate_policy(t, policy, seed: int) -> np.ndarray:
    def act(obs):
        with torch.inference_mode():
            return policy(torch.from_numpy(obs)).numpy()
    return rollout(t.env, act, t.eval_episodes, seed=seed, batch=t.eval_batch,
                   progress=f"evaluating: {t.eval_episodes} episodes")["returns"]


def run(cfg, run) -> dict:
    t = cfg.task
    if not 1 <= t.num_trajectories <= t.max_trajectories:
        raise ValueError(f"task.num_trajectories must be in [1, {t.max_trajectories}], got {t.num_trajectories}")
    data = demo_io.load(resolve_demos(t), t.env)
    train, val = data.split(t.num_trajectories, t.val_trajectories)
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).float()
    obs, act = cat(train.observations), cat(train.actions)
    val_obs, val_act = cat(val.observations), cat(val.actions)
    schedule = Schedule(t.steps, t.log_every, evaluate_at=t.eval_at, checkpoint_every=t.checkpoint_every,
                        evaluate_key="task.eval_at")

    torch.manual_seed(int(cfg.seed))
    model = ResidualMLP(obs.shape[1], act.shape[1], t.hidden, obs_clip=t.obs_clip)
    model.set_normalization(obs)
    ema = WeightEMA(model, t.ema_decay)  # copied before the optimizer hooks the model
    opt = run.build_optimizer(model)
    sched = build_schedule(opt, "warmup_cosine", t.steps, t.warmup_frac, t.min_lr_factor)
    gen = torch.Generator().manual_seed(int(cfg.seed))

    state = TrainingState(model=model, ema=ema, optimizer=opt, scheduler=sched, generators={"batches": gen})
    start, extra = state.resume(run)
    returns = extra.get("returns", {})
    running, n_running = 0.0, 0
    bar = run.progress(t.steps, initial=start)
    for step in range(start + 1, t.steps + 1):
        with run.clock.training():
            idx = torch.randint(0, len(obs), (t.batch_size,), generator=gen)
            loss = ((model(obs[idx]) - act[idx]) ** 2).mean(1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema.update()
        running, n_running = running + loss.item(), n_running + 1
        if schedule.log(step):
            row = {"train_loss": running / n_running, "lr": sched.get_last_lr()[0],
                   "val_loss": mse(ema.module, val_obs, val_act), "val_loss_raw": mse(model, val_obs, val_act)}
            running, n_running = 0.0, 0
            if schedule.evaluate(step):
                with run.clock.evaluating():
                    r = evaluate_policy(t, ema.module, seed=t.eval_seed + 1000 * int(cfg.seed))
                returns[step] = r.tolist()
                row.update(eval_return=float(r.mean()), eval_return_std=float(r.std()))
                bar.set_postfix(ret=f"{r.mean():.0f}")
            run.log(row, step)
            bar.update(step - bar.n)
        if schedule.checkpoint(step):
            state.save(run, step, returns=returns)
    bar.close()
    final = returns[max(returns)] if returns else []
    return {
        "env": t.env, "num_trajectories": int(t.num_trajectories), "lr": float(cfg.optim.lr),
        "weight_decay": float(cfg.optim.weight_decay),
        "obs_clip": model.obs_clip, "train_loss": mse(model, obs, act), "train_loss_ema": mse(ema.module, obs, act),
        "val_loss": mse(ema.module, val_obs, val_act), "val_loss_raw": mse(model, val_obs, val_act),
        "return_mean": float(np.mean(final)) if final else None,
        "returns": {str(k): v for k, v in returns.items()},
        "expert_return": float(np.mean(data.returns)),
    }
