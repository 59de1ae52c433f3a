"""The appendix family: moment grafting's transform and maps (float64), its data, a job and its report."""
import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from experiments.appendix import data as image_data
from experiments.appendix.grafting import Graft, moment_map, moments, sym_power
from experiments.appendix.model import mlp


def _batch(b, d, seed, scale):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * scale
    return torch.randn(b, d, generator=g, dtype=torch.float64) @ mix + torch.randn(d, generator=g, dtype=torch.float64)


def test_the_moment_map_gives_the_batch_the_target_mean_and_covariance_float64():
    x, xt = _batch(200, 12, 0, 1.0), torch.tanh(_batch(200, 12, 1, 3.0))
    mu_t, sigma_t = moments(xt)
    new = moment_map(x, mu_t, sigma_t, damping=0.0)
    mu, sigma = moments(new)
    # eigh-based square roots are backward stable: errors ~ cond(Sigma) * 1e-16 relative (cond ~ 1e3 here)
    assert torch.allclose(mu, mu_t, atol=1e-10 * mu_t.abs().max().item())
    assert torch.allclose(sigma, sigma_t, atol=1e-10 * sigma_t.abs().max().item())
    # with the appendix's damping delta = 1e-6 tr(A) each square root is off by a relative
    # delta / lambda_min(A) at most in its weakest direction: the matched covariance is off by about
    # the sum of the two (the factor 2 covers the second-order terms)
    damped = moments(moment_map(x, mu_t, sigma_t))[1]
    sigma = moments(x)[1]
    bound = 2 * sum(1e-6 * torch.trace(a) / torch.linalg.eigvalsh(a)[0] for a in (sigma, sigma_t))
    assert 0 < (damped - sigma_t).norm() / sigma_t.norm() < bound


def test_sym_power_is_the_damped_matrix_power():
    a = moments(_batch(50, 6, 2, 1.0))[1]
    root = sym_power(a, 0.5, damping=0.0)
    assert torch.allclose(root @ root, a, atol=1e-12 * a.norm().item())
    inv_root = sym_power(a, -0.5, damping=1e-3)
    damped = a + 1e-3 * torch.trace(a) * torch.eye(6, dtype=torch.float64)
    assert torch.allclose(inv_root @ damped @ inv_root, torch.eye(6, dtype=torch.float64), atol=1e-10)


def test_the_transform_rotates_by_90_degrees_then_maps_0_1_to_tanh_of_minus_1_1():
    img = torch.zeros(1, 1, 2, 2)
    img[0, 0, 0, 1] = 1.0   # top right
    out = image_data.transform(img)
    assert out[0, 0, 0, 0] == pytest.approx(torch.tanh(torch.tensor(1.0)).item())   # rot90 moves it top left
    assert (out.flatten()[1:] == torch.tanh(torch.tensor(-1.0))).all()


def test_the_graft_maps_each_layer_input_to_the_source_models_moments():
    src, dst = mlp(5, 7, 3).double(), mlp(5, 7, 3).double()
    graft = Graft(src, dst, damping=0.0)
    seen = []
    for m in dst.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].detach()))   # after the graft's hook
    xs, x = _batch(64, 5, 3, 2.0), _batch(64, 5, 4, 0.5)
    src(xs)
    dst(x)
    assert len(seen) == 3
    for got, (mu_t, sigma_t) in zip(seen, graft.targets):
        mu, sigma = moments(got)
        assert torch.allclose(mu, mu_t, atol=1e-9) and torch.allclose(sigma, sigma_t, atol=1e-9)
    graft.enabled = False
    assert torch.equal(dst(x), mlp_without_hooks(dst)(x))
    graft.remove()
    Graft(mlp(5, 7, 3).double(), dst)   # a source that has not run yet
    with pytest.raises(RuntimeError, match="run the source model on the matching batch"):
        dst(x)


def mlp_without_hooks(model):
    import copy

    clone = copy.deepcopy(model)
    for m in clone.modules():
        m._forward_pre_hooks.clear()
    return clone


def write_cifar_batches(folder, images_per_batch: int) -> "Path":
    """CIFAR-10's python-format training batches (random pixels and labels) under folder/cifar-10-batches-py."""
    import pickle

    import numpy as np

    root = folder / "cifar-10-batches-py"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        batch = {b"data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, images_per_batch)]}
        (root / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    return folder


def test_the_cifar_reader_returns_images_in_0_1_with_their_labels_in_file_order(tmp_path):
    import pickle

    folder = write_cifar_batches(tmp_path, images_per_batch=3)
    images, labels = image_data.cifar10(folder)
    assert images.shape == (15, 3, 32, 32) and labels.shape == (15,)
    first = pickle.loads((folder / "cifar-10-batches-py" / "data_batch_1").read_bytes())
    assert torch.equal(images[0].flatten(), torch.tensor(first[b"data"][0], dtype=torch.float32) / 255)
    assert labels[:3].tolist() == first[b"labels"]


def test_missing_cifar_names_the_files_and_where_to_get_them(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="missing data_batch_2, data_batch_3, data_batch_4, data_batch_5"):
        image_data.cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="task.data_path=<folder holding cifar-10-batches-py/>"):
        image_data.cifar10(None)
