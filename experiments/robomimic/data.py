"""Robomimic hdf5 files: checking, reading, writing, and the training dataset of action chunks.

The file schema (ARISE-Initiative/robomimic ``robomimic/scripts/conversion/convert_robosuite.py``,
``dataset_states_to_obs.py`` and ``robomimic/utils/dataset.py`` ``SequenceDataset``; the
diffusion-policy ``image_abs.hdf5`` files keep it):

    data                      attrs: env_args (a JSON string), total
    data/demo_N               attrs: num_samples (and model_file in robomimic's own files)
    data/demo_N/actions       (T, 7 per arm)
    data/demo_N/obs/<key>     camera images <camera>_image uint8 (T, H, W, 3); low-dim (T, D)
    data/demo_N/states, rewards, dones
    mask/<split>              byte strings of demo names (robomimic's train / valid filter keys)

Demos are taken in numeric order (demo_2 before demo_10), as robomimic's ``SequenceDataset``
sorts them (``np.argsort([int(elem[5:]) ...])``); a split's demos are sorted the same way.

Sequence sampling follows real-stanford/diffusion_policy ``diffusion_policy/common/sampler.py``
(``create_indices`` and ``SequenceSampler``, repeated in much-ado-about-noising
``mip/dataset_utils.py``): windows of ``horizon`` consecutive steps whose start runs from
-pad_before to T - horizon + pad_after within each episode, pad_before = obs_steps - 1 and
pad_after = action_steps - 1 (much-ado ``mip/datasets/robomimic_dataset.py`` ``make_dataset``;
diffusion_policy's robomimic image configs), both clipped to horizon - 1; a step outside the
episode repeats its first or last frame. ``RobomimicReplayImageDataset.__getitem__`` (both
repositories) returns the first obs_steps steps of the window as the observation and the whole
window as the actions, so action index obs_steps - 1 is the action taken at the current
observation; the policy executes indices obs_steps - 1 .. obs_steps - 2 + action_steps
(``policy.py``). Episodes shorter than horizon - pad_before - pad_after give no window, as there.

Absolute actions become 6-D rotations (``rotation.py``) and actions and low-dim observations are
normalised (``normalizer.py``) with statistics of this dataset's demos, or with a normalizer passed
in (the validation split uses the training split's). Images stay uint8, channels first.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np
import torch

from .normalizer import Normalizer, NormalizerDict, fit_low_dim
from .rotation import AXIS_ANGLE_ACTION_DIM, actions_to_rotation_6d, rotation_6d_action_dims

ROBOMIMIC_TASKS = ("lift", "can", "square", "transport", "tool_hang")
DIFFUSION_POLICY_DATA_URL = "https://diffusion-policy.cs.columbia.edu/data/training/robomimic_image.zip"


# ---------------------------------------------------------------------------------- file checks
def _missing_file_message(path: Path) -> str:
    task = next((t for t in ROBOMIMIC_TASKS if t in path.parts or f"{t}_" in path.name), "tool_hang")
    return (f"no robomimic dataset file at {path} (set task.dataset to the file's path). "
            f"Absolute-action image datasets, which rotation_6d expects: download {DIFFUSION_POLICY_DATA_URL} "
            f"(diffusion_policy's conversion) and unzip it; the file is "
            f"robomimic/datasets/{task}/ph/image_abs.hdf5. The original robomimic files (delta actions): "
            f"python -m robomimic.scripts.download_datasets --tasks {task} --dataset_types ph --hdf5_types image"
            + (f". Or make Lift demonstrations here, without a download (a scripted expert): "
               f"python -m experiments.robomimic.lift_expert --n 40 --out {path}" if task == "lift" else ""))


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable HDF5 file (possibly a truncated download; download it again): "
                      f"{error}")


def require_file(path) -> Path:
    """`path` as a Path when it is a file; FileNotFoundError saying where to get the dataset otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(_missing_file_message(path))
    return path


def check_inputs(t) -> None:
    """The task's dataset file is there (checked before a sweep is submitted)."""
    require_file(t.dataset)


def _open(path) -> h5py.File:
    path = require_file(path)
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise _unreadable(path, error) from error


