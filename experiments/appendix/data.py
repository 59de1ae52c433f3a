"""The image sets of the appendix experiments, flattened to vectors, with the grafting appendix's
transform.

- ``digits``: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes; shipped inside
  scikit-learn, no download), pixels scaled to [0, 1].
- ``cifar10``: CIFAR-10's training batches in the python format (``cifar-10-batches-py/data_batch_1``
  ... ``_5`` under ``task.data_path``), pixels scaled to [0, 1]; the paper's set. Not downloadable here:
  a missing file is named in the error.

"Transformed" data (appendix "Moment Grafting Experiments"): each image rotated by 90 degrees, its
coordinates normalised from [0, 1] to [-1, 1], then tanh elementwise: a nonlinear, invertible map.
The split is the appendix's 0.8 : 0.2 train : validation, by a permutation fixed by `split_seed`.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def digits() -> tuple:
    """(images N x 1 x 8 x 8 in [0, 1], labels N)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(d.target)


def cifar10_root(data_path) -> Path:
    """The folder of CIFAR-10's python-format training batches; FileNotFoundError naming what is missing."""
    if not data_path:
        raise FileNotFoundError("task.data=cifar10 needs task.data_path=<folder holding cifar-10-batches-py/> "
                                "(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extracted)")
    root = Path(data_path)
    root = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
    missing = [f for f in CIFAR_FILES if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 is incomplete under {root}: missing {', '.join(missing)} "
                                "(extract https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz there)")
    return root


def check_inputs(t) -> None:
    """The task's input files are there (checked before a sweep is submitted): CIFAR-10's batches."""
    if t.get("data") == "cifar10":
        cifar10_root(t.get("data_path"))


def cifar10(data_path) -> tuple:
    """(images N x 3 x 32 x 32 in [0, 1], labels N) from the python-format training batches."""
    root = cifar10_root(data_path)
    xs, ys = [], []
    for f in CIFAR_FILES:
        with open(root / f, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"]))
    return torch.tensor(np.concatenate(xs), dtype=torch.float32) / 255.0, torch.tensor(np.concatenate(ys))


def transform(images: torch.Tensor) -> torch.Tensor:
    """Rotate by 90 degrees, normalise [0, 1] to [-1, 1], tanh elementwise."""
    return torch.tanh(2.0 * torch.rot90(images, 1, dims=(-2, -1)) - 1.0)


def load(t) -> dict:
    """{"train"|"val": (original N x D, transformed N x D, labels N)} for task `t` (data, data_path,
    split_seed, train_fraction)."""
    images, labels = {"digits": digits, "cifar10": lambda: cifar10(t.get("data_path"))}[t.data]()
    n = len(labels)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(t.split_seed)))
    n_train = int(round(float(t.train_fraction) * n))
    flat = lambda x: x.reshape(len(x), -1).contiguous()
    x, xt = flat(images), flat(transform(images))
    return {part: (x[idx], xt[idx], labels[idx])
            for part, idx in (("train", perm[:n_train]), ("val", perm[n_train:]))}
