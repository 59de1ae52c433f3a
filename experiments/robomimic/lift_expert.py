"""A scripted Panda Lift expert: image demonstrations with absolute actions, made without a download.

    python -m experiments.robomimic.lift_expert --n 40 --out data/robomimic/lift/image_abs.hdf5

The environment is robomimic's Lift image setting (ARISE-Initiative/robomimic
``robomimic/scripts/dataset_states_to_obs.py`` and the env_args of its ``lift/ph/image.hdf5``):
robosuite ``Lift``, one Panda, OSC_POSE arm with robosuite's default gains (kp 150, critically
damped), control_freq 20, sparse reward, cameras ``agentview`` and ``robot0_eye_in_hand`` at 84 x 84.
The controller takes absolute world-frame targets (``input_type`` "absolute", ``input_ref_frame``
"world"), so an action is [position (3), axis-angle (3), gripper (1)] in the frame of
``robot0_eef_pos``, as in the diffusion-policy ``image_abs.hdf5`` files (real-stanford/diffusion_policy
``diffusion_policy/common/robomimic_util.py`` ``RobomimicAbsoluteActionConverter`` stores the
controller's goal position and rotation vector, world-frame in robosuite 1.2). The base frame,
robosuite 1.5's default and what ENVIRONMENT.md's replay used, works as well; world keeps actions and
``robot0_eef_pos`` in one frame. The gripper is -1 open, +1 closed (robosuite ``GRIP``).

The expert moves a target pose toward one waypoint per phase, at most ``SPEED`` per step, and
sends the target itself as the action: above the cube, down to it, close the gripper, lift.
Every recorded action is therefore exactly what the environment executed, and replaying the
actions from ``states[0]`` in an environment built from the returned ``env_args`` repeats the demo
(MuJoCo is deterministic). Only successful demos are kept; a demo ends at the first step at which
``env._check_success()`` holds (robomimic's ph demos stop at task completion).

Each demo stores robomimic's keys: ``obs`` (upright uint8 (T, H, W, 3) images, as robomimic's
``EnvRobosuite.get_observation`` flips them into its files, and float32 low-dim ``robot0_eef_pos``,
``robot0_eef_quat``, ``robot0_gripper_qpos``, ``object``), ``actions``, ``states``
(``env.sim.get_state().flatten()`` before each action), ``rewards`` and ``dones`` (1 at the last
step). ``env_args`` records the robosuite version and the construction seed, which fixes Lift's
cube size (part of the model, not of the state). Images are rendered with ``env.py``'s
``fast_render`` (no multisampling, no reflection); see that module.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.spatial.transform import Rotation
from tqdm import tqdm

from .env import make_env, observation, seed_episode

CAMERAS = ("agentview_image", "robot0_eye_in_hand_image")
LOW_DIM_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object")

#: expert constants: target speed (m per step at 20 Hz), hover height, lift height, closing steps
SPEED = 0.015
HOVER = 0.08
LIFT = 0.15
CLOSE_STEPS = 12
REACHED = 0.01
OPEN, CLOSED = -1.0, 1.0


def lift_env_args(cameras=CAMERAS, image_size: int = 84, seed: int = 0) -> dict:
    """robomimic-style env_args of Lift with an absolute world-frame OSC_POSE arm (robosuite 1.5)."""
    import robosuite
    from robosuite.controllers import load_composite_controller_config

    controller = load_composite_controller_config(controller="BASIC", robot="Panda")
    controller["body_parts"] = {"right": {**controller["body_parts"]["right"], "input_type": "absolute",
                                          "input_ref_frame": "world"}}
    env_kwargs = {
        "has_renderer": False, "has_offscreen_renderer": True, "ignore_done": True, "use_object_obs": True,
        "use_camera_obs": True, "control_freq": 20, "controller_configs": controller, "robots": ["Panda"],
        "camera_depths": False, "camera_heights": image_size, "camera_widths": image_size,
        "reward_shaping": False, "camera_names": [key[: -len("_image")] for key in cameras], "seed": seed,
    }
    return {"env_name": "Lift", "type": 1, "env_version": robosuite.__version__, "env_kwargs": env_kwargs}


class LiftExpert:
    """Four phases (hover, descend, close, lift) of a target pose that the arm tracks."""

    def __init__(self, env) -> None:
        self.env = env
        self.site = env.robots[0].eef_site_id["right"]
        self.target = np.array(env.sim.data.site_xpos[self.site])
        self.rotvec = Rotation.from_matrix(env.sim.data.site_xmat[self.site].reshape(3, 3)).as_rotvec()
        self.phase, self.gripper, self.closing, self.grasp = "hover", OPEN, 0, None

    def _cube(self) -> np.ndarray:
        return np.array(self.env.sim.data.body_xpos[self.env.cube_body_id])

    def _waypoint(self) -> np.ndarray:
        cube = self._cube()
        if self.phase == "hover":
            return cube + [0.0, 0.0, HOVER]
        if self.phase in ("descend", "close"):
            return cube if self.grasp is None else self.grasp
        return self.grasp + [0.0, 0.0, LIFT]

    def action(self) -> np.ndarray:
        eef = np.array(self.env.sim.data.site_xpos[self.site])
        waypoint = self._waypoint()
        reached = np.linalg.norm(eef - waypoint) < REACHED
        if self.phase == "hover" and reached:
            self.phase = "descend"
        elif self.phase == "descend" and reached:
            self.phase, self.grasp = "close", self._cube()
        elif self.phase == "close":
            self.gripper, self.closing = CLOSED, self.closing + 1
            if self.closing >= CLOSE_STEPS:
                self.phase = "lift"
        step = self._waypoint() - self.target
        norm = np.linalg.norm(step)
        self.target = self.target + (step if norm <= SPEED else step * (SPEED / norm))
        return np.concatenate([self.target, self.rotvec, [self.gripper]])


def run_demo(env, keys, max_steps: int = 200) -> dict | None:
    """One expert episode from the environment's current state; None if it does not succeed."""
    raw = env._get_observations(force_update=True)
    expert = LiftExpert(env)
    steps: dict[str, list] = {"obs": [], "actions": [], "states": [], "rewards": []}
    for _ in range(max_steps):
        steps["obs"].append(observation(raw, keys, channels_first=False))
        steps["states"].append(np.array(env.sim.get_state().flatten()))
        action = expert.action()
        raw, reward, _, _ = env.step(action)
        steps["actions"].append(action)
        steps["rewards"].append(reward)
        if env._check_success():
            length = len(steps["actions"])
            dones = np.zeros(length, dtype=np.int64)
            dones[-1] = 1
            return {"obs": {key: np.stack([o[key] for o in steps["obs"]]) for key in keys},
                    "actions": np.stack(steps["actions"]), "states": np.stack(steps["states"]),
                    "rewards": np.asarray(steps["rewards"], dtype=np.float64), "dones": dones}
    return None


