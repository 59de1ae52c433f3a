"""Behaviour cloning on expert demonstrations (appendix "State-based Imitation Learning").

One job: the first `num_trajectories` demonstrations train a residual MLP with MSE on actions (batch
256, 1000 steps, cosine schedule with 5% warmup down to 0), an EMA copy of the weights (decay 0.99,
every step) is the policy that gets evaluated; the last `val_trajectories` demonstrations give the
validation loss. At each step in `eval_at` the EMA policy runs `eval_episodes` episodes batched
across environments; the returns go to summary.json and the report bootstraps them over checkpoints
and seeds (algorithm "Bootstrap Mean Estimation").
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import numpy as np
import torch

from . import demos as demo_io
from .evaluate import rollout
from .policy import ResidualMLP


def warmup_cosine(total: int, warmup_frac: float, min_factor: float = 0.0):
    warmup = max(1, int(round(warmup_frac * total)))

    def factor(step: int) -> float:  # step = number of optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def resolve_demos(t) -> Path:
    """The task's demonstration file; written from the committed expert on first use when allowed."""
    path = Path(t.demos)
    if not path.exists() and not path.is_dir() and t.generate_demos:
        expert = demo_io.expert_path(t.env, t.expert_version)
        if not expert.exists():
            raise FileNotFoundError(f"no demonstrations at {path} and no committed expert at {expert}: train one "
                                    f"with `python run.py task=expert task.env={t.env}` and pass task.demos=...")
        n = t.max_trajectories + t.val_trajectories
        print(f"writing {n} demonstrations of {t.env} from {expert} to {path}", flush=True)
        demo_io.generate(t.env, n, path, expert)
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
    return rollout(t.env, act, t.eval_episodes, seed=seed, batch=t.eval_batch)["returns"]


def run(cfg, run) -> dict:
    t = cfg.task
    if t.threads:
        torch.set_num_threads(int(t.threads))
    if not 1 <= t.num_trajectories <= t.max_trajectories:
        raise ValueError(f"task.num_trajectories must be in [1, {t.max_trajectories}], got {t.num_trajectories}")
    data = demo_io.load(resolve_demos(t), t.env)
    train, val = data.split(t.num_trajectories, t.val_trajectories)
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).float()
    obs, act = cat(train.observations), cat(train.actions)
    val_obs, val_act = cat(val.observations), cat(val.actions)

    torch.manual_seed(int(cfg.seed))
    model = ResidualMLP(obs.shape[1], act.shape[1], t.hidden, obs_clip=t.get("obs_clip"))
    model.set_normalization(obs)
    ema = copy.deepcopy(model).requires_grad_(False)  # deep-copied before the optimizer hooks the model
    opt = run.build_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(t.steps, t.warmup_frac, t.min_lr_factor))
    params, ema_params = list(model.parameters()), list(ema.parameters())
    gen = torch.Generator().manual_seed(int(cfg.seed))
    eval_at = sorted({int(s) for s in t.eval_at})
    if any(s < 1 or s > t.steps for s in eval_at):
        raise ValueError(f"task.eval_at steps must lie in [1, {t.steps}], got {eval_at}")

    start, returns, train_time, eval_time = 0, {}, 0.0, 0.0
    resumed = run.load_checkpoint()
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        ema.load_state_dict(resumed["ema"])
        opt.load_state_dict(resumed["optimizer"])
        sched.load_state_dict(resumed["scheduler"])
        gen.set_state(resumed["generator"])
        start, returns = resumed["step"], resumed["returns"]
    running, n_running = 0.0, 0
    bar = run.progress(t.steps, initial=start)
    for step in range(start + 1, t.steps + 1):
        tic = time.perf_counter()
        idx = torch.randint(0, len(obs), (t.batch_size,), generator=gen)
        loss = ((model(obs[idx]) - act[idx]) ** 2).mean(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - t.ema_decay)
        train_time += time.perf_counter() - tic
        running += loss.item()
        n_running += 1
        if step % t.log_every == 0 or step in eval_at:
            row = {"train_loss": running / n_running, "lr": sched.get_last_lr()[0],
                   "val_loss": mse(ema, val_obs, val_act), "val_loss_raw": mse(model, val_obs, val_act)}
            running, n_running = 0.0, 0
            if step in eval_at:
                tic = time.perf_counter()
                r = evaluate_policy(t, ema, seed=t.eval_seed + 1000 * int(cfg.seed))
                eval_time += time.perf_counter() - tic
                returns[step] = r.tolist()
                row.update(eval_return=float(r.mean()), eval_return_std=float(r.std()))
                bar.set_postfix(ret=f"{r.mean():.0f}")
            run.log(row, step)
            bar.update(step - bar.n)
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.steps:
            run.save_checkpoint({"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
                                 "scheduler": sched.state_dict(), "generator": gen.get_state(), "step": step,
                                 "returns": returns})
    bar.close()
    if hasattr(opt, "close"):
        opt.close()
    final = returns[max(returns)] if returns else []
    return {
        "env": t.env, "num_trajectories": int(t.num_trajectories), "lr": float(cfg.optim.lr),
        "weight_decay": float(cfg.optim.get("weight_decay", 0.0)),
        "damping": float(cfg.ap.damping) if cfg.optim.name.startswith("dopr_") else None,
        "obs_clip": model.obs_clip, "train_loss": mse(model, obs, act), "train_loss_ema": mse(ema, obs, act),
        "val_loss": mse(ema, val_obs, val_act), "val_loss_raw": mse(model, val_obs, val_act),
        "return_mean": float(np.mean(final)) if final else None,
        "returns": {str(k): v for k, v in returns.items()},
        "expert_return": float(np.mean(data.returns)), "train_time_s": train_time, "eval_time_s": eval_time,
    }


