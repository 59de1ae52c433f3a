"""The image-policy family end to end without the simulator: training per GP, resume, coverage,
the policy's executed actions, the report and the errors a user sees."""
import csv
import json
import math
import statistics

import numpy as np
import pytest
import torch

pytest.importorskip("h5py")

from experiments.common.launch import run_job  # noqa: E402
from experiments.common.optim import optim_name  # noqa: E402
from experiments.common.report import load_records  # noqa: E402
from experiments.robomimic import report as robomimic_report  # noqa: E402
from experiments.robomimic.data import RobomimicDataset, write_demo_file  # noqa: E402
from experiments.robomimic.policy import FlowPolicy, PolicyRunner  # noqa: E402
from experiments.robomimic.rotation import actions_to_rotation_6d  # noqa: E402

CAMERAS = ["agentview_image", "robot0_eye_in_hand_image"]
LOW_DIM = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]
ENV_ARGS = {"env_name": "Lift", "type": 1, "env_kwargs": {"robots": ["Panda"], "controller_configs": {
    "type": "BASIC", "body_parts": {"right": {"type": "OSC_POSE", "input_type": "absolute"}}}}}
TINY = ["task.encoder.feature_dim=8", "task.encoder.width=4", "task.encoder.crop=[12,12]", "task.unet.model_dim=8",
        "task.unet.emb_dim=8", "task.unet.dim_mult=[1,2]", "task.unet.n_groups=2", "task.horizon=8",
        "task.action_steps=4", "task.image_size=null"]   # the generated files are 16x16


def demo(d: int, steps: int, rng) -> dict:
    t = np.arange(steps) / steps
    pos = np.stack([0.1 * t + 0.01 * d, 0.05 * np.sin(3 * t), 0.9 - 0.1 * t], -1)
    rot = np.stack([np.pi - 0.1 * t, 0.05 * t, 0 * t], -1)
    grip = np.where(t > 0.5, 1.0, -1.0)[:, None]
    obs = {k: rng.integers(0, 256, (steps, 16, 16, 3), dtype=np.uint8) for k in CAMERAS}
    obs.update(robot0_eef_pos=pos + 0.001 * rng.normal(size=pos.shape), robot0_eef_quat=np.tile([1.0, 0, 0, 0], (steps, 1)),
               robot0_gripper_qpos=np.stack([0.04 * (1 - t), -0.04 * (1 - t)], -1))
    return {"obs": obs, "actions": np.concatenate([pos, rot, grip], -1), "states": np.zeros((steps, 4)),
            "rewards": (t > 0.9).astype(float), "dones": (np.arange(steps) == steps - 1).astype(np.int64)}


@pytest.fixture(scope="module")
def lift_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("robomimic") / "image_abs.hdf5"
    return write_demo_file(path, [demo(d, 24 + d, rng) for d in range(5)], ENV_ARGS, train_mask=[0, 1, 2, 3],
                           valid_mask=[4])


def _train(path, out, *overrides):
    from conftest import _compose
    cfg = _compose("task=robomimic_lift", f"task.dataset={path}", "task.eval_episodes=0", "task.steps=20",
                   "task.log_every=10", "task.batch_size=8", "task.checkpoint_every=0", *TINY, *overrides)
    return run_job(cfg, out)


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("gp", ["adamw", "muon", "signum", "adamuon", "sgd"])
def test_twenty_steps_per_gp_plain_and_dopr(gp, lift_file, tmp_path):
    for name in (gp, f"dopr_{gp}"):
        s = _train(lift_file, tmp_path / name, f"optim={name}", "ap.conv2d=sua")
        rows = _rows(tmp_path / name)
        assert [r["step"] for r in rows] == [10, 20]
        assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in rows)
        assert s["optim"] == name and s["steps"] == 20 and s["best_success"] is None  # no rollouts asked
        assert (tmp_path / name / "policy.pt").exists()
        if name.startswith("dopr_"):
            assert s["dopr"]["steps"] == 20 and s["dopr"]["preconditioned"] > 0 and s["damping"] == 1e-4
            assert s["conventions"]["damping_mode"] == "trace"


