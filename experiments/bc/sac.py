"""Soft Actor-Critic (Haarnoja et al. 2018, automatic temperature) for the BC experts.

The paper's BC experiments need demonstrations; with no D4RL/Minari copy, `task=expert` trains an
SAC expert per environment. Hot path: one gradient step = critic + actor + temperature updates. The
twin critics are one ensemble (batched matmuls over a leading dimension of 2), so a critic forward is
three baddbmm calls instead of six Linear layers; the target update is one fused foreach lerp.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """Tanh-squashed Gaussian policy; `act(obs)` is the deterministic (mean) action used as expert."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, act_low=None, act_high=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 2 * act_dim))
        low = torch.as_tensor(act_low if act_low is not None else -torch.ones(act_dim), dtype=torch.float32)
        high = torch.as_tensor(act_high if act_high is not None else torch.ones(act_dim), dtype=torch.float32)
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("bias", (high + low) / 2)

    def forward(self, obs):
        mean, log_std = self.net(obs).chunk(2, -1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1)
        return mean, log_std

    def sample(self, obs):
        """Reparameterised action and its log-probability under the squashed Gaussian."""
        mean, log_std = self(obs)
        std = log_std.exp()
        eps = torch.randn_like(mean)
        u = mean + std * eps
        a = torch.tanh(u)
        # log N(u; mean, std) - sum log(scale * (1 - tanh(u)^2)), the latter in a stable form
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1) - torch.log(self.scale).sum()
        return a * self.scale + self.bias, logp

    @torch.no_grad()
    def act(self, obs):
        mean, _ = self(obs)
        return torch.tanh(mean) * self.scale + self.bias


class EnsembleLinear(nn.Module):
    def __init__(self, n: int, d_in: int, d_out: int):
        super().__init__()
        bound = 1 / math.sqrt(d_in)  # nn.Linear's default initialisation, per member
        self.weight = nn.Parameter(torch.empty(n, d_in, d_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n, 1, d_out).uniform_(-bound, bound))

    def forward(self, x):  # x: [n, B, d_in]
        return torch.baddbmm(self.bias, x, self.weight)


class TwinQ(nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 256, n: int = 2):
        super().__init__()
        self.n = n
        self.l1 = EnsembleLinear(n, obs_dim + act_dim, hidden)
        self.l2 = EnsembleLinear(n, hidden, hidden)
        self.l3 = EnsembleLinear(n, hidden, 1)

    def forward(self, obs, act):  # -> [n, B]
        x = torch.cat([obs, act], -1).unsqueeze(0).expand(self.n, -1, -1)
        return self.l3(F.relu(self.l2(F.relu(self.l1(x))))).squeeze(-1)


class SAC:
    def __init__(self, obs_dim, act_dim, act_low, act_high, hidden=256, lr=3e-4, gamma=0.99, tau=0.005,
                 device="cpu"):
        self.actor = Actor(obs_dim, act_dim, hidden, act_low, act_high).to(device)
        self.critic = TwinQ(obs_dim, act_dim, hidden).to(device)
        self.target = TwinQ(obs_dim, act_dim, hidden).to(device)
        self.target.load_state_dict(self.critic.state_dict())
        self.target.requires_grad_(False)
        self.log_alpha = torch.zeros((), device=device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.gamma, self.tau = gamma, tau
        adam = lambda params: torch.optim.Adam(params, lr=lr, fused=True)  # fused: one kernel per step on CPU too
        self.actor_opt = adam(self.actor.parameters())
        self.critic_opt = adam(self.critic.parameters())
        self.alpha_opt = adam([self.log_alpha])
        self._tgt, self._src = list(self.target.parameters()), list(self.critic.parameters())

    def update(self, obs, act, rew, next_obs, done) -> dict:
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_a, next_logp = self.actor.sample(next_obs)
            q_next = self.target(next_obs, next_a).min(0).values - alpha * next_logp
            y = rew + self.gamma * (1 - done) * q_next
        q = self.critic(obs, act)
        critic_loss = 0.5 * (q - y).pow(2).mean(1).sum()
        self.critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_opt.step()

        self.critic.requires_grad_(False)
        a, logp = self.actor.sample(obs)
        actor_loss = (alpha * logp - self.critic(obs, a).min(0).values).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()
        self.critic.requires_grad_(True)

        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(self._tgt, self._src, self.tau)
        return {"critic_loss": critic_loss.detach(), "actor_loss": actor_loss.detach(), "alpha": alpha,
                "entropy": -logp.detach().mean()}

    def state_dict(self) -> dict:
        return {k: getattr(self, k).state_dict() for k in
                ("actor", "critic", "target", "actor_opt", "critic_opt", "alpha_opt")} | {"log_alpha": self.log_alpha.detach().clone()}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("actor", "critic", "target", "actor_opt", "critic_opt", "alpha_opt"):
            getattr(self, k).load_state_dict(sd[k])
        with torch.no_grad():
            self.log_alpha.copy_(sd["log_alpha"])


class ReplayBuffer:
    """Flat float32 numpy arrays; `state()`/`load()` hold only the filled part (for checkpoints)."""

    def __init__(self, capacity: int, obs_dim: int, act_dim: int):
        import numpy as np

        self.capacity, self.size, self.pos = capacity, 0, 0
        self.obs = np.zeros((capacity, obs_dim), np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), np.float32)
        self.act = np.zeros((capacity, act_dim), np.float32)
        self.rew = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, np.float32)

    def add(self, obs, act, rew, next_obs, terminated) -> None:
        i = self.pos
        self.obs[i], self.act[i], self.rew[i], self.next_obs[i], self.done[i] = obs, act, rew, next_obs, terminated
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch: int, rng):
        idx = rng.integers(0, self.size, batch)
        t = torch.from_numpy
        return t(self.obs[idx]), t(self.act[idx]), t(self.rew[idx]), t(self.next_obs[idx]), t(self.done[idx])

    FIELDS = ("obs", "next_obs", "act", "rew", "done")

    def save(self, path, step: int) -> None:
        """Write the filled part to `path` (.npz) atomically, tagged with the training step."""
        import numpy as np

        from experiments.common.provenance import atomic_write

        n = self.size
        atomic_write(path, lambda tmp: np.savez(tmp, step=step, size=n, pos=self.pos,
                                                **{k: getattr(self, k)[:n] for k in self.FIELDS}))

    def load(self, path, step: int) -> None:
        import numpy as np

        with np.load(path) as z:
            if int(z["step"]) != step:
                raise RuntimeError(f"{path} holds the replay buffer of step {int(z['step'])}, but the checkpoint "
                                   f"is at step {step}; delete both to restart")
            n = int(z["size"])
            self.size, self.pos = n, int(z["pos"])
            for k in self.FIELDS:
                getattr(self, k)[:n] = z[k]
