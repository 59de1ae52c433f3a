"""Robosuite environments from env_args, the scripted Lift expert, and the batched rollout."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

import json  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:
    import robosuite  # noqa: E402
except Exception as error:  # noqa: BLE001 - robosuite loads its GL backend at import (AttributeError without it)
    pytest.skip(f"robosuite unavailable with MUJOCO_GL={os.environ['MUJOCO_GL']}: {error!r}", allow_module_level=True)

from experiments.robomimic import env as E  # noqa: E402
from experiments.robomimic import lift_expert  # noqa: E402
from experiments.robomimic.data import actions_are_absolute  # noqa: E402

CAMERAS = ["agentview_image", "robot0_eye_in_hand_image"]
LOW_DIM = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]

#: the env_args of robomimic's lift/ph/image.hdf5 (robosuite 1.2 part controller, delta actions)
LEGACY_LIFT = {
    "env_name": "Lift", "type": 1,
    "env_kwargs": {
        "has_renderer": False, "has_offscreen_renderer": True, "ignore_done": True, "use_object_obs": True,
        "use_camera_obs": True, "control_freq": 20,
        "controller_configs": {
            "type": "OSC_POSE", "input_max": 1, "input_min": -1,
            "output_max": [0.05, 0.05, 0.05, 0.5, 0.5, 0.5], "output_min": [-0.05, -0.05, -0.05, -0.5, -0.5, -0.5],
            "kp": 150, "damping": 1, "impedance_mode": "fixed", "kp_limits": [0, 300], "damping_limits": [0, 10],
            "position_limits": None, "orientation_limits": None, "uncouple_pos_ori": True, "control_delta": True,
            "interpolation": None, "ramp_ratio": 0.2},
        "robots": ["Panda"], "camera_depths": False, "camera_heights": 84, "camera_widths": 84,
        "reward_shaping": False, "camera_names": ["agentview", "robot0_eye_in_hand"], "render_gpu_device_id": 0},
}


@pytest.fixture(scope="module")
def rendering():
    """Skip when no offscreen OpenGL (EGL) context can be made on this machine."""
    try:
        env = E.make_env(LEGACY_LIFT, ["agentview_image"], image_size=32)
    except Exception as error:  # noqa: BLE001 - any GL failure means: cannot test rendering here
        pytest.skip(f"offscreen rendering unavailable (MUJOCO_GL={os.environ.get('MUJOCO_GL')}): {error!r}")
    env.close()


@pytest.fixture(scope="module")
def expert_file(rendering, tmp_path_factory):
    path = tmp_path_factory.mktemp("lift") / "image_abs.hdf5"
    lift_expert.main(["--n", "2", "--out", str(path), "--valid-fraction", "0.5", "--seed", "3"])
    return path


def test_legacy_controller_config_becomes_composite():
    kwargs = LEGACY_LIFT["env_kwargs"]
    absolute = E.composite_controller_config(kwargs, absolute_actions=True)
    assert absolute["type"] == "BASIC" and set(absolute["body_parts"]) == {"right"}
    arm = absolute["body_parts"]["right"]
    assert arm["type"] == "OSC_POSE" and arm["input_type"] == "absolute" and arm["input_ref_frame"] == "world"
    assert arm["damping_ratio"] == 1 and arm["damping_ratio_limits"] == [0, 10] and arm["gripper"] == {"type": "GRIP"}
    assert "control_delta" not in arm and "damping" not in arm
    assert E.composite_controller_config(kwargs, absolute_actions=None)["body_parts"]["right"]["input_type"] == "delta"
    # a robosuite 1.5 composite config keeps its frame and only has its input_type set
    modern = lift_expert.lift_env_args()["env_kwargs"]
    delta = E.composite_controller_config(modern, absolute_actions=False)["body_parts"]["right"]
    assert delta["input_type"] == "delta" and delta["input_ref_frame"] == "world"
    assert kwargs["controller_configs"]["control_delta"] is True          # input not modified
    with pytest.raises(ValueError, match="neither"):
        E.composite_controller_config({"controller_configs": {"type": "MYSTERY"}})


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "composite"])
def test_env_renders_both_cameras_upright(rendering, fmt):
    env_args = LEGACY_LIFT if fmt == "legacy" else lift_expert.lift_env_args()
    env = E.make_env(env_args, CAMERAS, image_size=84, seed=0)
    try:
        obs = E.observation(env.reset(), CAMERAS + LOW_DIM + ["object"])
        for key in CAMERAS:
            assert obs[key].shape == (3, 84, 84) and obs[key].dtype == np.uint8
            raw = env.sim.render(camera_name=E.camera_name(key), width=84, height=84)
            np.testing.assert_array_equal(obs[key], raw[::-1].transpose(2, 0, 1))
            # upright: the robot (agentview) and the gripper fingers (eye in hand) are dark and at the
            # top and bottom of the picture respectively; the white table fills the other end
            rows = obs[key].mean(axis=(0, 2))
            dark, bright = (rows[:10], rows[-10:]) if key == "agentview_image" else (rows[-8:], rows[:20])
            assert dark.mean() < bright.mean() - 20, (key, rows)
        assert obs["robot0_eef_pos"].dtype == np.float32 and obs["object"].shape == (10,)
        # absolute targets are read in the world frame: commanding the current pose holds it
        site = env.robots[0].eef_site_id["right"]
        start = np.array(env.sim.data.site_xpos[site])
        from scipy.spatial.transform import Rotation
        rotvec = Rotation.from_matrix(env.sim.data.site_xmat[site].reshape(3, 3)).as_rotvec()
        for _ in range(5):
            env.step(np.concatenate([start, rotvec, [-1.0]]))
        assert np.linalg.norm(env.sim.data.site_xpos[site] - start) < 0.01
    finally:
        env.close()


@pytest.mark.slow
def test_expert_demos_replay_open_loop(expert_file):
    with h5py.File(expert_file, "r") as f:
        env_args = json.loads(f["data"].attrs["env_args"])
        names = sorted(f["data"].keys())
        demos = [{key: f[f"data/{name}/{key}"][()] for key in ("actions", "states", "dones")} for name in names]
        obs = {key: f[f"data/demo_0/obs/{key}"][()] for key in f["data/demo_0/obs"]}
        masks = sorted(m.decode() for split in ("train", "valid") for m in f[f"mask/{split}"][()])
    assert names == ["demo_0", "demo_1"] and masks == names
    assert env_args["env_version"] == robosuite.__version__ and actions_are_absolute(env_args) is True
    steps = len(demos[0]["actions"])
    assert obs["agentview_image"].shape == (steps, 84, 84, 3) and obs["agentview_image"].dtype == np.uint8
    assert obs["robot0_eye_in_hand_image"].shape == (steps, 84, 84, 3)
    assert obs["robot0_eef_pos"].shape == (steps, 3) and obs["robot0_gripper_qpos"].shape == (steps, 2)
    # the action's position is the world-frame target the eef follows (same frame as robot0_eef_pos)
    assert np.abs(demos[0]["actions"][:-1, :3] - obs["robot0_eef_pos"][1:]).max() < 0.05
    env = E.make_env(env_args, [], render=False)
    try:
        for demo in demos:
            assert demo["actions"].shape == (len(demo["states"]), 7) and demo["dones"][-1] == 1
            env.reset()                                 # another initial state, then the demo's
            E.reset_to(env, demo["states"][0])
            success = []
            for t, action in enumerate(demo["actions"]):
                env.step(action)
                success.append(env._check_success())
                if t + 1 < len(demo["states"]):          # the simulation repeats the demo
                    np.testing.assert_allclose(env.sim.get_state().flatten()[1:], demo["states"][t + 1][1:],
                                               atol=1e-5)  # contact warm starts are not in the state
            assert success[-1] and not any(success[:-1])
    finally:
        env.close()


@pytest.mark.slow
def test_rollout_replaying_expert_succeeds_side_by_side(expert_file):
    """Rollout episode i starts where expert attempt i started, so replaying the demos succeeds."""
    with h5py.File(expert_file, "r") as f:
        env_args = json.loads(f["data"].attrs["env_args"])
        actions = [f[f"data/demo_{i}/actions"][()] for i in range(2)]
    calls = []
    chunks = [-(-len(a) // 8) for a in actions]     # policy calls each demo needs at 8 actions a call

    def replay(obs):
        batch = len(obs["robot0_eef_pos"])
        t = 8 * len(calls)
        live = [e for e in range(2) if len(calls) < chunks[e]]   # environment i runs episode i here
        calls.append(batch)
        assert batch == len(live)
        assert obs["agentview_image"].shape == (batch, 2, 3, 84, 84) and obs["robot0_eef_pos"].shape == (batch, 2, 3)
        return np.stack([np.concatenate([actions[e], np.repeat(actions[e][-1:], 16, 0)])[t:t + 10] for e in live])

    result = E.rollout(replay, env_args, CAMERAS, LOW_DIM, episodes=2, max_steps=100, obs_steps=2,
                       action_steps=8, n_envs=2, seed=3)
    assert result["successes"] == [True, True] and result["success_rate"] == 1.0
    assert result["episode_lengths"] == [len(a) for a in actions]
    assert calls == [sum(c > k for c in chunks) for k in range(max(chunks))]   # one call per chunk for both


@pytest.mark.slow
def test_rollout_batches_policy_calls_and_writes_video(rendering, tmp_path):
    import cv2

    calls = []

    def hold(obs):                                   # zero deltas: the arm holds its pose
        calls.append(len(obs["robot0_eef_pos"]))
        if len(calls) == 1:                          # at reset the history repeats the first observation
            np.testing.assert_array_equal(obs["agentview_image"][:, 0], obs["agentview_image"][:, 1])
        return np.zeros((len(obs["robot0_eef_pos"]), 6, 7))

    result = E.rollout(hold, LEGACY_LIFT, ["agentview_image"], LOW_DIM, episodes=3, max_steps=10, obs_steps=2,
                       action_steps=4, n_envs=2, seed=0, video_dir=tmp_path, video_episodes=1, image_size=48,
                       absolute_actions=False)
    # episodes 0 and 1 run side by side (3 chunks of 4, 4, 2 steps), then episode 2 alone
    assert calls == [2, 2, 2, 1, 1, 1]
    assert result["successes"] == [False] * 3 and result["success_rate"] == 0.0
    assert result["episode_lengths"] == [10, 10, 10]
    assert result["steps_per_second"] > 0 and result["policy_seconds"] >= 0 and result["env_seconds"] > 0
    assert result["videos"] == [str(tmp_path / "episode_000.mp4")]
    video = cv2.VideoCapture(result["videos"][0])
    frames = int(video.get(cv2.CAP_PROP_FRAME_COUNT))
    ok, frame = video.read()
    video.release()
    assert ok and frame.shape == (48, 48, 3) and frames == 11      # the reset frame and 10 steps
    with pytest.raises(ValueError, match="expected"):
        E.rollout(lambda obs: np.zeros((1, 2, 7)), LEGACY_LIFT, [], LOW_DIM, episodes=1, max_steps=5,
                  action_steps=4, n_envs=1, absolute_actions=False)


@pytest.mark.slow
def test_debug_job_trains_and_evaluates_in_the_simulator(expert_file, tmp_path):
    """`python run.py task=robomimic_lift task.dataset=<file> debug=default`: a few steps, one short episode
    in the real simulator, the EMA policy saved; with task.eval_episodes=0 no simulator is touched."""
    from conftest import _compose

    from experiments.common.launch import run_job

    s = run_job(_compose("task=robomimic_lift", f"task.dataset={expert_file}", "debug=default", "task.valid_split=null",
                         "task.encoder.width=4", "task.unet.model_dim=8"), tmp_path / "job")
    assert s["best_step"] == 4 and s["success_curve"] == {"4": s["best_success"]}
    assert len(s["best_successes"]) == 1 and s["evals"]["4"]["env_steps_per_s_1"] > 0
    assert (tmp_path / "job" / "best_policy.pt").exists() and (tmp_path / "job" / "policy.pt").exists()


def test_robosuite_lines_are_printed_once_under_a_root_handler():
    """Hydra configures the root logger; robosuite also has its own handler (issue "first hour", 11)."""
    import subprocess
    import sys

    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, format='ROOT %(message)s'); "
            "import experiments.robomimic.env; import robosuite; "
            "logging.getLogger('robosuite_logs').warning('probe line')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("probe line") == 1 and "ROOT" not in r.stderr
