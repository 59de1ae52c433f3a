"""Robomimic data: rotations, the normalizer, the hdf5 reader/writer and the sequence dataset."""
import json
import math
import pickle

import h5py
import numpy as np
import pytest
import torch

from experiments.common.distributed import data_loader
from experiments.robomimic.data import (RobomimicDataset, actions_are_absolute, read_env_args, sequence_windows,
                                        validate, write_demo_file)
from experiments.robomimic.normalizer import Normalizer, NormalizerDict
from experiments.robomimic.rotation import (actions_from_rotation_6d, actions_to_rotation_6d, axis_angle_to_matrix,
                                            axis_angle_to_rotation_6d, matrix_to_axis_angle, matrix_to_rotation_6d,
                                            rotation_6d_action_dims, rotation_6d_to_axis_angle, rotation_6d_to_matrix)

CAMERA, LOW_DIM = "agentview_image", ["robot0_eef_pos", "robot0_eef_quat"]
ENV_ARGS = {"env_name": "Lift", "type": 1, "env_kwargs": {"controller_configs": {"control_delta": False}}}


def random_axis_angle(n, angles, seed=0):
    g = torch.Generator().manual_seed(seed)
    axes = torch.nn.functional.normalize(torch.randn(n, len(angles), 3, generator=g, dtype=torch.float64), dim=-1)
    return axes * torch.tensor(angles, dtype=torch.float64)[None, :, None]


# ----------------------------------------------------------------------------------- rotation
def test_axis_angle_round_trip_near_zero_and_pi():
    angles = [0.0, 1e-9, 1e-5, 1e-4, 1e-3, 0.5, 2.0, math.pi - 1e-3, math.pi - 1e-6]
    aa = random_axis_angle(50, angles)
    back = rotation_6d_to_axis_angle(axis_angle_to_rotation_6d(aa))
    torch.testing.assert_close(back, aa, rtol=0, atol=1e-9)
    # float32 keeps float32 precision
    back32 = rotation_6d_to_axis_angle(axis_angle_to_rotation_6d(aa.float()))
    assert back32.dtype == torch.float32
    torch.testing.assert_close(back32.double(), aa, rtol=0, atol=2e-3)  # pi - 1e-6 is ill-posed in float32
    # exactly pi: axis and -axis are the same rotation; the matrix comes back
    aa_pi = random_axis_angle(20, [math.pi], seed=1)
    back_pi = matrix_to_axis_angle(axis_angle_to_matrix(aa_pi))
    torch.testing.assert_close(back_pi.norm(dim=-1), torch.full((20, 1), math.pi, dtype=torch.float64))
    torch.testing.assert_close(axis_angle_to_matrix(back_pi), axis_angle_to_matrix(aa_pi), rtol=0, atol=1e-12)