@pytest.mark.slow
def test_training_learns_the_demonstrations(lift_file, tmp_path):
    s = _train(lift_file, tmp_path, "optim=adamw", "optim.lr=3e-3", "task.steps=120", "task.log_every=20")
    rows = _rows(tmp_path)
    losses, val = [r["train_loss"] for r in rows], [r["val_loss"] for r in rows]
    assert losses[-1] < 0.85 * losses[0], losses  # the flow loss has a floor (noise): it falls slowly
    assert all(b < a for a, b in zip(val, val[1:])), val  # the held-out demo, fixed noise: steadily down
    assert s["train_loss"] == losses[-1]


@pytest.mark.slow
def test_a_resumed_job_ends_where_an_unbroken_one_does(lift_file, tmp_path, monkeypatch):
    args = ("optim=dopr_adamw", "ap.grad_ema=0.9", "ap.precond_ema=0.9", "task.checkpoint_every=10")
    _train(lift_file, tmp_path / "unbroken", *args)
    # the same job, stopped after its step-10 checkpoint, then started again in its directory
    from experiments.common import run as run_module
    calls = {"n": 0}
    save = run_module.Run.save_checkpoint

    def save_then_die(self, state):
        save(self, state)
        calls["n"] += 1
        raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(run_module.Run, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _train(lift_file, tmp_path / "broken", *args)
    monkeypatch.setattr(run_module.Run, "save_checkpoint", save)
    assert calls["n"] == 1 and not (tmp_path / "broken" / "summary.json").exists()
    s = _train(lift_file, tmp_path / "broken", *args)
    a = torch.load(tmp_path / "unbroken" / "policy.pt", weights_only=False)["policy"]
    b = torch.load(tmp_path / "broken" / "policy.pt", weights_only=False)["policy"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in _rows(tmp_path / "broken")] == [10, 20]
    assert s["train_loss"] == _rows(tmp_path / "unbroken")[-1]["train_loss"]


def test_coverage_lists_film_conv1d_convtranspose1d_and_sua_conv2d():
    import dopr
    policy = FlowPolicy(CAMERAS, {"robot0_eef_pos": 3}, action_dim=10, horizon=8, obs_steps=2, action_steps=4,
                        encoder={"feature_dim": 8, "width": 4, "crop": [12, 12]},
                        unet={"model_dim": 8, "emb_dim": 8, "dim_mult": [1, 2], "n_groups": 2})
    opt = dopr.build(policy, "adamw", ap={"conv2d": "sua"}, lr=1e-3)
    modules = dict(policy.named_modules())
    cov = {e.name: e for e in opt.coverage()}
    film = [n for n, m in modules.items() if n.endswith("cond_encoder.1") or ".film" in n]
    film = [n for n in film if isinstance(modules[n], torch.nn.Linear)]
    assert film, "the FiLM layers are nn.Linear modules"
    for kind, mode in ((torch.nn.Conv1d, "conv1d-full"), (torch.nn.ConvTranspose1d, "convtranspose1d-full"),
                       (torch.nn.Conv2d, "conv2d-sua")):
        names = [n for n, m in modules.items() if type(m) is kind]
        assert names and all(cov[n].status == "preconditioned" and cov[n].mode == mode for n in names), kind
    assert all(cov[n].status == "preconditioned" for n in film)
    opt.close()


def test_the_runner_executes_the_chunk_after_the_current_observation(lift_file, monkeypatch):
    data = RobomimicDataset(lift_file, CAMERAS, LOW_DIM, horizon=8, obs_steps=2, action_steps=4)
    policy = FlowPolicy(CAMERAS, {k: data.low_dim_shape(k)[-1] for k in LOW_DIM}, 10, 8, 2, 4,
                        encoder={"feature_dim": 8, "width": 4, "crop": [12, 12]},
                        unet={"model_dim": 8, "emb_dim": 8, "dim_mult": [1, 2], "n_groups": 2})
    raw = np.concatenate([np.linspace(0, 0.1, 8)[:, None] * np.ones(3), np.tile([0.3, -0.2, 0.1], (8, 1)),
                          np.ones((8, 1))], -1)  # (H, 7) absolute actions, step h at x = h / 70
    chunk = data.normalizer["actions"].normalize(torch.as_tensor(actions_to_rotation_6d(raw)))
    seen = {}

    def sample(obs, steps, generator=None):
        seen["obs"], seen["steps"] = obs, steps
        return chunk.float().expand(3, -1, -1)

    monkeypatch.setattr(policy, "sample", sample)
    runner = PolicyRunner(policy, data.normalizer, steps=9, device="cpu")
    obs = {k: np.stack([data[i]["obs"][k].numpy() for i in range(3)]) for k in CAMERAS}
    raw_pos = np.full((3, 2, 3), 0.05)
    obs.update(robot0_eef_pos=raw_pos, robot0_eef_quat=np.tile([1.0, 0, 0, 0], (3, 2, 1)),
               robot0_gripper_qpos=np.zeros((3, 2, 2)))
    out = runner(obs)
    assert out.shape == (3, 4, 7) and seen["steps"] == 9 and runner.calls == 1
    np.testing.assert_allclose(out[0], raw[1:5], atol=1e-5)  # steps obs_steps - 1 .. obs_steps + 2
    expected = data.normalizer["robot0_eef_pos"].normalize(torch.as_tensor(raw_pos)).float()
    torch.testing.assert_close(seen["obs"]["robot0_eef_pos"], expected)  # low-dim normalised as in training
    assert seen["obs"]["agentview_image"].dtype == torch.uint8


def test_missing_dataset_names_the_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_datasets"):
        _train(tmp_path / "nowhere" / "image_abs.hdf5", tmp_path / "job", "optim=adamw")
    assert not (tmp_path / "job" / "summary.json").exists()


def test_horizon_must_suit_the_unet():
    with pytest.raises(ValueError, match="horizon 10 must be divisible by 4"):
        FlowPolicy(CAMERAS, {}, 10, horizon=10, obs_steps=2, action_steps=4,
                   encoder={"feature_dim": 8, "width": 4, "crop": [12, 12]},
                   unet={"model_dim": 8, "emb_dim": 8, "dim_mult": [1, 2, 2], "n_groups": 2})


def test_report_tables_and_figures(tmp_path):
    sweep = tmp_path / "multirun"
    for i, (name, curve) in enumerate([("adamw", [0.2, 0.4, 0.3]), ("adamw", [0.1, 0.5, 0.5]),
                                       ("dopr_adamw", [0.3, 0.6, 0.7]), ("dopr_adamw", [0.4, 0.5, 0.8])]):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text("task: {name: robomimic_lift, report: "
                                                     "experiments.robomimic.report.success}\n")
        evals = {str(500 * (k + 1)): {"success_9": v, "successes_9": [1.0] * int(10 * v) + [0.0] * (10 - int(10 * v))}
                 for k, v in enumerate(curve)}
        best_step = max(evals, key=lambda s: (evals[s]["success_9"], -int(s)))
        summary = {"task": "robomimic_lift", "optim": name, "seed": i, "lr": 1e-4, "weight_decay": 1e-5,
                   "damping": 1e-4 if name.startswith("dopr") else None, "grad_ema": 0.9, "precond_ema": 0.9,
                   "grad_clip_norm": 10.0, "steps": 1500, "evals": evals,
                   "success_curve": {s: e["success_9"] for s, e in evals.items()},
                   "best_success": evals[best_step]["success_9"], "best_step": int(best_step),
                   "best_successes": evals[best_step]["successes_9"], "train_loss": 0.1 + i, "val_loss": None,
                   "step_time_s": 0.5, "conventions": {"damping_mode": "trace"} if name.startswith("dopr") else {}}
        (job / "summary.json").write_text(json.dumps(summary))
        (job / "metrics.jsonl").write_text("\n".join(json.dumps({"step": 500 * (k + 1), "train_loss": 1.0 / (k + 1)})
                                                     for k in range(3)))
    records = load_records([sweep])
    robomimic_report.success(records, tmp_path / "out", "stamp")
    rows = {r["optimizer"]: r for r in robomimic_report.rows(records)}
    assert rows["adamw"]["seed_best_min"] == 0.4 and rows["adamw"]["seed_best_max"] == 0.5
    assert rows["dopr_adamw"]["seed_best_median"] == pytest.approx(0.75)
    assert rows["adamw"]["best_steps"] == "1000 1000"
    assert rows["dopr_adamw"]["best_success_mean"] == pytest.approx(0.75, abs=0.03)  # bootstrap of 7 + 8 of 20
    delta = robomimic_report.deltas(list(rows.values()))
    assert delta == [{"task": "robomimic_lift", "gp": "adamw", "gp_best_median": 0.45, "dopr_best_median": 0.75,
                      "delta": pytest.approx(0.3), "delta_pct": pytest.approx(100 * 0.3 / 0.45), "dopr_better": "yes",
                      "seed_ranges_overlap": "no", "gp_train_loss": pytest.approx(0.6), "dopr_train_loss": 2.6}]
    for f in ("robomimic_success.md", "robomimic_success.csv", "robomimic_deltas.md", "robomimic_success.png",
              "robomimic_train_loss.png"):
        assert (tmp_path / "out" / f).exists(), f
    assert "stamp" in (tmp_path / "out" / "robomimic_success.md").read_text()
    # the per-seed file: each aggregate of the table recomputes from it (issue 74 item 2)
    with open(tmp_path / "out" / "robomimic_runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert [(r["optimizer"], r["seed"]) for r in runs] == [("adamw", "0"), ("adamw", "1"), ("dopr_adamw", "2"),
                                                           ("dopr_adamw", "3")]
    for name, row in rows.items():
        mine = [r for r in runs if r["optimizer"] == name]
        assert statistics.median(float(r["train_loss"]) for r in mine) == pytest.approx(row["train_loss_median"])
        assert min(float(r["best_success"]) for r in mine) == row["seed_best_min"]
        assert statistics.median(float(r["best_success"]) for r in mine) == pytest.approx(row["seed_best_median"])


@pytest.mark.parametrize("task,optim,lr,wd,clip,steps,ema", [
    ("robomimic_toolhang", "adamw", 1e-4, 1e-5, 10.0, 300000, None),
    ("robomimic_toolhang", "dopr_muon", 3e-4, 0.1, 1.0, 200000, 0.9),
    ("robomimic_transport", "dopr_adamw", 1e-4, 1e-5, 10.0, 300000, 0.0),
    ("robomimic_transport", "muon", 1e-4, 0.1, 1.0, 200000, None)])
def test_paper_presets(task, optim, lr, wd, clip, steps, ema, compose):
    """Tables tab:toolhang_hparams and tab:transport_hparams, and the paper's shared settings."""
    cfg = compose(f"task={task}", f"+tuned/{task}={optim}")
    assert (optim_name(cfg.optim), cfg.optim.lr, cfg.optim.weight_decay) == (optim, lr, wd)
    assert (cfg.task.grad_clip_norm, cfg.task.steps, cfg.task.batch_size, cfg.task.eval_every) == (clip, steps, 256,
                                                                                                   20000)
    assert cfg.task.sample_steps[0] == 9 and cfg.task.obs_steps == 2 and cfg.task.action_steps == 8
    if "muon" in optim:
        assert cfg.optim.momentum == 0.95 and cfg.optim.adjust_lr_fn == "match_rms_adamw"
    if ema is not None:
        assert (cfg.ap.damping, cfg.ap.damping_mode, cfg.ap.conv2d) == (1e-4, "trace", "sua")
        assert cfg.ap.grad_ema == cfg.ap.precond_ema == ema


def test_the_step_benchmark_times_a_registered_model(tmp_path):
    """benchmarks.bench with a task registered from outside it (as benchmarks.bench_family does a family's)."""
    from benchmarks import bench

    def make():
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
        # no targets: the model's output is the loss's only input (as the flow policy's loss module)
        return model, torch.randn(16, 3, 8, 8), None, lambda out, _: out.square().mean()

    bench.register_task("tiny_conv", make, {"conv2d": "sua"})
    out = tmp_path / "bench.md"
    bench.main(["--models", "tiny_conv", "--gps", "adamw", "--repeats", "3", "--budget", "1", "--threads", "1",
                "--precond-every", "1", "--out", str(out)], command="python -m tiny")
    text = out.read_text()
    assert text.startswith("`python -m tiny`")
    gp_part, _, peer_part = text.partition("#### tiny_conv: the peers, R against AdamW")
    rows = [line.split("|")[1].strip() for line in gp_part.splitlines() if line.startswith("| ") and "optimizer" not in line]
    assert rows == ["adamw", "dopr_adamw"]
    assert "2/2 parametrised modules preconditioned" in text  # the Conv2d (SUA) and the Linear
    # a family's benchmark gets the peer rows too (issue 64): each ran, a 4-d convolution kernel included
    peers = [line.split("|")[1:-1] for line in peer_part.splitlines() if line.startswith("| ") and "optimizer" not in line]
    assert [cells[0].strip() for cells in peers] == ["adamw", "dopr_adamw", "soap f=10", "soap f=1", "shampoo",
                                                     "kron p=schedule", "kron p=1"]
    assert all(float(cells[3]) > 0 for cells in peers)
