import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def _compose(*overrides, hydra_config: bool = False):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


@pytest.fixture
def compose():
    """compose(*overrides, hydra_config=False): the suite's config as `python run.py <overrides>` builds it
    (with hydra_config=True also the `hydra` node, e.g. a sweep preset's sweeper params)."""
    pytest.importorskip("hydra")
    return _compose


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def demo_file(tmp_path_factory):
    """demo_file(env, n=3): a demonstration file of n episodes of a fixed random linear policy
    (written once per session and environment) for tests that need demonstrations."""
    pytest.importorskip("gymnasium")
    import numpy as np

    from experiments.bc import demos
    from experiments.bc.evaluate import rollout

    cache = {}

    def make(env: str, n: int = 3):
        if (env, n) not in cache:
            out = tmp_path_factory.mktemp("demos") / f"{env}.npz"
            w = None

            def policy(obs):
                nonlocal w
                if w is None:
                    act_dim = rollout.__globals__["make_env"](env).action_space.shape[0]
                    w = np.random.default_rng(0).normal(0, 0.1, (obs.shape[1], act_dim)).astype(np.float32)
                return np.tanh(obs @ w)

            traj = rollout(env, policy, n, seed=0, record=True)
            cache[(env, n)] = demos.write(out, env, traj, expert="random-linear")
        return cache[(env, n)]
    return make


pytest_plugins = ["require_optional"]   # make test: an importorskip skip fails the run (tests/require_optional.py)
