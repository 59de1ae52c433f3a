"""Demonstrations: roll out an expert into one file, and load that file or a local Minari dataset.

    python -m experiments.bc.expert demos --env Humanoid-v5 --n 60 --out data/demos/Humanoid-v5.npz
    (experiments/bc/expert.py rolls out the expert; --expert defaults to the committed
    experiments/bc/experts/<version>/<env>.pt)

File format (numpy .npz, compressed), version 1:
  format_version, env               scalars
  observations [T, obs], actions [T, act], rewards [T]     all episodes concatenated, float32
  lengths [N], returns [N], seeds [N]                       per episode (reset seed of episode i)
  expert                             the expert file it was rolled out from
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.common.provenance import atomic_write
from experiments.common.checks import ConfigError

FORMAT_VERSION = 1
FIELDS = ("observations", "actions", "rewards", "lengths", "returns", "seeds")


@dataclass
class Demos:
    env: str
    observations: list  # per episode [T_i, obs]
    actions: list        # per episode [T_i, act]
    rewards: list
    returns: np.ndarray
    seeds: np.ndarray

    def __len__(self) -> int:
        return len(self.observations)

    def split(self, n_train: int, n_val: int):
        """The first n_train episodes for training, the last n_val for validation (fixed across n_train)."""
        if n_train + n_val > len(self):
            raise ConfigError(f"asked for {n_train} training + {n_val} validation trajectories (task.num_trajectories, "
                              f"task.val_trajectories), but the demonstration file has only {len(self)}; write more with `python -m experiments.bc.expert demos --n ...`")
        return self._take(range(n_train)), self._take(range(len(self) - n_val, len(self)))

    def _take(self, idx) -> "Demos":
        idx = list(idx)
        return Demos(self.env, [self.observations[i] for i in idx], [self.actions[i] for i in idx],
                     [self.rewards[i] for i in idx], self.returns[idx], self.seeds[idx])


def write(path, env_id: str, traj: dict, expert: str = "") -> Path:
    """Write rolled-out episodes (experiments.bc.evaluate.rollout(..., record=True)) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: np.savez_compressed(
        tmp, format_version=FORMAT_VERSION, env=env_id, expert=str(expert),
        observations=np.concatenate(traj["observations"]), actions=np.concatenate(traj["actions"]),
        rewards=np.concatenate(traj["rewards"]), lengths=np.asarray(traj["lengths"], np.int64),
        returns=np.asarray(traj["returns"], np.float64), seeds=np.asarray(traj["seeds"], np.int64)))
    return path


def load(path, env_id: str | None = None) -> Demos:
    """A demonstration .npz written by `write`, or a Minari dataset directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"demonstration file not found: {path}. Write one with `python -m experiments.bc.expert demos --env "
            f"{env_id or '<env>'} --out {path}` (rolls out the committed expert), or point task.demos at a local "
            f"Minari dataset directory (the committed expert's demonstrations are written on first use only at "
            f"task.expert_demos, the default task.demos)")
    demos = _load_minari(path) if path.is_dir() else _load_npz(path)
    if env_id is not None and demos.env.split("/")[-1] != env_id and env_id not in demos.env:
        raise ValueError(f"{path} holds demonstrations for {demos.env!r}, not {env_id!r}")
    return demos


def _load_npz(path: Path) -> Demos:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("format_version", "env", *FIELDS) if k not in z.files]
            d = {k: z[k] for k in z.files if k in ("format_version", "env", *FIELDS)}
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:  # not a zip / truncated / pickled
        raise ValueError(f"corrupt demonstration file {path}: {e}") from e
    if missing:
        raise ValueError(f"corrupt demonstration file {path}: missing {missing}")
    if int(d["format_version"]) != FORMAT_VERSION:
        raise ValueError(f"demonstration file {path} has format_version {int(d['format_version'])}; "
                         f"this code reads version {FORMAT_VERSION}")
    env = str(d["env"])
    lengths = d["lengths"]
    total = int(lengths.sum())
    if (lengths <= 0).any() or any(len(d[k]) != total for k in ("observations", "actions", "rewards")) \
            or len(d["returns"]) != len(lengths):
        raise ValueError(f"corrupt demonstration file {path}: episode lengths sum to {total} but the arrays hold "
                         f"{len(d['observations'])} observations / {len(d['actions'])} actions")
    cut = np.cumsum(lengths)[:-1]
    split = lambda a: np.split(a, cut)
    return Demos(env, split(d["observations"]), split(d["actions"]), split(d["rewards"]), d["returns"], d["seeds"])


def _load_minari(path: Path) -> Demos:
    try:
        import minari
    except ImportError as e:
        raise ImportError(f"{path} is a directory (a Minari dataset?), but minari is not installed: "
                          f"pip install minari") from e
    data = path / "data" if (path / "data").is_dir() else path
    try:
        ds = minari.MinariDataset(data)
    except Exception as e:
        raise ValueError(f"cannot read {path} as a Minari dataset: {e}") from e
    obs, act, rew, seeds = [], [], [], []
    for ep in ds.iterate_episodes():
        obs.append(np.asarray(ep.observations, np.float32)[:-1])  # Minari stores T+1 observations
        act.append(np.asarray(ep.actions, np.float32))
        rew.append(np.asarray(ep.rewards, np.float32))
        seeds.append(-1 if ep.id is None else int(ep.id))
    if not obs:
        raise ValueError(f"Minari dataset {path} has no episodes")
    env = ds.spec.env_spec.id if ds.spec.env_spec is not None else str(ds.spec.dataset_id)
    return Demos(env, obs, act, rew, np.array([r.sum() for r in rew], np.float64), np.array(seeds))