def collect(n_demos: int, seed: int = 0, cameras=CAMERAS, image_size: int = 84, max_steps: int = 200,
            max_attempts: int | None = None, fast_render: bool = True, stats: dict | None = None):
    """``n_demos`` successful expert demos -> (demos, env_args). Attempt ``i`` starts from the initial
    state seeded by (seed, i), as ``env.rollout`` seeds episode i. ``stats`` (a dict) receives
    attempts, successes and seconds."""
    if n_demos < 1:
        raise ValueError(f"n_demos must be at least 1, got {n_demos}")
    max_attempts = 2 * n_demos + 10 if max_attempts is None else max_attempts
    env_args = lift_env_args(cameras, image_size, seed)
    env = make_env(env_args, cameras, image_size, absolute_actions=True, fast_render=fast_render)
    keys = list(cameras) + list(LOW_DIM_KEYS)
    demos, attempt, tic = [], 0, time.perf_counter()
    bar = tqdm(total=n_demos, desc="Lift demonstrations", unit="demo", mininterval=1.0, dynamic_ncols=True)
    try:
        while len(demos) < n_demos and attempt < max_attempts:
            seed_episode(env, seed, attempt)
            env.reset()
            demo = run_demo(env, keys, max_steps)
            attempt += 1
            if demo is not None:
                demos.append(demo)
                bar.update(1)
            bar.set_postfix(attempts=attempt)
    finally:
        bar.close()
        env.close()
    if stats is not None:
        stats.update(attempts=attempt, successes=len(demos), seconds=time.perf_counter() - tic)
    if len(demos) < n_demos:
        raise RuntimeError(f"the Lift expert succeeded {len(demos)} times in {attempt} attempts; {n_demos} wanted")
    return demos, env_args


def split_names(n_demos: int, valid_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """Random train / valid demo names; the valid split has round(valid_fraction * n) demos."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    order = np.random.default_rng(seed).permutation(n_demos)
    n_valid = int(round(valid_fraction * n_demos))
    valid = sorted(int(i) for i in order[:n_valid])
    train = sorted(int(i) for i in order[n_valid:])
    return [f"demo_{i}" for i in train], [f"demo_{i}" for i in valid]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40, help="successful demos to keep")
    parser.add_argument("--out", default="data/robomimic/lift/image_abs.hdf5")
    parser.add_argument("--valid-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=84)
    parser.add_argument("--compression", default="gzip", help="hdf5 filter for the images ('none': raw)")
    args = parser.parse_args(argv)

    from .data import write_demo_file

    stats: dict = {}
    demos, env_args = collect(args.n, seed=args.seed, image_size=args.image_size, stats=stats)
    train, valid = split_names(len(demos), args.valid_fraction, args.seed)
    compression = None if args.compression == "none" else args.compression
    path = write_demo_file(args.out, demos, env_args, train_mask=train, valid_mask=valid, compression=compression)
    steps = sum(len(d["actions"]) for d in demos)
    print(f"{path}: {len(demos)} demos ({len(train)} train, {len(valid)} valid), {steps} steps; expert succeeded "
          f"{stats['successes']}/{stats['attempts']} attempts in {stats['seconds']:.1f} s")


if __name__ == "__main__":
    main()