def demo_sort_key(name: str) -> tuple:
    """demo_2 before demo_10; names without a number after the last "_" go last, by name."""
    tail = name.rsplit("_", 1)[-1]
    return (0, int(tail), name) if tail.isdigit() else (1, 0, name)


def _decode(name) -> str:
    return name.decode("utf-8") if isinstance(name, bytes | np.bytes_) else str(name)


def _demo_names(f: h5py.File, split: str | None, path) -> list[str]:
    data = f["data"]
    present = [k for k in data.keys() if isinstance(data[k], h5py.Group)]
    if split is None:
        names = present
    else:
        if "mask" not in f or split not in f["mask"]:
            masks = sorted(f["mask"].keys()) if "mask" in f else []
            raise KeyError(f"split mask 'mask/{split}' missing in {path} (masks present: {masks})")
        names = list(dict.fromkeys(_decode(n) for n in f["mask"][split][()]))
        for name in names:
            if name not in data:
                raise KeyError(f"demo '{name}' listed in mask/{split} is missing from group 'data' of {path}")
    if not names:
        raise ValueError(f"{path} has no demos" + (f" in mask/{split}" if split else " under group 'data'"))
    return sorted(names, key=demo_sort_key)


def validate(path, cameras: Sequence[str] = (), low_dim_keys: Sequence[str] = (),
             split: str | None = None) -> list[str]:
    """Check, before anything trains, that ``path`` is a readable robomimic file with ``env_args`` and,
    in every demo of ``split`` (every demo when None), ``actions`` (T, A) and the observation keys
    asked for, each with T steps and the same per-step shape across demos. Reads shapes only.
    Returns the demo names in numeric order.

    Raises FileNotFoundError (with the download commands) for a missing file, ValueError for an
    unreadable one or inconsistent shapes, KeyError naming the key and demo for a missing key."""
    path = Path(path)
    with _open(path) as f:
        try:
            if "data" not in f:
                raise KeyError(f"group 'data' missing in {path}: not a robomimic dataset")
            if "env_args" not in f["data"].attrs:
                raise KeyError(f"attribute 'env_args' missing on group 'data' of {path}")
            names = _demo_names(f, split, path)
            widths: dict = {}  # per-step shape of actions and each observation key, from the first demo
            for name in names:
                demo = f["data"][name]
                if "actions" not in demo:
                    raise KeyError(f"'actions' missing in demo {name} (data/{name}) of {path}")
                steps = _check_shape(demo["actions"], "actions", name, path, None, 2, widths)
                if (cameras or low_dim_keys) and "obs" not in demo:
                    raise KeyError(f"group 'obs' missing in demo {name} (data/{name}) of {path}")
                for key in cameras:
                    if key not in demo["obs"]:
                        raise KeyError(f"camera '{key}' missing in demo {name} (data/{name}/obs) of {path}; "
                                       f"it has {sorted(demo['obs'].keys())}")
                    shape = _check_shape(demo["obs"][key], key, name, path, steps, 4, widths)
                    if demo["obs"][key].shape[-1] != 3:
                        raise ValueError(f"camera '{key}' in demo {name} of {path} has shape {shape}, expected "
                                         "(T, H, W, 3)")
                for key in low_dim_keys:
                    if key not in demo["obs"]:
                        raise KeyError(f"low-dim key '{key}' missing in demo {name} (data/{name}/obs) of {path}; "
                                       f"it has {sorted(demo['obs'].keys())}")
                    _check_shape(demo["obs"][key], key, name, path, steps, 2, widths)
        except OSError as error:
            raise _unreadable(path, error) from error
    return names


def _check_shape(dataset, key, name, path, steps, ndim, widths) -> int:
    shape = tuple(dataset.shape)
    where = f"'{key}' in demo {name} of {path}"
    if len(shape) != ndim:
        raise ValueError(f"{where} has shape {shape}, expected {ndim} dimensions")
    if steps is not None and shape[0] != steps:
        raise ValueError(f"{where} has {shape[0]} steps but the demo's actions have {steps}")
    if widths.setdefault(key, shape[1:]) != shape[1:]:
        raise ValueError(f"{where} has per-step shape {shape[1:]}, other demos {widths[key]}")
    return shape[0]