GPS = ("adamw", "muon", "signum", "adamuon")


def report(records, out_dir, stamp) -> None:
    """The paper's BC figure (reward vs number of trajectories with 10/50/90 bootstrap quantiles per GP,
    plain vs DoPr; train and validation loss), the table behind it, DoPr-vs-GP deltas and timings."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.report import stamp_figure, write_table
    from .evaluate import bootstrap

    task = records[0]["summary"]["task"]
    env = records[0]["summary"]["env"]
    cells = {}
    for r in records:
        s = r["summary"]
        key = (s["optim"], s["num_trajectories"], s["lr"], s["weight_decay"], s["damping"] or 0.0)
        cells.setdefault(key, []).append(s)  # one cell per hyperparameter setting
    rows = []
    for (opt_name, n, *_), ss in sorted(cells.items()):
        pooled = [x for s in ss for v in s["returns"].values() for x in v]  # seeds x checkpoints x episodes
        b = bootstrap(pooled, trials=1000, seed=0)
        per_seed = [np.mean([x for v in s["returns"].values() for x in v]) for s in ss]  # the spread the pool hides
        rows.append({"optimizer": opt_name, "num_trajectories": n, "seeds": len(ss), "episodes": len(pooled),
                     "return_mean": b["mean"], "return_q10": b["q10"], "return_q50": b["q50"], "return_q90": b["q90"],
                     "seed_return_min": float(np.min(per_seed)), "seed_return_max": float(np.max(per_seed)),
                     "train_loss": float(np.mean([s["train_loss"] for s in ss])),
                     "val_loss": float(np.mean([s["val_loss"] for s in ss])),
                     "lr": ss[0]["lr"], "weight_decay": ss[0]["weight_decay"],
                     "damping": "" if ss[0]["damping"] is None else ss[0]["damping"],
                     "expert_return": ss[0]["expert_return"]})
    cols = ["optimizer", "num_trajectories", "seeds", "episodes", "return_mean", "return_q10", "return_q50",
            "return_q90", "seed_return_min", "seed_return_max", "train_loss", "val_loss", "lr", "weight_decay",
            "damping", "expert_return"]
    write_table(rows, cols, out_dir / task, stamp,
                f"{env} behaviour cloning: bootstrap return (m = half the pooled episodes, 1000 trials), "
                f"train/validation MSE (mean over seeds)")

    by = {}  # per optimizer and trajectory count, its best setting (a sweep over hyperparameters: the best)
    for r in rows:
        k = (r["optimizer"], r["num_trajectories"])
        if k not in by or r["return_mean"] > by[k]["return_mean"]:
            by[k] = r
    deltas = []
    for gp in GPS:
        for n in sorted({k[1] for k in by}):
            base, dp = by.get((gp, n)), by.get((f"dopr_{gp}", n))
            if base and dp:
                deltas.append({"gp": gp, "num_trajectories": n, "gp_return": base["return_mean"],
                               "dopr_return": dp["return_mean"], "delta": dp["return_mean"] - base["return_mean"],
                               "delta_pct": 100 * (dp["return_mean"] - base["return_mean"]) / abs(base["return_mean"]),
                               "dopr_better": "yes" if dp["return_mean"] > base["return_mean"] else "no",
                               "quantile_bands_overlap": "yes" if dp["return_q10"] <= base["return_q90"]
                               and base["return_q10"] <= dp["return_q90"] else "no",
                               "seed_ranges_overlap": "yes" if dp["seed_return_min"] <= base["seed_return_max"]
                               and base["seed_return_min"] <= dp["seed_return_max"] else "no",
                               "gp_val_loss": base["val_loss"], "dopr_val_loss": dp["val_loss"],
                               "gp_lr": base["lr"], "dopr_lr": dp["lr"]})
    if deltas:
        write_table(deltas, ["gp", "num_trajectories", "gp_return", "dopr_return", "delta", "delta_pct", "dopr_better",
                             "quantile_bands_overlap", "seed_ranges_overlap", "gp_val_loss", "dopr_val_loss",
                             "gp_lr", "dopr_lr"],
                    out_dir / f"{task}_dopr_vs_gp", stamp, f"{env}: DoPr variant minus its GP (bootstrap mean return; where the sweep varies "
                    f"hyperparameters, each optimizer's best setting)")

    timing = []
    for opt_name in sorted({k[0] for k in cells}):
        ss = [s for (o, *_), v in cells.items() if o == opt_name for s in v]
        timing.append({"optimizer": opt_name, "jobs": len(ss),
                       "train_s_median": float(np.median([s["train_time_s"] for s in ss])),
                       "eval_s_median": float(np.median([s["eval_time_s"] for s in ss])),
                       "wall_s_median": float(np.median([s["wall_time_s"] for s in ss])),
                       "wall_s_max": float(np.max([s["wall_time_s"] for s in ss]))})
    write_table(timing, ["optimizer", "jobs", "train_s_median", "eval_s_median", "wall_s_median", "wall_s_max"],
                out_dir / f"{task}_timing", stamp,
                f"{env}: seconds per BC job (1000 steps + evaluation episodes), 1 torch thread per job")

    gps = [gp for gp in GPS if any(k[0] in (gp, f"dopr_{gp}") for k in by)]
    fig, axes = plt.subplots(3, len(gps), figsize=(3.6 * len(gps), 8.5), squeeze=False, sharex=True)
    for j, gp in enumerate(gps):
        for name, style in ((gp, "--"), (f"dopr_{gp}", "-")):
            pts = sorted((n, r) for (o, n), r in by.items() if o == name)
            if not pts:
                continue
            x = [n for n, _ in pts]
            line, = axes[0, j].plot(x, [r["return_q50"] for _, r in pts], style, marker="o", ms=3, label=name)
            axes[0, j].fill_between(x, [r["return_q10"] for _, r in pts], [r["return_q90"] for _, r in pts],
                                    color=line.get_color(), alpha=0.2)
            for i, key in ((1, "train_loss"), (2, "val_loss")):
                axes[i, j].plot(x, [r[key] for _, r in pts], style, marker="o", ms=3, color=line.get_color(), label=name)
        axes[0, j].set_title(gp)
        axes[0, j].legend(fontsize=7)
        axes[1, j].set_yscale("log")
        axes[2, j].set_yscale("log")
        axes[2, j].set_xlabel("number of trajectories")
    axes[0, 0].set_ylabel("return (bootstrap q10/q50/q90)")
    axes[1, 0].set_ylabel("train MSE")
    axes[2, 0].set_ylabel("validation MSE")
    fig.suptitle(f"{env} behaviour cloning (expert return {rows[0]['expert_return']:.0f})")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    stamp_figure(fig, stamp)
    fig.savefig(out_dir / f"{task}.png", dpi=150)
    plt.close(fig)