def test_matrix_values_and_6d_is_first_two_rows():
    # 90 degrees about z: columns are the images of x and y
    r = axis_angle_to_matrix(torch.tensor([0.0, 0.0, math.pi / 2], dtype=torch.float64))
    expected = torch.tensor([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(r, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(matrix_to_rotation_6d(r), torch.tensor([0.0, -1, 0, 1, 0, 0], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    # Rodrigues vs. the matrix exponential of the skew matrix, any leading dims
    aa = random_axis_angle(7, [0.3, 1.7, 3.0], seed=2).reshape(7, 3, 3)
    x, y, z = aa.unbind(-1)
    zero = torch.zeros_like(x)
    skew = torch.stack([zero, -z, y, z, zero, -x, -y, x, zero], -1).reshape(7, 3, 3, 3)
    torch.testing.assert_close(axis_angle_to_matrix(aa), torch.linalg.matrix_exp(skew), rtol=0, atol=1e-12)


def test_rotation_6d_to_matrix_is_a_rotation():
    d6 = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r = rotation_6d_to_matrix(d6)
    torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(3, dtype=torch.float64).expand(4, 5, 3, 3),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(4, 5, dtype=torch.float64), rtol=0, atol=1e-12)
    # the first row is the normalised first 3 numbers (Gram-Schmidt starts there)
    torch.testing.assert_close(r[..., 0, :], torch.nn.functional.normalize(d6[..., :3], dim=-1))


def random_actions(shape, arms, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(arms):
        axis = rng.normal(size=(*shape, 3))
        axis /= np.linalg.norm(axis, axis=-1, keepdims=True)
        parts += [rng.normal(size=(*shape, 3)), axis * rng.uniform(0, 3.1, size=(*shape, 1)),
                  rng.choice([-1.0, 1.0], size=(*shape, 1))]
    return np.concatenate(parts, axis=-1)


@pytest.mark.parametrize("arms", [1, 2])
def test_actions_rotation_6d_round_trip(arms):
    a = random_actions((5, 4), arms)
    six = actions_to_rotation_6d(a)
    assert isinstance(six, np.ndarray) and six.shape == (5, 4, 10 * arms) and six.dtype == np.float64
    np.testing.assert_allclose(actions_from_rotation_6d(six), a, rtol=0, atol=1e-9)
    # per arm: position and gripper pass through, the rotation sits at 3..8
    for arm in range(arms):
        np.testing.assert_array_equal(six[..., 10 * arm:10 * arm + 3], a[..., 7 * arm:7 * arm + 3])
        np.testing.assert_array_equal(six[..., 10 * arm + 9], a[..., 7 * arm + 6])
        np.testing.assert_allclose(six[..., 10 * arm + 3:10 * arm + 9],
                                   axis_angle_to_rotation_6d(torch.from_numpy(a[..., 7 * arm + 3:7 * arm + 6])).numpy())
    assert rotation_6d_action_dims(10 * arms) == [10 * k + i for k in range(arms) for i in range(3, 9)]
    t = torch.from_numpy(a).float()
    assert actions_to_rotation_6d(t).dtype == torch.float32


def test_actions_wrong_width_names_the_shape():
    with pytest.raises(ValueError, match=r"multiple of 7.*\(5, 8\)"):
        actions_to_rotation_6d(np.zeros((5, 8)))
    with pytest.raises(ValueError, match=r"multiple of 10.*\(3, 14\)"):
        actions_from_rotation_6d(torch.zeros(3, 14))


# --------------------------------------------------------------------------------- normalizer
def test_normalizer_min_max_identity_and_constant():
    x = torch.tensor([[0.0, 10.0, 5.0, 0.3], [2.0, -10.0, 5.0, -0.7], [1.0, 0.0, 5.0, 0.1]], dtype=torch.float64)
    n = Normalizer.fit(x, identity_dims=[3])
    y = n.normalize(x)
    torch.testing.assert_close(y[:, 0], torch.tensor([-1.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(y[:, 1], torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(y[:, 2], torch.zeros(3, dtype=torch.float64))  # constant: finite, mapped to 0
    torch.testing.assert_close(y[:, 3], x[:, 3])  # identity
    torch.testing.assert_close(n.unnormalize(y), x)
    # any leading dims, float32 in -> float32 out
    z = torch.randn(2, 3, 4, 4)
    assert n.normalize(z).dtype == torch.float32
    torch.testing.assert_close(n.unnormalize(n.normalize(z)), z)
    with pytest.raises(ValueError, match="4 features"):
        n.normalize(torch.zeros(2, 3))


def test_normalizer_dict_state_dict_round_trip(tmp_path):
    nd = NormalizerDict(actions=Normalizer.fit(np.array([[0.0, 1.0], [4.0, 3.0]])), quat=Normalizer.identity(4))
    torch.save(nd.state_dict(), tmp_path / "n.pt")
    loaded = NormalizerDict.from_state_dict(torch.load(tmp_path / "n.pt", weights_only=True))
    x = torch.tensor([[2.0, 2.0]])
    torch.testing.assert_close(loaded["actions"].normalize(x), torch.tensor([[0.0, 0.0]]))
    torch.testing.assert_close(loaded["quat"].normalize(torch.ones(4)), torch.ones(4))


# ------------------------------------------------------------------------------------ files
def frame_code(demo, t):
    return demo * 20 + t


def make_demo(demo, steps, arms=1, drop=()):
    """Step t of demo d: image channel 0 = 20 d + t, channel 1 = row, channel 2 = column; eef_pos =
    [100 d + t, 0.5, -t]; quat = [t / 100, 0, 0, 1]; action position [100 d + t, t, 0], rotation
    0.1 t about x, gripper +-1."""
    t = np.arange(steps)
    image = np.zeros((steps, 8, 6, 3), dtype=np.uint8)
    image[..., 0] = frame_code(demo, t)[:, None, None]
    image[..., 1] = np.arange(8)[None, :, None]
    image[..., 2] = np.arange(6)[None, None, :]
    obs = {CAMERA: image,
           "robot0_eef_pos": np.stack([100.0 * demo + t, np.full(steps, 0.5), -t], -1),
           "robot0_eef_quat": np.stack([t / 100, 0 * t, 0 * t, 1 + 0 * t], -1).astype(np.float64)}
    for key in drop:
        obs.pop(key)
    arm = np.stack([100.0 * demo + t, t, 0 * t, 0.1 * t, 0 * t, 0 * t, np.where(t % 2, 1.0, -1.0)], -1)
    return {"obs": obs, "actions": np.concatenate([arm] * arms, -1), "states": np.zeros((steps, 5)),
            "rewards": np.zeros(steps), "dones": (t == steps - 1).astype(np.int64)}


@pytest.fixture
def demo_file(tmp_path):
    """11 demos (demo_0 .. demo_10, so numeric and lexicographic order differ), demo d of 10 + d steps."""
    demos = [make_demo(d, 10 + d) for d in range(11)]
    return write_demo_file(tmp_path / "lift" / "image_abs.hdf5", demos, ENV_ARGS,
                           train_mask=[8, 0, 10, 2, 1, 3, 4, 5, 6], valid_mask=["demo_9", "demo_7"])


def test_write_demo_file_schema(demo_file):
    with h5py.File(demo_file) as f:
        assert f["data/demo_3/obs"][CAMERA].shape == (13, 8, 6, 3)
        assert f["data/demo_3"].attrs["num_samples"] == 13
        assert f["data"].attrs["total"] == sum(10 + d for d in range(11))
        assert list(f["mask/valid"][()]) == [b"demo_9", b"demo_7"]
    assert read_env_args(demo_file) == ENV_ARGS
    assert [p.name for p in demo_file.parent.iterdir()] == ["image_abs.hdf5"]  # no temporary left behind


def test_write_demo_file_failure_leaves_nothing(tmp_path):
    bad = make_demo(0, 5)
    del bad["dones"]
    with pytest.raises(KeyError, match="dones"):
        write_demo_file(tmp_path / "x.hdf5", [make_demo(0, 5), bad], ENV_ARGS)
    assert list(tmp_path.iterdir()) == []


def test_validate_numeric_order_and_masks(demo_file):
    assert validate(demo_file, [CAMERA], LOW_DIM) == [f"demo_{d}" for d in range(11)]
    assert validate(demo_file, [CAMERA], LOW_DIM, split="train") == [f"demo_{d}" for d in (0, 1, 2, 3, 4, 5, 6, 8, 10)]
    assert validate(demo_file, split="valid") == ["demo_7", "demo_9"]


def test_dataset_shapes_and_order(demo_file):
    ds = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3)
    assert ds.demos == [f"demo_{d}" for d in range(11)]
    assert ds.action_dim == 10 and ds.low_dim_shape("robot0_eef_pos") == (3,) and ds.image_shape(CAMERA) == (3, 8, 6)
    # windows per episode: starts -1 .. L - 6 + 2, i.e. L - 2 of them
    assert len(ds) == sum(10 + d - 2 for d in range(11))
    item = ds[0]
    assert item["obs"][CAMERA].shape == (2, 3, 8, 6) and item["obs"][CAMERA].dtype == torch.uint8
    assert item["obs"]["robot0_eef_pos"].shape == (2, 3) and item["obs"]["robot0_eef_pos"].dtype == torch.float32
    assert item["actions"].shape == (6, 10) and item["actions"].dtype == torch.float32
    # channels first: channel 1 is the row index, channel 2 the column index
    np.testing.assert_array_equal(item["obs"][CAMERA][0, 1], np.repeat(np.arange(8)[:, None], 6, 1))
    np.testing.assert_array_equal(item["obs"][CAMERA][0, 2], np.repeat(np.arange(6)[None, :], 8, 0))
    # demo_10 (20 steps) is stored last: the final window ends on its last step
    last = ds.normalizer["actions"].unnormalize(ds[len(ds) - 1]["actions"].double())
    np.testing.assert_allclose(last[-1, 0].item(), 1019.0, rtol=1e-6)


def raw_actions(ds, item):
    return ds.normalizer["actions"].unnormalize(item["actions"].double())


def test_padding_repeats_boundary_frames_and_alignment(demo_file):
    ds = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3)
    first = ds[0]  # window starts one step before demo_0: step 0 repeated
    np.testing.assert_array_equal(first["obs"][CAMERA][:, 0, 0, 0].numpy(), [0, 0])
    np.testing.assert_allclose(raw_actions(ds, first)[:, 0].numpy(), [0, 0, 1, 2, 3, 4], atol=1e-3)
    eef = ds.normalizer["robot0_eef_pos"].unnormalize(first["obs"]["robot0_eef_pos"].double())
    np.testing.assert_allclose(eef[:, 0].numpy(), [0, 0], atol=1e-3)
    # the second window: observation steps 0, 1; actions 0..5; action obs_steps-1 = step 1, the current one
    second = ds[1]
    np.testing.assert_array_equal(second["obs"][CAMERA][:, 0, 0, 0].numpy(), [0, 1])
    np.testing.assert_allclose(raw_actions(ds, second)[:, 0].numpy(), [0, 1, 2, 3, 4, 5], atol=1e-3)
    # demo_0 has 10 steps and 8 windows; its last starts at step 6 and repeats step 9 twice
    end = ds[7]
    np.testing.assert_array_equal(end["obs"][CAMERA][:, 0, 0, 0].numpy(), [6, 7])
    np.testing.assert_allclose(raw_actions(ds, end)[:, 0].numpy(), [6, 7, 8, 9, 9, 9], atol=1e-3)
    # window 8 is the first of demo_1 (code 20 + t), never mixing episodes
    np.testing.assert_array_equal(ds[8]["obs"][CAMERA][:, 0, 0, 0].numpy(), [20, 20])
    np.testing.assert_allclose(raw_actions(ds, ds[8])[:, 0].numpy(), 100 + np.array([0, 0, 1, 2, 3, 4]), atol=1e-3)
    # the rotation round trip through the dataset: 0.1 t about x, gripper alternating
    back = actions_from_rotation_6d(raw_actions(ds, end))
    np.testing.assert_allclose(back[:, 3].numpy(), 0.1 * np.array([6, 7, 8, 9, 9, 9]), atol=1e-5)
    np.testing.assert_allclose(back[:, 6].numpy(), [-1, 1, -1, 1, 1, 1], atol=1e-6)


def test_sequence_windows_match_diffusion_policy_sampler():
    def reference(lengths, horizon, before, after):  # diffusion_policy create_indices + padding, step by step
        out, start = [], 0
        for length in lengths:
            for idx in range(-before, length - horizon + after + 1):
                out.append([start + min(max(idx + k, 0), length - 1) for k in range(horizon)])
            start += length
        return np.array(out).reshape(-1, horizon)

    for lengths, horizon, before, after in [([10, 3, 16], 16, 1, 7), ([5, 9], 4, 3, 0), ([30], 16, 1, 7),
                                            ([2, 2], 3, 2, 2)]:
        start, first, last = sequence_windows(lengths, horizon, before, after)
        got = np.clip(start[:, None] + np.arange(horizon), first[:, None], last[:, None])
        np.testing.assert_array_equal(got, reference(lengths, horizon, before, after))


def test_much_ado_normalization_min_maxes_every_feature(demo_file):
    ds = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3)  # the default
    for x in (ds.actions, *ds.low_dim.values()):
        x = torch.from_numpy(x)
        varying = x.max(0).values > x.min(0).values
        assert varying.any()
        torch.testing.assert_close(x.min(0).values[varying], -torch.ones(int(varying.sum())))
        torch.testing.assert_close(x.max(0).values[varying], torch.ones(int(varying.sum())))
        assert (x[:, ~varying] == 0).all()  # a constant feature maps to 0, finite
    with pytest.raises(ValueError, match="normalization must be one of"):
        RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, normalization="zscore")


def test_diffusion_policy_normalization_of_dataset(demo_file):
    ds = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3,
                          normalization="diffusion_policy")
    a = torch.from_numpy(ds.actions)
    assert a[:, 0].min() == -1 and a[:, 0].max() == 1  # positions min-max
    torch.testing.assert_close(a[:, 2], torch.zeros(len(a)))  # constant position: 0, finite
    d6 = actions_to_rotation_6d(np.stack([0 * np.arange(3)] * 3 + [0.1 * np.arange(3), 0 * np.arange(3),
                                                                    0 * np.arange(3), 0 * np.arange(3)], -1))
    torch.testing.assert_close(a[:3, 3:9], torch.from_numpy(d6[:, 3:9]).float())  # rot6d: identity
    assert set(a[:, 9].tolist()) == {-1.0, 1.0}
    pos = torch.from_numpy(ds.low_dim["robot0_eef_pos"])
    assert pos[:, 0].min() == -1 and pos[:, 0].max() == 1 and (pos[:, 1] == 0).all()
    quat = ds[3]["obs"]["robot0_eef_quat"]
    torch.testing.assert_close(quat, torch.tensor([[0.02, 0, 0, 1], [0.03, 0, 0, 1]]))  # quaternions: identity


def test_splits_and_shared_normalizer(demo_file):
    train = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3, split="train")
    valid = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, obs_steps=2, action_steps=3, split="valid",
                             normalizer=train.normalizer)
    assert train.demos == [f"demo_{d}" for d in (0, 1, 2, 3, 4, 5, 6, 8, 10)]
    assert valid.demos == ["demo_7", "demo_9"] and valid.normalizer is train.normalizer
    # demo_7's first action position 700 under the training statistics (min 0, max 1019)
    first = valid.normalizer["actions"].unnormalize(valid[0]["actions"].double())
    np.testing.assert_allclose(first[0, 0].item(), 700.0, rtol=1e-6)
    np.testing.assert_allclose(valid[0]["actions"][0, 0].item(), 2 * 700 / 1019 - 1, rtol=1e-5)
    assert RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=6, split="train", max_demos=2).demos == \
        ["demo_0", "demo_1"]


def test_two_arm_actions(tmp_path):
    path = write_demo_file(tmp_path / "t.hdf5", [make_demo(d, 12, arms=2) for d in range(2)], ENV_ARGS)
    ds = RobomimicDataset(path, [CAMERA], LOW_DIM, horizon=4, obs_steps=2, action_steps=2)
    assert ds.action_dim == 20 and ds[0]["actions"].shape == (4, 20)
    back = actions_from_rotation_6d(ds.normalizer["actions"].unnormalize(ds[1]["actions"].double()))
    np.testing.assert_allclose(back[:, :7], back[:, 7:], atol=1e-6)
    np.testing.assert_allclose(back[:, 3].numpy(), [0, 0.1, 0.2, 0.3], atol=1e-6)


# ------------------------------------------------------------------------------------ errors
def test_missing_file_names_the_download(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        RobomimicDataset(tmp_path / "tool_hang" / "ph" / "image_abs.hdf5", [CAMERA], LOW_DIM)
    message = str(info.value)
    assert "python -m robomimic.scripts.download_datasets --tasks tool_hang --dataset_types ph --hdf5_types image" \
        in message
    assert "https://diffusion-policy.cs.columbia.edu/data/training/robomimic_image.zip" in message
    assert "robomimic/datasets/tool_hang/ph/image_abs.hdf5" in message and "task.dataset" in message


def test_truncated_file_is_a_clear_error(demo_file):
    size = demo_file.stat().st_size
    with open(demo_file, "r+b") as f:
        f.truncate(size // 2)
    for call in (lambda: validate(demo_file, [CAMERA], LOW_DIM), lambda: read_env_args(demo_file)):
        with pytest.raises(ValueError, match="not a readable HDF5 file.*truncated") as info:
            call()
        assert str(demo_file) in str(info.value)


def test_missing_keys_name_key_and_demo(tmp_path):
    demos = [make_demo(d, 10) for d in range(5)]
    demos[3] = make_demo(3, 10, drop=["robot0_eef_pos"])
    path = write_demo_file(tmp_path / "m.hdf5", demos, ENV_ARGS, train_mask=[0, 1])
    with pytest.raises(KeyError, match=r"robot0_eef_pos.*demo_3"):
        RobomimicDataset(path, [CAMERA], LOW_DIM)
    validate(path, [CAMERA], LOW_DIM, split="train")  # demo_3 is not in this split
    with pytest.raises(KeyError, match=r"robot0_eye_in_hand_image.*demo_0"):
        validate(path, ["robot0_eye_in_hand_image"], [])
    with pytest.raises(KeyError, match=r"mask/valid"):
        validate(path, [CAMERA], [], split="valid")
    with h5py.File(path, "r+") as f:
        del f["data"].attrs["env_args"]
        del f["data/demo_4/actions"]
    with pytest.raises(KeyError, match="env_args"):
        validate(path)
    with h5py.File(path, "r+") as f:
        f["data"].attrs["env_args"] = json.dumps(ENV_ARGS)
    with pytest.raises(KeyError, match=r"actions.*demo_4"):
        validate(path, [CAMERA], [])


def test_delta_actions_refused_for_rotation_6d(tmp_path):
    delta = {"env_name": "Lift", "env_kwargs": {"controller_configs": {"control_delta": True}}}
    assert actions_are_absolute(delta) is False and actions_are_absolute(ENV_ARGS) is True
    assert actions_are_absolute({"env_kwargs": {"controller_configs": {"body_parts": {"right": {
        "input_type": "absolute"}}}}}) is True
    path = write_demo_file(tmp_path / "d.hdf5", [make_demo(0, 10)], delta)
    with pytest.raises(ValueError, match="delta actions"):
        RobomimicDataset(path, [CAMERA], LOW_DIM, horizon=4)
    assert RobomimicDataset(path, [CAMERA], LOW_DIM, horizon=4, rotation_6d=False).action_dim == 7


# ------------------------------------------------------------------------------------ loader
def test_data_loader_with_two_workers(demo_file):
    ds = RobomimicDataset(demo_file, [CAMERA], LOW_DIM, horizon=8, obs_steps=2, action_steps=4)
    copy = pickle.loads(pickle.dumps(ds))  # what a spawn-started worker receives
    torch.testing.assert_close(copy[5]["actions"], ds[5]["actions"])
    loader = data_loader(ds, batch_size=4, seed=0, shuffle=True, workers=2)
    batches = iter(loader)
    for _ in range(2):
        batch = next(batches)
        assert batch["obs"][CAMERA].shape == (4, 2, 3, 8, 6) and batch["obs"][CAMERA].dtype == torch.uint8
        assert batch["obs"]["robot0_eef_pos"].shape == (4, 2, 3)
        assert batch["obs"]["robot0_eef_quat"].shape == (4, 2, 4)
        assert batch["actions"].shape == (4, 8, 10) and batch["actions"].dtype == torch.float32
        assert batch["actions"].abs().max() <= 1 + 1e-6
    del batches, loader


def test_a_missing_lift_file_names_the_scripted_expert_that_makes_one_here(tmp_path):
    path = tmp_path / "lift" / "image_abs.hdf5"
    with pytest.raises(FileNotFoundError) as info:
        RobomimicDataset(path, [CAMERA], LOW_DIM)
    assert f"python -m experiments.robomimic.lift_expert --n 40 --out {path}" in str(info.value)
    with pytest.raises(FileNotFoundError) as info:   # other tasks have no such route
        RobomimicDataset(tmp_path / "transport" / "image_abs.hdf5", [CAMERA], LOW_DIM)
    assert "lift_expert" not in str(info.value)


def _file_at(tmp_path, size, steps=6):
    """Two demos whose frames are 240x240 (Tool Hang's size in diffusion_policy's files) or another
    size: each frame a gradient plus a per-step level, so area averaging has a known result."""
    demos = []
    for d in range(2):
        demo = make_demo(d, steps)
        rows = np.arange(size)[:, None] * 255 // (size - 1)
        frame = np.broadcast_to(rows, (size, size)).astype(np.uint8)
        demo["obs"][CAMERA] = np.stack([np.stack([frame, frame, np.full_like(frame, 10 * t)], -1)
                                        for t in range(steps)])
        demos.append(demo)
    return write_demo_file(tmp_path / f"tool_hang_{size}.hdf5", demos, ENV_ARGS)


def test_a_240_pixel_file_is_refused_naming_both_sizes_and_the_fixes(tmp_path):
    path = _file_at(tmp_path, 240)
    with pytest.raises(ValueError, match=r"images are 240x240, the pipeline's observation size \(task.image_size\) "
                                         r"is 84x84.*task.resize=true.*--camera_height 84"):
        RobomimicDataset(path, [CAMERA], LOW_DIM, horizon=4, image_size=84)


def test_a_240_pixel_file_is_brought_to_84_by_area_averaging(tmp_path):
    import torch

    path = _file_at(tmp_path, 240)
    ds = RobomimicDataset(path, [CAMERA], LOW_DIM, horizon=4, image_size=84, resize=True)
    assert ds.image_shape(CAMERA) == (3, 84, 84)
    with h5py.File(path) as f:
        raw = f["data/demo_0/obs"][CAMERA][()].transpose(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(torch.from_numpy(raw).double(), size=(84, 84), mode="area")
    got = torch.from_numpy(ds.images[CAMERA][:6]).double()
    assert (got - want).abs().max() <= 0.5                       # uint8 rounding of the exact average
    assert (ds.images[CAMERA][:6, 2] == (10 * np.arange(6))[:, None, None]).all()   # constants stay exact
    same = RobomimicDataset(_file_at(tmp_path, 84), [CAMERA], LOW_DIM, horizon=4, image_size=84)
    assert same.image_shape(CAMERA) == (3, 84, 84)               # the pipeline's size: read as it is