def read_env_args(path) -> dict:
    """The environment description robomimic stores as the JSON attribute ``env_args`` of ``data``."""
    path = Path(path)
    with _open(path) as f:
        try:
            if "data" not in f or "env_args" not in f["data"].attrs:
                raise KeyError(f"attribute 'env_args' missing on group 'data' of {path}")
            raw = f["data"].attrs["env_args"]
        except OSError as error:
            raise _unreadable(path, error) from error
    return json.loads(_decode(raw))


def actions_are_absolute(env_args: Mapping) -> bool | None:
    """Whether env_args' controller takes absolute targets: robomimic / robosuite <= 1.4
    ``control_delta`` (False: absolute, diffusion_policy's image_abs files), robosuite 1.5
    ``input_type`` ("absolute" / "delta"); None when the controller config says neither."""
    found: list[bool] = []

    def walk(node):
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key == "control_delta" and isinstance(value, bool):
                    found.append(not value)
                elif key == "input_type" and value in ("absolute", "delta"):
                    found.append(value == "absolute")
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(env_args)
    return any(found) if found else None


# --------------------------------------------------------------------------------------- writing
def _mask_name(entry) -> str:
    return f"demo_{entry}" if isinstance(entry, int | np.integer) else _decode(entry)


def write_demo_file(path, demos: Sequence[Mapping], env_args, train_mask: Sequence | None = None,
                    valid_mask: Sequence | None = None, compression: str | None = None) -> Path:
    """Write ``demos`` (each {"obs": {key: (T, ...)}, "actions", "states", "rewards", "dones"}, optional
    "attrs": demo attributes such as model_file) as data/demo_0, demo_1, ... in robomimic's schema;
    ``env_args`` a dict (stored as JSON) or a JSON string; masks are demo names or indices, stored as
    mask/train and mask/valid. Written to a temporary file in the same folder, then renamed, so a
    crash never leaves a half-written file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            data = f.create_group("data")
            total = 0
            for i, demo in enumerate(demos):
                for key in ("obs", "actions", "states", "rewards", "dones"):
                    if key not in demo:
                        raise KeyError(f"demo {i} has no '{key}'")
                actions = np.asarray(demo["actions"])
                steps = len(actions)
                group = data.create_group(f"demo_{i}")
                for key in ("actions", "states", "rewards", "dones"):
                    value = np.asarray(demo[key])
                    if len(value) != steps:
                        raise ValueError(f"demo {i}: '{key}' has {len(value)} steps, actions {steps}")
                    group.create_dataset(key, data=value)
                obs = group.create_group("obs")
                for key, value in demo["obs"].items():
                    value = np.asarray(value)
                    if len(value) != steps:
                        raise ValueError(f"demo {i}: obs '{key}' has {len(value)} steps, actions {steps}")
                    obs.create_dataset(key, data=value, compression=compression if value.ndim >= 3 else None)
                group.attrs["num_samples"] = steps
                for key, value in dict(demo.get("attrs", {})).items():
                    group.attrs[key] = value
                total += steps
            data.attrs["total"] = total
            data.attrs["env_args"] = env_args if isinstance(env_args, str) else json.dumps(env_args)
            for split, mask in (("train", train_mask), ("valid", valid_mask)):
                if mask is not None:
                    f.create_dataset(f"mask/{split}", data=np.array([_mask_name(m) for m in mask], dtype="S"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------------------- dataset
def sequence_windows(episode_lengths: Sequence[int], horizon: int, pad_before: int, pad_after: int):
    """diffusion_policy's ``create_indices`` as arrays: for every window, the global index of its first
    step (before the episode's first index when padded) and its episode's first and last indices."""
    pad_before = min(max(pad_before, 0), horizon - 1)
    pad_after = min(max(pad_after, 0), horizon - 1)
    lengths = np.asarray(episode_lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    firsts = ends - lengths
    counts = np.maximum(lengths - horizon + pad_after + pad_before + 1, 0)
    episode = np.repeat(np.arange(len(lengths)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)  # 0 .. count-1
    start = firsts[episode] + within - pad_before
    return start, firsts[episode], ends[episode] - 1


NORMALIZATIONS = ("much_ado", "diffusion_policy")


def resize_frames(frames: np.ndarray, size) -> np.ndarray:
    """uint8 (T, C, H, W) frames at (h, w) = `size`: area-averaged (antialiased), or as they are."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).float()
    out = torch.nn.functional.interpolate(x, size=tuple(size), mode="area")
    return out.round_().clamp_(0, 255).to(torch.uint8).numpy()


class RobomimicDataset(torch.utils.data.Dataset):
    """Action chunks of a robomimic file, everything in memory.

    ``dataset[i]`` = {"obs": {camera: uint8 (obs_steps, 3, H, W), low-dim key: float32 (obs_steps, D)
    normalised}, "actions": float32 (horizon, action_dim) normalised}. ``cameras`` are full obs keys
    ("agentview_image"); ``split`` None takes every demo, a name takes mask/<split>; ``max_demos``
    the first N demos (numeric order) of the split; ``normalizer`` a ``NormalizerDict`` with
    "actions" and every low-dim key (fitted on these demos when None) with ``normalization``:
    "much_ado" (the pipeline the paper inherits: min-max on every action and low-dim feature) or
    "diffusion_policy" (rotation_6d entries and quaternions left as they are; ``normalizer.py``).
    ``image_size``: the pipeline's observation size (square); a file whose images differ is refused,
    naming both sizes, unless ``resize`` (then each frame is area-averaged to it on load). None: the
    file's size."""

    def __init__(self, path, cameras: Sequence[str], low_dim_keys: Sequence[str], horizon: int = 16,
                 obs_steps: int = 2, action_steps: int = 8, split: str | None = None, rotation_6d: bool = True,
                 max_demos: int | None = None, normalizer: NormalizerDict | None = None,
                 normalization: str = "much_ado", image_size: int | None = None, resize: bool = False) -> None:
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        if horizon < 1 or not 1 <= obs_steps <= horizon or action_steps < 1:
            raise ValueError(f"need horizon >= 1, 1 <= obs_steps <= horizon and action_steps >= 1, got horizon "
                             f"{horizon}, obs_steps {obs_steps}, action_steps {action_steps}")
        if max_demos is not None and max_demos < 1:
            raise ValueError(f"max_demos must be >= 1 or None, got {max_demos}")
        self.path, self.split = Path(path), split
        self.cameras, self.low_dim_keys = list(cameras), list(low_dim_keys)
        self.horizon, self.obs_steps, self.action_steps = horizon, obs_steps, action_steps
        self.rotation_6d = rotation_6d
        names = validate(self.path, self.cameras, self.low_dim_keys, split)
        self.demos = names[:max_demos] if max_demos is not None else names
        self.image_size, self.resize = image_size, resize
        self._check_image_size()
        if rotation_6d and actions_are_absolute(read_env_args(self.path)) is False:
            raise ValueError(f"{self.path} holds delta actions (its env_args controller is in delta mode, as in "
                             "robomimic's own image.hdf5); rotation_6d needs absolute actions: use diffusion_policy's "
                             "image_abs.hdf5 or set task.rotation_6d=false")

        raw_actions, low_dim, self.images, lengths = self._load()
        self.episode_lengths = np.asarray(lengths, dtype=np.int64)
        self.episode_ends = np.cumsum(self.episode_lengths)
        if rotation_6d:
            if raw_actions.shape[-1] % AXIS_ANGLE_ACTION_DIM:
                raise ValueError(f"{self.path}: actions of shape {raw_actions.shape} are not 7 numbers per arm "
                                 "[pos, axis-angle, gripper]; set task.rotation_6d=false for other actions")
            raw_actions = actions_to_rotation_6d(raw_actions)
        if normalizer is None and normalization == "much_ado":
            normalizer = NormalizerDict(actions=Normalizer.fit(raw_actions),
                                        **{key: Normalizer.fit(value) for key, value in low_dim.items()})
        elif normalizer is None:
            normalizer = NormalizerDict(
                actions=Normalizer.fit(raw_actions, rotation_6d_action_dims(raw_actions.shape[-1]) if rotation_6d
                                       else ()),
                **{key: fit_low_dim(key, value) for key, value in low_dim.items()})
        for key, value in (("actions", raw_actions), *low_dim.items()):
            if key not in normalizer:
                raise KeyError(f"the normalizer passed in has no entry '{key}' (it has {sorted(normalizer)})")
            if normalizer[key].dim != value.shape[-1]:
                raise ValueError(f"normalizer '{key}' has {normalizer[key].dim} features, the data {value.shape[-1]}")
        self.normalizer = normalizer
        self.actions = self._normalized("actions", raw_actions)
        self.low_dim = {key: self._normalized(key, value) for key, value in low_dim.items()}

        self._window_start, self._first, self._last = sequence_windows(
            self.episode_lengths, horizon, pad_before=obs_steps - 1, pad_after=action_steps - 1)
        if len(self._window_start) == 0:
            raise ValueError(f"no window of {horizon} steps fits the {len(self.demos)} demos of {self.path} "
                             f"(longest {self.episode_lengths.max()} steps)")
        self._offsets = np.arange(horizon, dtype=np.int64)

    def _load(self):
        with h5py.File(self.path, "r") as f:
            try:
                demos = [f["data"][name] for name in self.demos]
                lengths = [d["actions"].shape[0] for d in demos]
                ends = np.cumsum(lengths)
                bounds = list(zip(ends - lengths, ends, strict=True))
                total = int(ends[-1])
                actions = np.empty((total, demos[0]["actions"].shape[1]), dtype=np.float64)
                low_dim = {k: np.empty((total, *demos[0]["obs"][k].shape[1:]), dtype=np.float64)
                           for k in self.low_dim_keys}
                images = {}
                for key in self.cameras:
                    _, height, width, channels = demos[0]["obs"][key].shape
                    height, width = (self.image_size,) * 2 if self.image_size else (height, width)
                    images[key] = np.empty((total, channels, height, width), dtype=np.uint8)
                for demo, (a, b) in zip(demos, bounds, strict=True):
                    demo["actions"].read_direct(actions, dest_sel=np.s_[a:b])
                    for key, array in low_dim.items():
                        array[a:b] = demo["obs"][key][()]
                    for key, array in images.items():
                        array[a:b] = resize_frames(demo["obs"][key][()].transpose(0, 3, 1, 2), array.shape[-2:])
            except OSError as error:
                raise _unreadable(self.path, error) from error
        return actions, low_dim, images, lengths

    def _check_image_size(self) -> None:
        if not self.image_size:
            return
        with h5py.File(self.path, "r") as f:
            sizes = {key: tuple(f["data"][self.demos[0]]["obs"][key].shape[1:3]) for key in self.cameras}
        wrong = {key: size for key, size in sizes.items() if size != (self.image_size,) * 2}
        if wrong and not self.resize:
            key, (h, w) = next(iter(wrong.items()))
            raise ValueError(
                f"{self.path}: camera '{key}' images are {h}x{w}, the pipeline's observation size "
                f"(task.image_size) is {self.image_size}x{self.image_size}, which the rollouts render at. Set "
                f"task.resize=true to resize the frames on load, or regenerate the file at {self.image_size}x"
                f"{self.image_size} (robomimic's dataset_states_to_obs.py --camera_height {self.image_size} "
                f"--camera_width {self.image_size})")

    def _normalized(self, key: str, value: np.ndarray) -> np.ndarray:
        out = self.normalizer[key].normalize(torch.from_numpy(np.asarray(value, dtype=np.float64)))
        return np.ascontiguousarray(out.numpy(), dtype=np.float32)

    # ---------------------------------------------------------------------------- shapes
    @property
    def action_dim(self) -> int:
        return int(self.actions.shape[-1])

    def low_dim_shape(self, key: str) -> tuple:
        return tuple(self.low_dim[key].shape[1:])

    def image_shape(self, key: str) -> tuple:
        """(C, H, W)."""
        return tuple(self.images[key].shape[1:])

    # ---------------------------------------------------------------------------- sampling
    def window(self, index: int) -> np.ndarray:
        """The horizon global step indices of window ``index``, clipped to its episode (padding)."""
        return np.clip(self._window_start[index] + self._offsets, self._first[index], self._last[index])

    def __len__(self) -> int:
        return len(self._window_start)

    def __getitem__(self, index: int) -> dict:
        steps = self.window(index)
        seen = steps[:self.obs_steps]
        obs = {key: torch.from_numpy(self.images[key][seen]) for key in self.cameras}
        obs.update({key: torch.from_numpy(self.low_dim[key][seen]) for key in self.low_dim_keys})
        return {"obs": obs, "actions": torch.from_numpy(self.actions[steps])}
