"""task=expert: train an SAC expert for one Gymnasium environment (the demonstrator for BC).

    python run.py task=expert task.env=Humanoid-v5 hydra.run.dir=outputs/expert/Humanoid-v5

Running the same command again (same hydra.run.dir) resumes from the last checkpoint: the SAC state
and optimizers go into checkpoint.pt, the replay buffer into replay.npz, both every
`checkpoint_every` steps. Every `eval_every` steps the deterministic policy is evaluated; the best one
so far is kept in actor_best.pt. At the end the best and the last actor are evaluated on
`final_eval_episodes` episodes and the better one is written to expert.pt (with its returns), the
file that demonstrations are rolled out from:

    python -m experiments.bc.expert publish outputs/expert/Humanoid-v5     # -> experiments/bc/experts/v1/
    python -m experiments.bc.expert demos --env Humanoid-v5 --n 60 --out data/demos/Humanoid-v5.npz

The registry of committed experts is experiments/bc/experts/<version>/<env>.{pt,json}.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from experiments.common import interrupt
from experiments.common.checkpoint import TrainingState
from experiments.common.provenance import atomic_write
from experiments.common.run import load_plain

from . import demos
from .evaluate import make_env, rollout
from .sac import SAC, ReplayBuffer

EXPERTS = Path(__file__).parent / "experts"
EXPERT_VERSION = "v1"


def expert_path(env_id: str, version: str = EXPERT_VERSION) -> Path:
    """The committed expert of an environment: experiments/bc/experts/<version>/<env>.pt."""
    return EXPERTS / version / f"{env_id}.pt"


def load_expert(path):
    """The actor of an expert file, ready to act on batched observations (numpy in, numpy out)."""
    from .sac import Actor

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"expert weights not found: {path} (train one with `python run.py task=expert "
                                f"task.env=<env>` or use the committed experiments/bc/experts/)")
    blob = load_plain(path, map_location="cpu")
    actor = Actor(blob["obs_dim"], blob["act_dim"], blob["hidden"], blob["act_low"], blob["act_high"])
    actor.load_state_dict(blob["actor"])
    actor.eval()
    return blob, actor


def policy_fn(actor, obs_slice=None):
    """numpy [n, obs] -> numpy [n, act]; the expert sees the first `obs_slice` coordinates (all if None)."""
    def act(obs: np.ndarray) -> np.ndarray:
        return actor.act(torch.from_numpy(obs[:, :obs_slice])).numpy()
    return act


def _save_actor(path: Path, agent: SAC, env_id: str, meta: dict) -> None:
    a = agent.actor
    blob = {"env": env_id, "obs_dim": a.net[0].in_features, "act_dim": a.net[-1].out_features // 2,
            "hidden": a.net[0].out_features, "act_low": (a.bias - a.scale).tolist(),
            "act_high": (a.bias + a.scale).tolist(), "actor": {k: v.clone() for k, v in a.state_dict().items()}, **meta}
    atomic_write(path, lambda p: torch.save(blob, p))


def run(cfg, run) -> dict:
    t = cfg.task
    if t.bf16_matmul:  # oneDNN bf16 GEMMs, fp32 accumulation: faster only with native bf16 (AVX512-BF16, AMX)
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    env = make_env(t.env)
    obs_slice = t.obs_slice  # Humanoid: the expert sees qpos/qvel only (BC still gets the full obs)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    obs_dim = min(obs_dim, obs_slice or obs_dim)
    view = lambda o: o[:obs_dim]
    agent = SAC(obs_dim, act_dim, env.action_space.low, env.action_space.high, hidden=t.hidden, lr=t.lr,
                gamma=t.gamma, tau=t.tau)
    buf = ReplayBuffer(int(t.buffer_size), obs_dim, act_dim)
    rng = np.random.default_rng(int(cfg.seed))
    torch.manual_seed(int(cfg.seed))
    replay_path = run.dir / "replay.npz"
    best_path, last_path = run.dir / "actor_best.pt", run.dir / "actor_last.pt"

    state = TrainingState(model=agent, generators={"sampling": rng})  # the SAC state holds its optimizers
    start, extra = state.resume(run)
    best, episode, ep_return = extra.get("best", -np.inf), extra.get("episode", 0), 0.0
    if start:
        buf.load(replay_path, start)
    # an episode in progress at the checkpoint is restarted (its transitions are in the buffer)
    obs, _ = env.reset(seed=int(cfg.seed) * 100_000 + episode)
    obs = view(obs)

    def checkpoint(step):
        buf.save(replay_path, step)
        state.save(run, step, best=best, episode=episode)

    bar = run.progress(t.total_steps, initial=start, desc=f"expert/{t.env}")
    tic, last_log, stats = time.time(), start, {}
    step = start
    for step in range(start + 1, t.total_steps + 1):
        if step <= t.learning_starts:
            action = rng.uniform(env.action_space.low, env.action_space.high).astype(np.float32)
        else:
            with torch.no_grad():
                action = agent.actor.sample(torch.from_numpy(obs.astype(np.float32))[None])[0][0].numpy()
        obs2, r, terminated, truncated, _ = env.step(action)
        obs2 = view(obs2)
        buf.add(obs, action, r, obs2, float(terminated))
        ep_return += r
        obs = obs2
        if terminated or truncated:
            episode += 1
            run.log({"episode_return": ep_return, "episode": episode}, step)
            ep_return = 0.0
            obs = view(env.reset(seed=int(cfg.seed) * 100_000 + episode)[0])
        if step > t.learning_starts:
            stats = agent.update(*buf.sample(t.batch_size, rng))
        if step % t.eval_every == 0:
            res = rollout(t.env, policy_fn(agent.actor, obs_dim), t.eval_episodes, seed=10_000_000 + step,
                          progress=f"evaluating: {t.eval_episodes} episodes")
            mean = float(res["returns"].mean())
            sps = (step - last_log) / (time.time() - tic)
            tic, last_log = time.time(), step
            run.log({"eval_return": mean, "eval_return_std": float(res["returns"].std()), "steps_per_s": sps,
                     **{k: float(v) for k, v in stats.items()}}, step)
            bar.set_postfix(eval_return=f"{mean:.0f}", sps=f"{sps:.0f}")
            if mean > best:
                best = mean
                _save_actor(best_path, agent, t.env, {"step": step, "eval_return_5": mean, "obs_slice": obs_dim})
            if t.stop_at_return is not None and mean >= t.stop_at_return:
                bar.update(step - bar.n)
                break
        if (t.checkpoint_every and step % t.checkpoint_every == 0) or interrupt.due():
            checkpoint(step)
        if step % 100 == 0:
            bar.update(step - bar.n)
    bar.close()
    _save_actor(last_path, agent, t.env, {"step": step, "obs_slice": obs_dim})

    # the expert: the better of the best-so-far and the last actor on final_eval_episodes fresh episodes
    finals = {}
    for name, path in (("best", best_path), ("last", last_path)):
        if path.exists():
            blob, actor = load_expert(path)
            res = rollout(t.env, policy_fn(actor, blob["obs_slice"]), t.final_eval_episodes, seed=20_000_000,
                          progress=f"final evaluation of the {name} actor: {t.final_eval_episodes} episodes")
            finals[name] = (float(res["returns"].mean()), float(res["returns"].std()), blob, res)
    name = max(finals, key=lambda k: finals[k][0])
    mean, std, blob, res = finals[name]
    blob.update({"return_mean": mean, "return_std": std, "eval_episodes": int(t.final_eval_episodes),
                 "eval_seed": 20_000_000, "train_steps": step, "source": name})
    torch.save(blob, run.dir / "expert.pt")
    print(f"expert {t.env}: {name} actor (step {blob['step']}), return {mean:.1f} +- {std:.1f} over "
          f"{t.final_eval_episodes} episodes -> {run.dir / 'expert.pt'}", flush=True)
    return {"env": t.env, "return_mean": mean, "return_std": std, "expert_step": blob["step"],
            "train_steps": step, "best_eval_return": best,
            **{f"return_mean_{k}": v[0] for k, v in finals.items()}}


def _training_time(metrics_path: Path):
    """SAC time summed over every launch of a resumed run: each evaluation row's steps since the
    previous one divided by the steps/s it logged (SAC alone: wall_time_s also counts the evaluations)."""
    import json

    if not metrics_path.exists():
        return None
    total, last = 0.0, 0
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        if "steps_per_s" in row:
            total += (row["step"] - last) / row["steps_per_s"]
            last = row["step"]
    return round(total, 1)


def generate_demos(env_id: str, n: int, out, expert=None, seed: int = 0) -> dict:
    """Roll out the expert's deterministic policy for n episodes (reset seeds seed..seed+n-1) into the
    demonstration file `out` (experiments/bc/demos.py's format)."""
    expert = Path(expert) if expert else expert_path(env_id)
    blob, actor = load_expert(expert)
    if blob["env"] != env_id:
        raise ValueError(f"expert {expert} was trained on {blob['env']}, not {env_id}")
    with torch.inference_mode():
        traj = rollout(env_id, policy_fn(actor, blob.get("obs_slice")), n, seed=seed, record=True,
                       progress=f"demonstrations: {n} episodes")
    demos.write(out, env_id, traj, expert=str(expert))
    return traj


def publish(run_dir, version: str = EXPERT_VERSION, root=None) -> Path:
    """Copy a finished expert run's expert.pt to experiments/bc/experts/<version>/<env>.pt, with
    <env>.json: its evaluation returns (mean, std, episodes), training steps, command and commit."""
    import json

    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{run_dir} has no summary.json: the expert run has not finished")
    summary = json.loads(summary_path.read_text())
    blob = load_plain(run_dir / "expert.pt", map_location="cpu")
    out = Path(root or EXPERTS) / version
    out.mkdir(parents=True, exist_ok=True)
    torch.save(blob, out / f"{blob['env']}.pt")
    overrides = (run_dir / ".hydra" / "overrides.yaml")
    command = "python run.py " + " ".join(
        l.strip("- \n") for l in overrides.read_text().splitlines() if l.strip()) if overrides.exists() else ""
    meta = {"env": blob["env"], "return_mean": blob["return_mean"], "return_std": blob["return_std"],
            "eval_episodes": blob["eval_episodes"], "eval_seed": blob["eval_seed"], "expert_step": blob["step"],
            "train_steps": blob["train_steps"], "obs_slice": blob.get("obs_slice"), "command": command,
            "commit": summary.get("git_revision"), "train_time_s": _training_time(run_dir / "metrics.jsonl"),
            "wall_time_s": summary.get("wall_time_s")}   # all launches, to the last one's end
    (out / f"{blob['env']}.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out / f"{blob['env']}.pt"


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Publish a finished expert run, or roll an expert out into demonstrations.")
    sub = p.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="copy <run dir>/expert.pt to experiments/bc/experts/<version>/<env>.{pt,json}")
    pub.add_argument("run_dir")
    dem = sub.add_parser("demos", help="roll out an expert into one demonstration file")
    dem.add_argument("--env", required=True)
    dem.add_argument("--n", type=int, default=60, help="episodes (BC uses up to 50 for training + 10 validation)")
    dem.add_argument("--out", required=True)
    dem.add_argument("--expert", default=None, help=f"expert .pt (default: {EXPERTS}/{EXPERT_VERSION}/<env>.pt)")
    dem.add_argument("--seed", type=int, default=0, help="episode i is reset with seed + i")
    a = p.parse_args(argv)
    if a.command == "publish":
        print(publish(a.run_dir))
        return
    traj = generate_demos(a.env, a.n, a.out, a.expert, a.seed)
    r = traj["returns"]
    print(f"{a.n} episodes of {a.env} -> {a.out}: return {r.mean():.1f} +- {r.std():.1f}, "
          f"{int(traj['lengths'].sum())} transitions")


if __name__ == "__main__":
    main()
