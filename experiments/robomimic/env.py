"""Robosuite environments rebuilt from a dataset's ``env_args``, stepped side by side, and the rollout.

PyPI robomimic (0.3.0) cannot wrap robosuite 1.5 (its env module imports mujoco_py), so this module
reads ``env_args`` and calls ``robosuite.make`` itself. Where each convention comes from
(repository: file):

- ARISE-Initiative/robomimic, ``robomimic/envs/env_robosuite.py`` ``EnvRobosuite``: the env_args
  schema (``env_name``, ``type``, ``env_kwargs``) and the keyword overrides (no on-screen renderer,
  offscreen rendering and camera observations only when images are used, ``ignore_done``,
  ``use_object_obs``, no depth); images flipped with ``[::-1]`` because robosuite renders in
  OpenGL's bottom-up row order (robosuite ``macros.IMAGE_CONVENTION = "opengl"``; this module flips
  only under that convention); the ``object`` observation is robosuite's ``object-state``; success
  is ``env._check_success()``.
- robosuite 1.5 ``controllers/composite/composite_controller_factory.py``
  ``refactor_composite_controller_config``: a robosuite <= 1.4 part config (``{"type": "OSC_POSE",
  ...}``, what the official robomimic files store) becomes the robot's default composite config
  (``controllers/config/robots/default_<robot>.json``, type BASIC) with the arm parts replaced by
  the old settings plus a ``GRIP`` gripper. The old keys are renamed as robosuite 1.5's
  ``controllers/parts/arm/osc.py`` names them (``damping`` -> ``damping_ratio``, ``damping_limits``
  -> ``damping_ratio_limits``; ``control_delta`` True / False -> ``input_type`` "delta" /
  "absolute"), ``input_ref_frame`` becomes "world" (robosuite <= 1.4 goals were world-frame; 1.5
  defaults to the robot base frame) and ``lite_physics`` False (robosuite 1.5 ``environments/base.py``
  documents it as the setting that keeps datasets from robosuite <= 1.4.1 reproducible).
- real-stanford/diffusion_policy, ``diffusion_policy/env_runner/robomimic_image_runner.py``:
  ``abs_action`` sets ``control_delta = False`` (here: every arm part's ``input_type = "absolute"``);
  ``hard_reset = False`` (a hard reset rebuilds the model, the simulator and the renderer on every
  episode); the policy sees the last ``n_obs_steps`` observations and executes ``n_action_steps``
  actions per call; test episodes are seeded (``test_start_seed + i``) and the seed fixes the initial
  state (``robomimic_image_wrapper.py``).
- real-stanford/diffusion_policy, ``diffusion_policy/gym_util/multistep_wrapper.py``
  ``MultiStepWrapper``: the observation history is padded at reset by repeating the first
  observation.

Seeding: robosuite 1.5 draws the object placement and the robot's initial joint noise from the
environment's ``np.random.Generator`` (``env.rng``, shared with the placement sampler). Episode
``i`` of a rollout re-seeds that generator in place from ``(seed, i)`` before ``reset``, so its
initial state does not depend on which environment runs it or on ``n_envs``. Lift's cube size is
drawn once when the model is built (it is part of the model, not of the flattened simulator state);
every environment here is built with the same seed, ``env_kwargs["seed"]`` when the file records
one (``lift_expert.py`` does, so evaluation uses the demos' cube), else the rollout's ``seed``. With
``hard_reset = False`` it is not redrawn per episode, as in diffusion_policy.

Rendering speed (``fast_render``, ENVIRONMENT.md "Robomimic and SiT facts"): MuJoCo's offscreen
buffer renders with 4x multisampling (``model.vis.quality.offsamples``) and a reflection pass for
the reflective table. Turning both off (offsamples 0, rebuilt in the existing GL context, and the
``mjRND_REFLECTION`` scene flag) changes Lift's 84 x 84 images by a mean 1.5 / 255 (agentview; 9 %
of pixels, all on object edges and the table reflection) and 1.0 / 255 (eye-in-hand; 3 %), with no
visible change to the scene. Measured here (one render thread, a 2-core machine busy with other
jobs), Lift with both cameras, env steps/s of stepping alone: 8.9 with the defaults, 24 without the
reflection, 17 without multisampling, 37 without both; of ``rollout`` (2 envs x 40 steps, resets
included): 5.9 with the defaults, 33-35 fast; 151 without cameras. ``lift_expert.py`` renders its
data the same way; pass ``fast_render=False`` to evaluate a policy trained on the official
(multisampled) files.
"""
from __future__ import annotations

