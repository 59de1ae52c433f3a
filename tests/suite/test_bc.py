"""MuJoCo behaviour cloning: SAC expert resume, demonstration files, BC runs, EMA evaluation, bootstrap."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gymnasium")
pytest.importorskip("mujoco")

from experiments.bc import demos, train  # noqa: E402
from experiments.bc import report as bc_report  # noqa: E402
from experiments.bc.evaluate import rollout  # noqa: E402
from experiments.common.launch import run_job  # noqa: E402
from experiments.common.optim import optim_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPS = ["adamw", "muon", "signum", "adamuon"]


def _bc(demo_path, tmp, *overrides):
    from conftest import _compose  # what the `compose` fixture returns, for this helper
    cfg = _compose("task=halfcheetah", f"task.demos={demo_path}", "task.num_trajectories=2",
                   "task.max_trajectories=2", "task.val_trajectories=1", "debug=default", *overrides)
    return run_job(cfg, tmp)


# ------------------------------------------------------------------------------------------- expert
@pytest.mark.slow
def test_expert_training_is_interrupted_and_resumes(tmp_path):
    small = ["task=expert", "task.env=HalfCheetah-v5", "task.hidden=32", "task.batch_size=32", "task.learning_starts=500",
             "task.eval_every=1000", "task.eval_episodes=1", "task.final_eval_episodes=2", "task.checkpoint_every=1000",
             "task.buffer_size=5000"]
    out = tmp_path / "expert"

    def cli(*args):  # the user's command line; the same hydra.run.dir resumes
        res = subprocess.run([sys.executable, str(ROOT / "run.py"), *small, *args, f"hydra.run.dir={out}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())

    first = cli("task.total_steps=2000")  # "interrupted" after its 2000-step budget
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)["state"]
    assert ckpt["step"] == 2000 and first["train_steps"] == 2000
    with np.load(out / "replay.npz") as z:
        assert int(z["step"]) == 2000 and int(z["size"]) == 2000
    second = cli("task.total_steps=3000")
    assert second["train_steps"] == 3000
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in rows if "eval_return" in r]
    assert evals == [1000, 2000, 3000]  # every evaluation logged once across the two runs
    with np.load(out / "replay.npz") as z:  # buffer restored and extended, not restarted
        assert int(z["step"]) == 3000 and int(z["size"]) == 3000
    blob = torch.load(out / "expert.pt", weights_only=False)
    assert blob["env"] == "HalfCheetah-v5" and blob["eval_episodes"] == 2 and np.isfinite(blob["return_mean"])
    # publishing: weights plus the returns and the command that made them
    from experiments.bc.expert import load_expert, publish

    pt = publish(out, "vtest", root=tmp_path / "experts")
    meta = json.loads(pt.with_suffix(".json").read_text())
    assert meta["return_mean"] == blob["return_mean"] and meta["train_steps"] == 3000
    assert meta["command"].startswith("python run.py") and "task.total_steps=3000" in meta["command"]
    # the training time covers both launches (3 evaluations of 1000 steps each), not only the last one
    per_eval = [1000 / r["steps_per_s"] for r in rows if "steps_per_s" in r]
    assert len(per_eval) == 3 and meta["train_time_s"] == pytest.approx(sum(per_eval), abs=0.1)
    assert meta["wall_time_s"] == second["wall_time_s"] > first["wall_time_s"]  # the clock ran on across the resume
    _, actor = load_expert(pt)
    assert torch.equal(actor.net[0].weight, blob["actor"]["net.0.weight"])


def test_resume_refuses_a_replay_buffer_from_another_step(tmp_path):
    from experiments.bc.sac import ReplayBuffer

    buf = ReplayBuffer(10, 3, 2)
    for i in range(4):
        buf.add(np.full(3, i), np.zeros(2), float(i), np.zeros(3), 0.0)
    buf.save(tmp_path / "r.npz", step=4)
    other = ReplayBuffer(10, 3, 2)
    other.load(tmp_path / "r.npz", step=4)
    assert other.size == 4 and np.array_equal(other.rew[:4], [0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="replay buffer of step 4, but the checkpoint is at step 7"):
        other.load(tmp_path / "r.npz", step=7)


# ------------------------------------------------------------------------------------ demonstrations
def test_demonstration_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    policy = lambda obs: rng.uniform(-1, 1, (len(obs), 3)).astype(np.float32)
    traj = rollout("Hopper-v5", policy, 4, seed=7, batch=2, record=True)
    path = demos.write(tmp_path / "d.npz", "Hopper-v5", traj, expert="x.pt")
    d = demos.load(path, "Hopper-v5")
    assert len(d) == 4 and d.env == "Hopper-v5" and list(d.seeds) == [7, 8, 9, 10]
    for i in range(4):
        assert np.array_equal(d.observations[i], traj["observations"][i])
        assert np.array_equal(d.actions[i], traj["actions"][i])
        assert len(d.rewards[i]) == traj["lengths"][i]
        assert d.returns[i] == pytest.approx(traj["rewards"][i].sum(), rel=1e-5)
    tr, va = d.split(2, 1)
    assert len(tr) == 2 and len(va) == 1 and np.array_equal(va.observations[0], d.observations[3])
    with pytest.raises(ValueError, match="only 4"):
        d.split(4, 1)
    with pytest.raises(ValueError, match="not 'Humanoid-v5'"):
        demos.load(path, "Humanoid-v5")


def test_rollout_seeds_make_episodes_reproducible():
    zero = lambda obs: np.zeros((len(obs), 6), np.float32)
    a = rollout("HalfCheetah-v5", zero, 3, seed=5, batch=3)
    b = rollout("HalfCheetah-v5", zero, 3, seed=5, batch=1)  # batching does not change episodes
    assert np.allclose(a["returns"], b["returns"]) and list(a["lengths"]) == [1000] * 3


def test_missing_or_corrupt_demonstrations_fail_clearly(tmp_path, demo_file):
    with pytest.raises(FileNotFoundError, match="demonstration file not found: .*python -m experiments.bc.expert demos"):
        demos.load(tmp_path / "nope.npz", "Hopper-v5")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip archive at all")
    with pytest.raises(ValueError, match="corrupt demonstration file"):
        demos.load(garbage)
    partial = tmp_path / "partial.npz"
    np.savez(partial, format_version=1, env="Hopper-v5", observations=np.zeros((3, 11)))
    with pytest.raises(ValueError, match=r"corrupt demonstration file .*missing \['actions'"):
        demos.load(partial)
    good = dict(np.load(demo_file("Hopper-v5")))
    good["lengths"] = good["lengths"] + 1
    bad = tmp_path / "bad_lengths.npz"
    np.savez(bad, **good)
    with pytest.raises(ValueError, match="episode lengths sum to"):
        demos.load(bad)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(Path(demo_file("Hopper-v5")).read_bytes()[:200])
    with pytest.raises(ValueError, match="corrupt demonstration file"):
        demos.load(truncated)
    # the BC task says the same before training, and writes no summary
    with pytest.raises(FileNotFoundError, match="demonstration file not found"):
        _bc(tmp_path / "nope.npz", tmp_path / "job", "task.generate_demos=false")
    assert not (tmp_path / "job" / "summary.json").exists()


# ---------------------------------------------------------------------------------------------- BC
@pytest.mark.slow
@pytest.mark.parametrize("gp", GPS)
def test_bc_twenty_steps_per_gp_plain_and_dopr(gp, tmp_path, demo_file):
    path = demo_file("HalfCheetah-v5")
    for name in (gp, f"dopr_{gp}"):
        s = _bc(path, tmp_path / name, f"optim={name}")
        rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [10, 20]
        assert s["optim"] == name and len(s["returns"]["20"]) == 2 and np.isfinite(s["return_mean"])
        assert rows[-1]["train_loss"] < rows[0]["train_loss"]  # it learns
        assert s["damping"] is None if name == gp else s["damping"] == pytest.approx(1e-4)


def test_evaluated_weights_are_the_ema_weights(tmp_path, demo_file, monkeypatch):
    seen = {}

    def fake_eval(t, policy, seed):
        seen["policy"] = {k: v.clone() for k, v in policy.state_dict().items()}
        return np.zeros(t.eval_episodes)

    monkeypatch.setattr(train, "evaluate_policy", fake_eval)
    orig_init = train.ResidualMLP.__init__
    made = []

    def spy(self, *a, **k):
        orig_init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(train.ResidualMLP, "__init__", spy)
    path = demo_file("HalfCheetah-v5")
    # decay 1: the EMA never moves, so the evaluated weights are the initial ones
    _bc(path, tmp_path / "a", "optim=adamw", "task.ema_decay=1.0")
    torch.manual_seed(0)
    init = train.ResidualMLP(17, 6, [256, 256]).state_dict()
    for k in ("inp.weight", "blocks.0.weight", "out.bias"):
        assert torch.equal(seen["policy"][k], init[k])
    trained = made[0].state_dict()
    assert not torch.equal(seen["policy"]["inp.weight"], trained["inp.weight"])
    # decay 0: the EMA is the trained model itself
    made.clear()
    _bc(path, tmp_path / "b", "optim=adamw", "task.ema_decay=0.0")
    assert torch.equal(seen["policy"]["inp.weight"], made[0].state_dict()["inp.weight"])
    # decay 0.99: neither
    made.clear()
    _bc(path, tmp_path / "c", "optim=adamw")
    ema = seen["policy"]["inp.weight"]
    assert not torch.equal(ema, made[0].state_dict()["inp.weight"]) and not torch.equal(ema, init["inp.weight"])


def test_observation_normalisation_handles_constant_coordinates():
    m = train.ResidualMLP(3, 1, [8, 8])
    x = torch.tensor([[1.0, 5.0, 0.0], [3.0, 5.0, 0.0]])
    m.set_normalization(x)
    assert torch.allclose(m.obs_mean, torch.tensor([2.0, 5.0, 0.0]))
    assert torch.allclose(m.obs_std, torch.tensor([2 ** 0.5, 1.0, 1.0]))


def test_observation_clip_bounds_what_the_first_layer_sees():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    plain, clipped = train.ResidualMLP(4, 2, [8]), train.ResidualMLP(4, 2, [8], obs_clip=3.0)
    clipped.load_state_dict(plain.state_dict())
    for m in (plain, clipped):
        m.set_normalization(x)
    inside = x.mean(0) + 2.0 * x.std(0) * torch.tanh(x[:8])  # every coordinate within 2 std
    assert torch.allclose(plain(inside), clipped(inside))
    far = x.mean(0, keepdim=True) + 1e4 * x.std(0, keepdim=True)  # a contact-force spike: 1e4 std away
    at_edge = x.mean(0, keepdim=True) + 3.0 * x.std(0, keepdim=True)
    assert torch.allclose(clipped(far), plain(at_edge), atol=1e-5)
    assert not torch.allclose(plain(far), plain(at_edge))
    with pytest.raises(ValueError, match="obs_clip must be a positive"):
        train.ResidualMLP(4, 2, [8], obs_clip=0.0)



# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("task,optim,n,lr,wd,damping", [
    ("humanoid", "adamw", 10, 3e-3, 1e-2, None), ("humanoid", "dopr_adamw", 20, 1e-3, 0.0, 1e-3),
    ("humanoid", "dopr_muon", 40, 2e-2, 1e-2, 1e-5), ("humanoid", "signum", 20, 1e-3, 0.0, None),
    ("halfcheetah", "dopr_adamw", 40, 2e-3, 1e-2, 1e-6), ("halfcheetah", "adamuon", 50, 3e-3, 1e-2, None),
    ("halfcheetah", "dopr_signum", 10, 1e-4, 0.0, 1e-4),
])
def test_paper_hyperparameter_presets(task, optim, n, lr, wd, damping, compose):
    cfg = compose(f"task={task}", f"+tuned/{task}={optim}", f"task.num_trajectories={n}")
    assert optim_name(cfg.optim) == optim and cfg.optim.lr == pytest.approx(lr) and cfg.optim.weight_decay == pytest.approx(wd)
    if damping is not None:
        assert cfg.ap.damping == pytest.approx(damping)
    bad = compose(f"task={task}", f"+tuned/{task}={optim}", "task.num_trajectories=15")
    with pytest.raises(Exception, match="no entry for 15"):
        _ = bad.optim.lr


def test_paper_sweep_is_the_full_grid(compose):
    cfg = compose("sweep=paper_humanoid", hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert len(params["+tuned/humanoid"].split(",")) == 8
    assert params["task.num_trajectories"] == "10,20,30,40,50" and params["seed"] == "0,1,2"
    assert cfg.task.name == "humanoid" and cfg.task.env == "Humanoid-v5"
    assert cfg.task.obs_clip is None


def test_obs_clip_ablation_is_the_paper_grid_with_clamped_observations(compose):
    paper = compose("sweep=paper_humanoid", hydra_config=True)
    clip = compose("sweep=humanoid_obs_clip", hydra_config=True)
    assert dict(clip.hydra.sweeper.params) == dict(paper.hydra.sweeper.params)
    assert clip.task.obs_clip == 10 and clip.sweep_name == "humanoid_obs_clip"


def _records(seeds: int = 2) -> list:
    """HalfCheetah jobs of AdamW and DoPr-AdamW (50 better) at 10 and 20 trajectories, `seeds` seeds each."""
    records = []
    for opt_name, shift in (("adamw", 0.0), ("dopr_adamw", 50.0)):
        for n in (10, 20):
            for seed in range(seeds):
                rets = list(np.random.default_rng(seed).normal(1000 + shift + n, 10, 20))
                records.append({"summary": {"task": "halfcheetah", "env": "HalfCheetah-v5", "optim": opt_name,
                                            "num_trajectories": n, "seed": seed, "returns": {"1000": rets},
                                            "train_loss": 0.1, "val_loss": 0.2, "lr": 1e-3, "weight_decay": 0.0,
                                            "damping": None, "expert_return": 5000.0, "train_time_s": 1.0,
                                            "eval_time_s": 2.0, "wall_time_s": 3.5,
                                            **({"damping": 1e-4, "conventions": {"damping_mode": "trace"},
                                                "dopr": {"cholesky_retries": 2, "eigh_fallbacks": 0}}
                                               if opt_name.startswith("dopr_") else {})}})
    return records


def test_a_one_seed_comparison_says_its_seed_range_has_no_spread(tmp_path):
    """optim=adamw,dopr_adamw on one seed: the seed ranges are points, so the table says "1 seed: no spread" where
    it said seed_ranges_overlap "no"; the bootstrap bands (over episodes) keep their yes/no."""
    import csv
    bc_report.bc(_records(seeds=1), tmp_path, "stamp `x`")
    rows = list(csv.DictReader(open(tmp_path / "halfcheetah_dopr_vs_gp.csv")))
    assert [r["seed_ranges_overlap"] for r in rows] == ["1 seed: no spread"] * 2
    assert {r["quantile_bands_overlap"] for r in rows} <= {"yes", "no"}
    assert "| 1 seed: no spread |" in (tmp_path / "halfcheetah_dopr_vs_gp.md").read_text()


def test_report_writes_tables_and_figure(tmp_path):
    records = _records()
    bc_report.bc(records, tmp_path, "stamp `x`")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"halfcheetah{s}{e}" for s in ("", "_dopr_vs_gp", "_timing") for e in (".csv", ".md")]
                           + ["halfcheetah.png"])
    import csv
    rows = list(csv.DictReader(open(tmp_path / "halfcheetah_dopr_vs_gp.csv")))
    assert [r["dopr_better"] for r in rows] == ["yes", "yes"]
    assert float(rows[0]["delta"]) == pytest.approx(50.0, abs=8.0)
    assert [r["seed_ranges_overlap"] for r in rows] == ["no", "no"]  # per-seed means 1010 +- 5 vs 1060 +- 5
    table = {(r["optimizer"], r["num_trajectories"]): r for r in csv.DictReader(open(tmp_path / "halfcheetah.csv"))}
    seed_means = [np.mean(r["summary"]["returns"]["1000"]) for r in records
                  if r["summary"]["optim"] == "adamw" and r["summary"]["num_trajectories"] == 10]
    assert float(table[("adamw", "10")]["seed_return_min"]) == pytest.approx(min(seed_means), rel=1e-3)
    assert float(table[("adamw", "10")]["seed_return_max"]) == pytest.approx(max(seed_means), rel=1e-3)
    assert float(table[("adamw", "10")]["seed_return_median"]) == pytest.approx(np.median(seed_means), rel=1e-3)
    # the effective damping differs from the table's where Cholesky retried: the table shows it
    assert table[("dopr_adamw", "10")]["cholesky_retries"] == "4" and table[("adamw", "10")]["cholesky_retries"] == ""
    assert table[("dopr_adamw", "10")]["damping_mode"] == "trace"


@pytest.mark.slow
def test_a_resumed_bc_job_reports_the_train_and_wall_time_of_both_launches(demo_file, tmp_path, monkeypatch):
    """The first launch's 10 steps are slowed to >= 0.5 s of training, then the job dies after its
    step-10 checkpoint; the resumed job's summary counts that time (the BC loop used to restart its
    train time at 0 on resume, and wall time was the last launch's)."""
    import time as time_module

    from experiments.bc import policy as policy_module
    from experiments.common import run as run_module

    path = demo_file("HalfCheetah-v5")
    forward, save = policy_module.ResidualMLP.forward, run_module.Run.save_checkpoint

    def slow_forward(self, x):
        if torch.is_grad_enabled():      # the training forward, not the evaluation's
            time_module.sleep(0.05)
        return forward(self, x)

    def save_then_die(self, state):
        save(self, state)
        raise KeyboardInterrupt("preempted")

    monkeypatch.setattr(policy_module.ResidualMLP, "forward", slow_forward)
    monkeypatch.setattr(run_module.Run, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _bc(path, tmp_path, "task.checkpoint_every=10")
    monkeypatch.setattr(policy_module.ResidualMLP, "forward", forward)
    monkeypatch.setattr(run_module.Run, "save_checkpoint", save)
    s = _bc(path, tmp_path, "task.checkpoint_every=10")
    assert s["wall_time_s"] >= s["train_time_s"] >= 0.5


def test_a_rollout_with_progress_shows_a_bar_that_ends_at_its_total(capsys, monkeypatch):
    """Evaluation used to leave the training bar frozen for a minute; the rollout's own bar counts
    environment steps, an episode that ends early counting its remaining steps."""
    from experiments.bc import evaluate

    closed = []

    class Recorded(evaluate.tqdm):
        def close(self):
            if not self.disable:
                closed.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(evaluate, "tqdm", Recorded)
    policy = lambda obs: np.zeros((len(obs), 6), np.float32)
    rollout("HalfCheetah-v5", policy, 2, seed=0, progress="evaluating: 2 episodes")
    assert "evaluating: 2 episodes" in capsys.readouterr().err
    assert closed == [("evaluating: 2 episodes", 2000, 2000)]
    rollout("HalfCheetah-v5", policy, 1, seed=0)
    assert capsys.readouterr().err == "" and len(closed) == 1
    hopper = rollout("Hopper-v5", lambda obs: np.ones((len(obs), 3), np.float32), 1, seed=0, progress="hop")
    assert hopper["lengths"][0] < 1000 and closed[1] == ("hop", 1000, 1000)   # it fell: the rest counted


def test_a_mistyped_demos_path_is_refused_and_demonstrations_are_written_only_at_the_default_path(tmp_path, monkeypatch,
                                                                                                compose):
    # issue 63: a typo in task.demos silently wrote 47 MB of demonstrations at the typo's path
    written = []
    monkeypatch.setattr(train, "generate_demos", lambda env, n, path, expert: written.append(Path(path)))
    typo = tmp_path / "HalfCheeta-v5.npz"
    t = compose("task=halfcheetah", f"task.demos={typo}").task
    with pytest.raises(FileNotFoundError, match=f"demonstration file not found: {typo}"):
        demos.load(train.resolve_demos(t), t.env)
    assert written == [] and not typo.exists()
    default = tmp_path / "demos" / "HalfCheetah-v5.npz"   # where the expert's demonstrations go (task.expert_demos)
    t = compose("task=halfcheetah", f"task.expert_demos={default}").task
    assert Path(t.demos) == default and train.resolve_demos(t) == default and written == [default]
