import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