import os

# headless offscreen rendering (Mesa's EGL, one render thread) unless the user chose otherwise; set
# before robosuite or mujoco is first imported
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

import copy  # noqa: E402
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

#: robosuite <= 1.4 part-controller key names and their robosuite 1.5 spelling
LEGACY_CONTROLLER_KEYS = {"damping": "damping_ratio", "damping_limits": "damping_ratio_limits"}
ARM_CONTROLLER_TYPES = ("OSC_POSE", "OSC_POSITION", "IK_POSE", "JOINT_POSITION", "JOINT_VELOCITY", "JOINT_TORQUE")
ARM_PARTS = ("right", "left")


# ------------------------------------------------------------------------------ controllers
def _robots(env_kwargs: Mapping) -> list[str]:
    robots = env_kwargs.get("robots", ["Panda"])
    return [robots] if isinstance(robots, str) else list(robots)


def _modern_arm_config(config: Mapping) -> dict:
    """An arm config in robosuite 1.5 spelling; one with the old ``control_delta`` key keeps the old
    world-frame goals unless it names ``input_ref_frame``."""
    arm = {LEGACY_CONTROLLER_KEYS.get(key, key): copy.deepcopy(value) for key, value in config.items()}
    if "control_delta" in arm:
        arm["input_type"] = "delta" if arm.pop("control_delta") else "absolute"
        arm.setdefault("input_ref_frame", "world")
    return arm


def is_legacy_controller_config(config: Mapping) -> bool:
    """A robosuite <= 1.4 part config: a ``type`` naming a part controller and no ``body_parts``."""
    return "body_parts" not in config and config.get("type") in ARM_CONTROLLER_TYPES


def composite_controller_config(env_kwargs: Mapping, absolute_actions: bool | None = True) -> dict:
    """The robosuite 1.5 composite controller config for ``env_kwargs``' ``controller_configs``
    (either format). ``absolute_actions`` True / False sets every arm part's ``input_type`` to
    "absolute" / "delta"; None keeps what the config says."""
    config = env_kwargs["controller_configs"]
    if is_legacy_controller_config(config):
        from robosuite.controllers import load_composite_controller_config

        composite = load_composite_controller_config(robot=_robots(env_kwargs)[0])
        arms = [part for part in ARM_PARTS if part in composite["body_parts"]] or ["right"]
        for part in arms:
            composite["body_parts"][part] = {**_modern_arm_config(config), "gripper": {"type": "GRIP"}}
    elif "body_parts" in config:
        composite = copy.deepcopy(dict(config))
        parts = dict(composite["body_parts"])
        parts.update(parts.pop("arms", {}))   # robosuite's json files nest arms; make() wants them flat
        composite["body_parts"] = {name: _modern_arm_config(part) if name in ARM_PARTS else part
                                   for name, part in parts.items()}
    else:
        raise ValueError(f"controller_configs is neither a robosuite 1.5 composite config (no 'body_parts') "
                         f"nor a part config (type {config.get('type')!r} not in {ARM_CONTROLLER_TYPES})")
    if absolute_actions is not None:
        for name in ARM_PARTS:
            part = composite["body_parts"].get(name)
            if part is None:
                continue
            if part.get("type") not in ("OSC_POSE", "OSC_POSITION"):
                raise ValueError(f"absolute_actions={absolute_actions} needs an OSC arm controller; arm {name!r} "
                                 f"has {part.get('type')!r} (pass absolute_actions=None to keep it as it is)")
            part["input_type"] = "absolute" if absolute_actions else "delta"
    return composite


