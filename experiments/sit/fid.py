"""Sample quality: the Frechet distance between Gaussian fits of two feature sets, in Inception features
(FID, the paper's metric) or, for the CPU analogues, in the features of a classifier trained on the same
data (``FD-digits``, ``FD-mnist``: Frechet distances, not FID; their numbers are not comparable with any FID).

    FD = |mu_1 - mu_2|^2 + tr(S_1 + S_2 - 2 (S_1 S_2)^(1/2))

Inception: the network of clean-fid (``InceptionV3W``: the TorchScript port of the TF Inception used
for FID, ``inception-2015-12-05.pt``) with clean-fid's "clean" resize to 299 x 299 (PIL bicubic on the
uint8 image). The weights are never downloaded here: put the file in ``task.fid.inception_dir``.
Reference statistics: an ``.npz`` with ``mu`` and ``sigma`` (``python -m experiments.sit.fid reference
--data-path <ImageNet train> --out ref.npz`` computes them with the same network from center-cropped
training images, as SiT/ADM's reference batch does).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

INCEPTION_FILE = "inception-2015-12-05.pt"
INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"


def feature_statistics(features) -> tuple:
    """(mean, covariance) in float64 of features (N, D), N >= 2."""
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors of shape (N, D), got {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """The Frechet distance between N(mu1, sigma1) and N(mu2, sigma2). A singular product gets eps on
    both diagonals (the usual offset); the imaginary part of the matrix square root, from rounding, is
    dropped when it is small and an error otherwise."""
    from scipy import linalg

    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    s1, s2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    if mu1.shape != mu2.shape or s1.shape != s2.shape:
        raise ValueError(f"feature statistics differ in shape: {mu1.shape}/{s1.shape} vs {mu2.shape}/{s2.shape}")
    with warnings.catch_warnings():   # singular products (dead ReLU features) are usual; the result is checked
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        covmean = linalg.sqrtm(s1 @ s2)
    if not np.isfinite(covmean).all():
        offset = np.eye(s1.shape[0]) * eps
        covmean = linalg.sqrtm((s1 + offset) @ (s2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"matrix square root has an imaginary part {np.max(np.abs(covmean.imag)):.3g}")
        covmean = covmean.real
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def frechet_distance_of(features_a, features_b) -> float:
    return frechet_distance(*feature_statistics(features_a), *feature_statistics(features_b))


class InceptionFeatures(nn.Module):
    """uint8 images (N, 3, H, W) -> Inception pool features (N, 2048), clean-fid's network and resize."""

    def __init__(self, inception_dir) -> None:
        super().__init__()
        path = Path(inception_dir) / INCEPTION_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"FID needs the Inception weights {path}: download {INCEPTION_URL} on a machine with network "
                f"and put the file in {Path(inception_dir)} (task.fid.inception_dir)")
        try:
            from cleanfid.inception_torchscript import InceptionV3W
            from cleanfid.resize import build_resizer
        except ImportError as e:
            raise ImportError("FID needs clean-fid: `make setup` installs it (or pip install clean-fid)") from e
        self.net = InceptionV3W(str(path.parent), download=False)
        self.resize = build_resizer("clean")

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        device = next(self.net.parameters(), torch.empty(0)).device
        arr = images.permute(0, 2, 3, 1).cpu().numpy().astype(np.uint8)
        x = np.stack([self.resize(a) for a in arr]).transpose(0, 3, 1, 2)
        return self.net(torch.from_numpy(x).float().to(device))


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] float images -> uint8 [0, 255] (SiT's sample script: clamp(127.5 x + 128, 0, 255))."""
    return torch.clamp(127.5 * images + 128.0, 0, 255).to(torch.uint8)


def load_reference(path) -> tuple:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"FID reference statistics {path} do not exist: compute them once with `python -m experiments.sit.fid "
            f"reference --data-path <ImageNet train dir> --out {path}` (task.fid.reference)")
    with np.load(path) as f:
        if "mu" not in f or "sigma" not in f:
            raise ValueError(f"{path} must hold arrays 'mu' and 'sigma', it holds {list(f.keys())}")
        return f["mu"], f["sigma"]


# ------------------------------------------------------------------- the CPU analogue's feature space
class DigitClassifier(nn.Module):
    """A small CNN on 1-channel digits of side ``size``; ``features`` is the 64-d layer before the logits.
    Up to 8x8: two 3x3 convolutions, then one 2x2 pooling. Larger images are pooled after each
    convolution down to a side of 8 or less, then convolved once more (28x28: 14, 7), which keeps the
    wide convolutions off the full resolution."""

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        if size < 2:
            raise ValueError(f"DigitClassifier: image side {size} < 2")
        conv = lambda c: [nn.Conv2d(c, 32, 3, padding=1), nn.ReLU()]   # noqa: E731
        if size <= 8:
            layers, side = [*conv(1), *conv(32), nn.MaxPool2d(2)], size // 2
        else:
            layers, side = [*conv(1), nn.MaxPool2d(2)], size // 2
            while side > 8:
                layers, side = [*layers, *conv(32), nn.MaxPool2d(2)], side // 2
            layers += conv(32)
        self.body = nn.Sequential(*layers, nn.Flatten(), nn.Linear(32 * side * side, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train_digit_classifier(images, labels, steps: int = 600, seed: int = 0) -> tuple:
    """(classifier, held-out accuracy): Adam on 80% of the images with small random shifts (up to one
    pixel per 14 of the side, at least one), deterministic."""
    size = images.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(labels), generator=gen)
    cut = int(0.8 * len(labels))
    tr, te = perm[:cut], perm[cut:]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = DigitClassifier(size)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    reach = max(1, size // 14)
    for _ in tqdm(range(steps), desc="FD feature classifier", leave=False, mininterval=1.0,
                  dynamic_ncols=True):
        idx = tr[torch.randint(len(tr), (128,), generator=gen)]
        x = images[idx]
        shift = torch.randint(-reach, reach + 1, (2,), generator=gen).tolist()
        x = torch.roll(x, shifts=shift, dims=(2, 3))
        loss = nn.functional.cross_entropy(net(x), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval().requires_grad_(False)
    with torch.no_grad():
        acc = float((net(images[te]).argmax(1) == labels[te]).float().mean())
    return net, acc


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="FID reference statistics of an ImageFolder (Inception features)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--data-path", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--inception-dir", default="data/fid")
    r.add_argument("--image-size", type=int, default=256)
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--batch-size", type=int, default=100)
    a = p.parse_args(argv)
    from .data import ImageFolder

    net = InceptionFeatures(a.inception_dir)
    data = ImageFolder(a.data_path, a.image_size, flip=False)
    n = len(data) if a.limit is None else min(a.limit, len(data))
    feats = []
    for i in range(0, n, a.batch_size):
        batch = torch.stack([data.load(j, False) for j in range(i, min(i + a.batch_size, n))])
        feats.append(net(to_uint8(batch)).cpu().numpy())
    mu, sigma = feature_statistics(np.concatenate(feats))
    tmp = Path(a.out + ".tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma)
    tmp.rename(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
