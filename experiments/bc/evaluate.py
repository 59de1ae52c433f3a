"""Rollouts of a policy in a batch of Gymnasium environments (the paper's bootstrap over their returns
is experiments.common.stats.bootstrap).

`rollout` steps N environments side by side and queries the policy once per time step for all the
episodes still running (one batched forward), which is what makes 100 evaluation episodes cheap.
The same function records demonstrations (`record=True`).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
from tqdm import tqdm


def make_env(env_id: str):
    import gymnasium as gym

    try:
        return gym.make(env_id)
    except gym.error.Error as e:
        raise ValueError(f"cannot make Gymnasium environment {env_id!r}: {e}") from e


def rollout(env_id: str, policy: Callable[[np.ndarray], np.ndarray], n_episodes: int, seed: int,
            batch: Optional[int] = None, record: bool = False, progress: Optional[str] = None) -> dict:
    """Run n_episodes (episode i reset with seed + i), `batch` environments at a time (default: all);
    with `progress`, a bar of that name over the episodes' environment steps.

    Returns returns [n], lengths [n], seeds [n]; with record=True also per-episode lists of
    observations [T, obs], actions [T, act] and rewards [T].
    """
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    batch = min(batch or n_episodes, n_episodes)
    envs = [make_env(env_id) for _ in range(batch)]
    low, high = envs[0].action_space.low, envs[0].action_space.high
    horizon = envs[0].spec.max_episode_steps or 1000
    bar = tqdm(total=n_episodes * horizon, desc=progress, disable=progress is None, leave=False, mininterval=1.0,
               unit="step", dynamic_ncols=True)
    returns = np.zeros(n_episodes)
    lengths = np.zeros(n_episodes, dtype=np.int64)
    traj = {"observations": [None] * n_episodes, "actions": [None] * n_episodes, "rewards": [None] * n_episodes}
    next_episode = 0
    slots = {}  # env index -> (episode index, current obs, buffers)

    def start(j):
        nonlocal next_episode
        i = next_episode
        next_episode += 1
        obs, _ = envs[j].reset(seed=seed + i)
        slots[j] = [i, obs, [], [], []]

    for j in range(batch):
        start(j)
    while slots:
        active = sorted(slots)
        obs = np.stack([slots[j][1] for j in active]).astype(np.float32)
        actions = np.clip(np.asarray(policy(obs), dtype=np.float32), low, high)
        bar.update(len(active))
        for k, j in enumerate(active):
            i, o, bo, ba, br = slots[j]
            o2, r, terminated, truncated, _ = envs[j].step(actions[k])
            returns[i] += r
            lengths[i] += 1
            if record:
                bo.append(o)
                ba.append(actions[k])
                br.append(r)
            slots[j][1] = o2
            if terminated or truncated:
                if record:
                    traj["observations"][i] = np.asarray(bo, np.float32)
                    traj["actions"][i] = np.asarray(ba, np.float32)
                    traj["rewards"][i] = np.asarray(br, np.float32)
                del slots[j]
                bar.update(max(horizon - int(lengths[i]), 0))   # the steps an early end skips
                if next_episode < n_episodes:
                    start(j)
    bar.close()
    for e in envs:
        e.close()
    out = {"returns": returns, "lengths": lengths, "seeds": seed + np.arange(n_episodes)}
    if record:
        out.update(traj)
    return out