# ------------------------------------------------------------------------------ environments
def camera_name(key: str) -> str:
    """``agentview_image`` -> ``agentview``."""
    if not key.endswith("_image"):
        raise ValueError(f"camera observation keys end in '_image', got {key!r}")
    return key[: -len("_image")]


def make_env(env_args: Mapping, cameras: Sequence[str] = (), image_size: int | None = None,
             absolute_actions: bool | None = True, render: bool = True, seed: int | None = None,
             fast_render: bool = True):
    """A robosuite environment as ``env_args`` describes it, rendering the camera observation keys
    ``cameras`` (``agentview_image``, ...) at ``image_size`` (default: the file's camera size, else 84).
    ``render`` False builds no renderer at all (low-dim observations only). ``seed`` seeds the
    construction (Lift's cube size) and the first reset; None takes ``env_kwargs["seed"]`` if the
    file records one (``lift_expert.py`` does)."""
    import robosuite

    if env_args.get("type", 1) != 1:
        raise ValueError(f"env_args type {env_args.get('type')} is not robosuite (robomimic EnvType 1)")
    kwargs = copy.deepcopy(dict(env_args["env_kwargs"]))
    legacy = is_legacy_controller_config(kwargs["controller_configs"])
    kwargs["controller_configs"] = composite_controller_config(kwargs, absolute_actions)
    if legacy:
        kwargs.setdefault("lite_physics", False)
    names = [camera_name(key) for key in cameras]
    offscreen = bool(render and names)
    size = image_size or kwargs.get("camera_heights", 84)
    size = size[0] if isinstance(size, list | tuple) else size
    for key in ("render_gpu_device_id", "camera_depth", "env_version"):
        kwargs.pop(key, None)
    kwargs.update(has_renderer=False, has_offscreen_renderer=offscreen, use_camera_obs=offscreen,
                  camera_depths=False, ignore_done=True, use_object_obs=True, hard_reset=False,
                  seed=kwargs.get("seed") if seed is None else seed)
    if offscreen:
        kwargs.update(camera_names=names, camera_heights=int(size), camera_widths=int(size))
    else:
        for key in ("camera_names", "camera_heights", "camera_widths"):
            kwargs.pop(key, None)
    env = robosuite.make(env_args["env_name"], **kwargs)
    if offscreen:
        env.reset()                     # creates the offscreen render context
        if fast_render:
            disable_costly_rendering(env)
    return env


def disable_costly_rendering(env) -> None:
    """Offscreen multisampling off (the MjrContext is rebuilt in its own GL context) and the
    reflection pass off; see the module docstring for what this changes and what it buys."""
    import mujoco

    context = env.sim._render_context_offscreen
    if context is None:
        raise RuntimeError("the environment has no offscreen render context yet (reset it first)")
    context.gl_ctx.make_current()
    env.sim.model.vis.quality.offsamples = 0
    context.con.free()
    context._set_mujoco_context_and_buffers()
    context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0


def upright(image: np.ndarray) -> np.ndarray:
    """A robosuite camera image (H, W, 3) with row 0 at the top."""
    from robosuite.macros import IMAGE_CONVENTION

    return image[::-1] if IMAGE_CONVENTION == "opengl" else image


def observation(raw_obs: Mapping, keys: Sequence[str], channels_first: bool = True) -> dict[str, np.ndarray]:
    """robosuite observations -> {key: array}: ``*_image`` upright uint8 (3, H, W) (or (H, W, 3) with
    ``channels_first`` False), ``object`` from ``object-state``, every other key float32."""
    out = {}
    for key in keys:
        if key.endswith("_image"):
            image = upright(np.asarray(raw_obs[key], dtype=np.uint8))
            out[key] = np.ascontiguousarray(image.transpose(2, 0, 1) if channels_first else image)
        else:
            out[key] = np.asarray(raw_obs["object-state" if key == "object" else key], dtype=np.float32)
    return out


def seed_episode(env, seed: int, episode: int) -> None:
    """Re-seed ``env.rng`` in place (the placement sampler and robot noise hold the same object)."""
    env.rng.bit_generator.state = np.random.default_rng([seed, episode]).bit_generator.state


def reset_to(env, state: np.ndarray) -> dict:
    """Set the flattened simulator ``state`` (robomimic's ``reset_to``) and re-anchor the controllers
    there: robosuite's OSC pulls the arm toward the joint angles it was built at (nullspace posture
    ``initial_joint``, set at reset), so without this a replay from a demo's ``states[0]`` drifts by
    centimetres from the demo. Returns the raw observations."""
    env.sim.set_state_from_flattened(np.asarray(state))
    env.sim.forward()
    for robot in env.robots:
        for controller in robot.part_controllers.values():
            controller.update_initial_joints(env.sim.data.qpos[controller.qpos_index])
        robot.composite_controller.reset()
    return env._get_observations(force_update=True)


class VectorEnv:
    """``n_envs`` environments stepped one after another in this process, each with a history of its
    last ``obs_steps`` observations (the first repeated at reset)."""

    def __init__(self, env_args: Mapping, cameras: Sequence[str], low_dim_keys: Sequence[str], n_envs: int,
                 obs_steps: int = 2, image_size: int | None = None, absolute_actions: bool | None = True,
                 seed: int | None = 0, fast_render: bool = True) -> None:
        if n_envs < 1:
            raise ValueError(f"n_envs must be at least 1, got {n_envs}")
        if obs_steps < 1:
            raise ValueError(f"obs_steps must be at least 1, got {obs_steps}")
        self.keys = list(cameras) + list(low_dim_keys)
        self.cameras, self.obs_steps = list(cameras), obs_steps
        build_seed = env_args["env_kwargs"].get("seed", seed)   # the file's model (cube size) if it names one
        self.envs = [make_env(env_args, cameras, image_size, absolute_actions, seed=build_seed,
                              fast_render=fast_render) for _ in range(n_envs)]
        self.history: list[deque] = [deque(maxlen=obs_steps) for _ in range(n_envs)]
        self.last: list[dict] = [{} for _ in range(n_envs)]

    def __len__(self) -> int:
        return len(self.envs)

    def _record(self, index: int, raw_obs: Mapping) -> None:
        obs = observation(raw_obs, self.keys)
        self.last[index] = obs
        self.history[index].append(obs)

    def reset(self, index: int, seed: int | None = None, episode: int = 0, state: np.ndarray | None = None) -> None:
        """Start a new episode in environment ``index``: seeded from (seed, episode), or set to the
        flattened simulator ``state`` (robomimic's ``reset_to``)."""
        env = self.envs[index]
        if seed is not None:
            seed_episode(env, seed, episode)
        raw = env.reset()
        if state is not None:
            raw = reset_to(env, state)
        self.history[index].clear()
        self._record(index, raw)
        while len(self.history[index]) < self.obs_steps:
            self.history[index].append(self.last[index])

    def step(self, index: int, action: np.ndarray) -> tuple[float, bool]:
        """One action in environment ``index``: (reward, success)."""
        env = self.envs[index]
        raw, reward, _, _ = env.step(np.asarray(action, dtype=np.float64))
        self._record(index, raw)
        return float(reward), bool(env._check_success())

    def stacked_obs(self, indices: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """{key: (len(indices), obs_steps, ...)}, oldest step first."""
        indices = range(len(self.envs)) if indices is None else indices
        return {key: np.stack([np.stack([obs[key] for obs in self.history[i]]) for i in indices])
                for key in self.keys}

    def frame(self, index: int) -> np.ndarray:
        """The first camera's latest image, upright (H, W, 3) uint8, for videos."""
        return self.last[index][self.cameras[0]].transpose(1, 2, 0)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def write_video(path, frames: Sequence[np.ndarray], fps: int = 20) -> Path:
    """RGB (H, W, 3) uint8 frames -> an mp4 (OpenCV, mp4v codec)."""
    import cv2

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV could not open a video writer for {path}")
    try:
        for frame in frames:
            writer.write(np.ascontiguousarray(frame[..., ::-1]))
    finally:
        writer.release()
    return path


# ------------------------------------------------------------------------------------ rollout
def rollout(policy: Callable[[dict], np.ndarray], env_args: Mapping, cameras: Sequence[str],
            low_dim_keys: Sequence[str], episodes: int, max_steps: int, obs_steps: int = 2,
            action_steps: int = 8, n_envs: int = 4, seed: int = 0, video_dir=None, video_episodes: int = 0,
            image_size: int | None = None, absolute_actions: bool | None = True, fast_render: bool = True,
            envs: VectorEnv | None = None, progress: str | None = None) -> dict:
    """Run ``episodes`` episodes, ``n_envs`` at a time; a finished environment takes the next episode
    (with ``progress``, a bar of that name over the episodes' steps).

    ``policy(obs) -> actions``: ``obs`` is {key: (N, obs_steps, ...)} for the N running environments
    (images uint8 (3, H, W)), called once per chunk for all of them; ``actions`` (N, >= action_steps,
    action_dim), of which each environment executes the first ``action_steps``. An episode ends at
    success or after ``max_steps`` actions. Pass ``envs`` to reuse built environments."""
    if episodes < 1 or max_steps < 1 or action_steps < 1:
        raise ValueError(f"episodes, max_steps and action_steps must be positive, got {episodes}, {max_steps}, "
                         f"{action_steps}")
    owned = envs is None
    if owned:
        envs = VectorEnv(env_args, cameras, low_dim_keys, min(n_envs, episodes), obs_steps, image_size,
                         absolute_actions, seed, fast_render)
    successes = [False] * episodes
    lengths = [0] * episodes
    frames: dict[int, list] = {}
    running: dict[int, int] = {}    # env index -> episode
    bar_done: dict[int, int] = {}   # episode -> its steps shown on the bar
    next_episode = 0
    policy_seconds = env_seconds = 0.0
    env_steps = 0
    bar = tqdm(total=episodes * max_steps, desc=progress, disable=progress is None, leave=False, unit="step",
               mininterval=1.0, dynamic_ncols=True)

    def start(index: int) -> None:
        nonlocal next_episode, env_seconds
        episode, next_episode = next_episode, next_episode + 1
        tic = time.perf_counter()
        envs.reset(index, seed=seed, episode=episode)
        env_seconds += time.perf_counter() - tic
        running[index] = episode
        if episode < video_episodes:
            frames[episode] = [envs.frame(index)]

    try:
        for index in range(len(envs)):
            if next_episode < episodes:
                start(index)
        while running:
            indices = sorted(running)
            tic = time.perf_counter()
            actions = np.asarray(policy(envs.stacked_obs(indices)))
            policy_seconds += time.perf_counter() - tic
            if actions.ndim != 3 or actions.shape[0] != len(indices) or actions.shape[1] < action_steps:
                raise ValueError(f"policy returned actions of shape {actions.shape}; expected "
                                 f"({len(indices)}, >= {action_steps}, action_dim)")
            for row, index in enumerate(indices):
                episode = running[index]
                done = False
                tic = time.perf_counter()
                for action in actions[row, :action_steps]:
                    _, success = envs.step(index, action)
                    env_steps += 1
                    lengths[episode] += 1
                    if episode in frames:
                        frames[episode].append(envs.frame(index))
                    if success or lengths[episode] >= max_steps:
                        successes[episode], done = success, True
                        break
                env_seconds += time.perf_counter() - tic
                bar.update(lengths[episode] - bar_done.get(episode, 0) + (max_steps - lengths[episode]) * done)
                bar_done[episode] = lengths[episode]
                if done:
                    del running[index]
                    if next_episode < episodes:
                        start(index)
    finally:
        bar.close()
        if owned:
            envs.close()
    videos = []
    if video_dir is not None:
        for episode in sorted(frames):
            videos.append(str(write_video(Path(video_dir) / f"episode_{episode:03d}.mp4", frames[episode])))
    return {"success_rate": float(np.mean(successes)), "successes": successes, "episode_lengths": lengths,
            "steps_per_second": env_steps / env_seconds if env_seconds > 0 else float("nan"),
            "policy_seconds": policy_seconds, "env_seconds": env_seconds, "videos": videos}
