"""The shared plumbing of experiments/common/: weights EMA, schedules, the training-state checkpoint,
atomic writes, the distributed helpers in one process, and the report statistics."""
import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from experiments.common import checkpoint, distributed, loop, stats
from experiments.common.ema import WeightEMA
from experiments.common.provenance import atomic_write
from experiments.common.schedules import build_schedule, warmup_cosine


# ----------------------------------------------------------------------------------------- EMA
def test_weight_ema_follows_the_formula_and_round_trips():
    model = nn.Linear(3, 2)
    ema = WeightEMA(model, 0.9)
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    torch.testing.assert_close(ema.module.weight, 0.9 * w0 + 0.1 * (w0 + 1.0))
    assert not any(p.requires_grad for p in ema.module.parameters())
    other = WeightEMA(nn.Linear(3, 2), 0.9)
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.module.weight, ema.module.weight)
    with pytest.raises(ValueError, match="Invalid EMA decay: 1.5"):
        WeightEMA(model, 1.5)


# ----------------------------------------------------------------------------------- schedules
def test_warmup_cosine_schedule():
    f = warmup_cosine(1000, 0.05)
    assert f(0) == pytest.approx(1 / 50) and f(49) == pytest.approx(1.0)
    assert f(525) == pytest.approx(0.5) and f(1000) == pytest.approx(0.0, abs=1e-12)
    floor = warmup_cosine(1000, 0.0, min_factor=0.1)
    assert floor(1000) == pytest.approx(0.1) and floor(0) == pytest.approx(1.0)


def test_build_schedule_drives_the_optimizer_and_names_a_bad_schedule():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_schedule(opt, "constant", 10)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 2.0
    with pytest.raises(ValueError, match="Invalid schedule: 'linear'"):
        build_schedule(opt, "linear", 10)


@pytest.mark.parametrize("name,total,warmup_frac", [("cosine", 40, 0.05), ("cosine", 7, 0.3), ("cosine", 5, 0.0),
                                                    ("constant", 12, 0.1)])
def test_the_llm_schedules_are_hugging_faces_rate_for_rate(name, total, warmup_frac):
    """The LLM family's "cosine" / "constant" (the paper's SFT runs used Hugging Face's) through the one
    build_schedule: the same learning rate as transformers.get_scheduler on every step, bit for bit."""
    get_scheduler = pytest.importorskip("transformers").get_scheduler
    rates = []
    for build in (lambda o: build_schedule(o, name, total, warmup_frac),
                  lambda o: get_scheduler(name, o, num_warmup_steps=round(warmup_frac * total), num_training_steps=total)):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=3e-4)
        sched, seen = build(opt), []
        for _ in range(total + 2):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        rates.append(seen)
    assert rates[0] == rates[1]
    with pytest.raises(ValueError, match="min_factor for schedule 'cosine'"):
        build_schedule(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), "cosine", 10, 0.1, 0.1)


# ---------------------------------------------------------------------------------- checkpoint
class _FakeRun:
    def __init__(self):
        self.saved = None
        self.clock = loop.Clock()

    def save_checkpoint(self, state):  # Run.save_checkpoint writes a file: a copy, not live tensors
        self.saved = copy.deepcopy(state)

    def load_checkpoint(self):
        return self.saved


def _draws(gen, npgen):
    return (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=gen).item(),
            npgen.random())


def test_training_state_restores_model_optimizer_and_every_random_state():
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = build_schedule(opt, "warmup_cosine", 20, 0.1)
    gen, npgen = torch.Generator().manual_seed(3), np.random.default_rng(4)
    state = checkpoint.TrainingState(model=model, optimizer=opt, scheduler=sched,
                                     generators={"data": gen, "numpy": npgen})
    run = _FakeRun()
    assert state.resume(run) == (0, {})
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    sched.step()
    state.save(run, 7, note="x")
    after = _draws(gen, npgen)
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    sched.step()
    assert state.resume(run) == (7, {"note": "x"})
    assert torch.equal(model.weight, weights) and sched.last_epoch == 1
    assert _draws(gen, npgen) == after  # python, numpy, torch, and the job's own generators


def test_training_state_refuses_a_foreign_or_old_checkpoint():
    run = _FakeRun()
    checkpoint.TrainingState(model=nn.Linear(2, 2)).save(run, 1)
    with pytest.raises(ValueError, match=r"no state for \['optimizer'\]"):
        m = nn.Linear(2, 2)
        checkpoint.TrainingState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0)).resume(run)
    run.saved = {"model": {}, "step": 3}  # what the suite wrote before one checkpoint format
    with pytest.raises(ValueError, match="older version of the suite"):
        checkpoint.TrainingState(model=nn.Linear(2, 2)).resume(run)


# ------------------------------------------------------------------------------- atomic writes
def test_atomic_write_replaces_whole_files_and_leaves_the_old_one_on_failure(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write(path, lambda p: p.write_text("old"))

    def broken(p):
        p.write_text("half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    npz = tmp_path / "d.npz"
    atomic_write(npz, lambda p: np.savez(p, x=np.arange(3)))  # numpy keeps the .npz name
    assert np.load(npz)["x"].tolist() == [0, 1, 2]
    folder = tmp_path / "base"
    atomic_write(folder, lambda p: (p.mkdir(), (p / "a").write_text("1")))
    atomic_write(folder, lambda p: (p.mkdir(), (p / "b").write_text("2")))
    assert sorted(x.name for x in folder.iterdir()) == ["b"]


# ------------------------------------------------------------------------------ distributed
def test_distributed_helpers_in_one_process():
    assert distributed.world() == (0, 1) and distributed.is_main()
    assert distributed.all_reduce_sum(2.5, "cpu") == 2.5 and distributed.all_reduce_sum(3, "cpu") == 3.0
    a = np.arange(4.0).reshape(2, 2)
    assert distributed.all_reduce_sum(a, "cpu") is a    # an array stays an array (the SiT FD's moments)
    model = nn.Linear(2, 2)
    assert distributed.wrap_ddp(model, "cpu") is model and distributed.unwrap(model) is model
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = distributed.data_loader(data, batch_size=4, seed=0)
    batches = [b[0] for b in loader]
    assert len(batches) == 2 and sorted(torch.cat(batches).tolist()) != list(range(8))  # shuffled, 2 full batches
    assert len(set(torch.cat(batches).tolist())) == 8


# ------------------------------------------------------------------------------------ statistics
@pytest.mark.slow
def test_bootstrap_quantiles_on_a_known_distribution():
    pool = np.arange(1000, dtype=float)  # mean 499.5, population variance (N^2 - 1) / 12
    m, n = 100, 1000
    b = stats.bootstrap(pool, trials=20000, sample_size=m, seed=1)
    # subset means without replacement: variance sigma^2 / m * (N - m) / (N - 1), close to normal
    sd = np.sqrt((n ** 2 - 1) / 12 / m * (n - m) / (n - 1))
    assert b["mean"] == pytest.approx(499.5, abs=0.05 * sd)
    assert b["q50"] == pytest.approx(499.5, abs=0.05 * sd)
    assert b["q10"] == pytest.approx(499.5 - 1.2816 * sd, abs=0.05 * sd)
    assert b["q90"] == pytest.approx(499.5 + 1.2816 * sd, abs=0.05 * sd)
    full = stats.bootstrap(pool, trials=10, sample_size=n)  # m = N: every subset is the whole pool
    assert full["q10"] == full["q90"] == pytest.approx(499.5)
    with pytest.raises(ValueError, match="sample_size must be in"):
        stats.bootstrap(pool, sample_size=1001)


def test_mean_and_error_grouping_best_and_dopr_vs_gp():
    assert stats.mean_and_error([1.0, 3.0]) == (2.0, pytest.approx(1.0))
    assert stats.mean_and_error([5.0], 0.5) == (5.0, 0.5)
    runs = [{"optim": o, "lr": lr, "score": sc} for o, lr, sc in
            (("adamw", 1e-3, 1.0), ("adamw", 1e-3, 3.0), ("adamw", 1e-2, 5.0), ("dopr_adamw", 1e-3, 4.0))]
    groups = stats.group_runs(runs, lambda s: (s["optim"], s["lr"]))
    assert list(groups) == [("adamw", 1e-3), ("adamw", 1e-2), ("dopr_adamw", 1e-3)]
    rows = [{"optimizer": o, "n": 10, "lr": lr, "score": float(np.mean([s["score"] for s in ss])), "lo": 0, "hi": 1}
            for (o, lr), ss in groups.items()]
    best = stats.best_per(rows, lambda r: (r["optimizer"], r["n"]), "score")
    assert best[("adamw", 10)]["lr"] == 1e-2
    table = stats.dopr_vs_gp(best, ["adamw", "muon"], "n", "score", "s", intervals={"overlap": ("lo", "hi")},
                             carry=("lr",))
    assert table == [{"gp": "adamw", "n": 10, "gp_s": 5.0, "dopr_s": 4.0, "delta": -1.0, "delta_pct": -20.0,
                      "dopr_better": "no", "overlap": "yes", "gp_lr": 1e-2, "dopr_lr": 1e-3}]


def test_a_seed_range_of_one_seed_says_it_has_no_spread():
    """An optimizer that ran one seed has a point for its seed range: the overlap column says "1 seed: no spread"
    (it said "no" for two points apart); an interval that is not over seeds keeps its yes/no."""
    def best(gp_seeds, dopr_seeds):
        return {("adamw", 10): {"score": 1.0, "seeds": gp_seeds, "lo": 1.0, "hi": float(gp_seeds), "q10": 0, "q90": 2},
                ("dopr_adamw", 10): {"score": 5.0, "seeds": dopr_seeds, "lo": 5.0, "hi": 5.0, "q10": 1, "q90": 6}}
    intervals = {"bands": ("q10", "q90"), "seeds_overlap": ("lo", "hi", "seeds")}
    for gp_seeds, dopr_seeds, want in ((1, 1, stats.ONE_SEED), (3, 1, stats.ONE_SEED), (1, 3, stats.ONE_SEED),
                                       (3, 3, "no"), (5, 2, "yes")):
        (row,) = stats.dopr_vs_gp(best(gp_seeds, dopr_seeds), ["adamw"], "n", "score", "s", intervals=intervals)
        assert (row["seeds_overlap"], row["bands"]) == (want, "yes"), (gp_seeds, dopr_seeds)
    assert stats.ONE_SEED == "1 seed: no spread"


def test_debug_keeps_the_task_keys_set_on_the_command_line(compose, tmp_path):
    """`debug=default task.eval_episodes=0`: the debug block shrinks everything else, not what the user set."""
    from experiments.common.launch import apply_debug

    cfg = compose("task=robomimic_lift", "debug=default", "task.eval_episodes=0", "task.steps=7")
    apply_debug(cfg, tmp_path, overrides=["task=robomimic_lift", "debug=default", "task.eval_episodes=0",
                                          "task.steps=7"])
    assert (cfg.task.eval_episodes, cfg.task.steps) == (0, 7)
    assert cfg.task.batch_size == cfg.task.debug.batch_size == 4  # not set: the debug value
    cfg = compose("task=robomimic_lift", "debug=default", "task.eval_episodes=0")
    apply_debug(cfg, tmp_path, overrides=[])  # nothing on the command line: the debug block wins
    assert cfg.task.eval_episodes == 1


def test_all_reduce_sum_sums_numbers_and_arrays_over_a_group(tmp_path, monkeypatch):
    """The one sum over ranks (the SiT FD's moments and counts, the LLM's losses): through a real
    all_reduce (a 1-rank gloo group, world size read as 2), a number comes back a float, an array an array."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(distributed, "world", lambda: (0, 2))
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = distributed.all_reduce_sum(a, "cpu")
        assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.tolist() == a.tolist()
        assert distributed.all_reduce_sum(7, "cpu") == 7.0 and type(distributed.all_reduce_sum(7, "cpu")) is float
        assert distributed.all_reduce_sum(np.float64(1.5), "cpu") == 1.5
    finally:
        dist.destroy_process_group()


def test_a_distributed_job_destroys_its_process_group_when_it_ends(compose, tmp_path, monkeypatch):
    """launcher=slurm_multigpu jobs: the group goes once the job's models are gone (a DDP model alive
    at destroy aborts a gloo process now and then, which fails a finished SLURM job)."""
    import torch.distributed as dist

    from experiments.common import launch

    def init(cfg):   # submitit's environment stands in for a 1-process gloo group here
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)

    monkeypatch.setattr(launch, "init_distributed", init)
    cfg = compose("task=feature_learning", "optim=dopr_sgd", "debug=default", "distributed=true")
    summary = launch.run_job(cfg, tmp_path / "job")
    assert summary["world_size"] == 1 and (tmp_path / "job" / "summary.json").exists()
    assert not dist.is_initialized()


def test_the_clock_goes_on_across_a_resume():
    """Training, evaluation and wall time saved with the training state count in the resumed job
    (the BC loop's train time was lost on resume, and wall time was the last launch's)."""
    model = nn.Linear(2, 2)
    state = checkpoint.TrainingState(model=model)
    first = _FakeRun()
    first.clock.train, first.clock.eval = 3.0, 2.0
    first.clock._started -= 10.0        # ten seconds into the first launch
    state.save(first, 5)
    second = _FakeRun()
    assert second.clock.times() == {} and second.clock.wall() < 1.0
    second.load_checkpoint = lambda: first.saved
    assert state.resume(second)[0] == 5
    assert second.clock.times() == {"train_time_s": 3.0, "eval_time_s": 2.0}
    assert 10.0 <= second.clock.wall() < 11.0
    with second.clock.training():
        pass
    assert second.clock.train >= 3.0 and second.clock.used


class _Sampler:
    def __init__(self):
        self.epoch = None

    def set_epoch(self, e):
        self.epoch = e


class _Loader:
    """Five batches an epoch, each naming its epoch and index (what set_epoch chose)."""

    def __init__(self):
        self.sampler = _Sampler()

    def __len__(self):
        return 5

    def __iter__(self):
        return iter([(self.sampler.epoch, i) for i in range(5)])


@pytest.mark.parametrize("per_step", [1, 2])
def test_resumable_batches_give_a_resumed_job_the_batches_of_an_unbroken_one(per_step):
    unbroken = loop.resumable_batches(_Loader(), 0, per_step)
    steps = [next(unbroken) for _ in range(9)]
    if per_step == 2:  # two steps an epoch; the fifth batch of each epoch is dropped
        assert steps[:3] == [(0, [(0, 0), (0, 1)]), (0, [(0, 2), (0, 3)]), (1, [(1, 0), (1, 1)])]
    else:
        assert steps[4:6] == [(0, [(0, 4)]), (1, [(1, 0)])]
    for start in range(9):
        resumed = loop.resumable_batches(_Loader(), start, per_step)
        assert [next(resumed) for _ in range(9 - start)] == steps[start:]
    with pytest.raises(ValueError, match="fewer than the 6 of a step"):
        next(loop.resumable_batches(_Loader(), 0, 6))


def test_the_schedule_logs_evaluates_and_checkpoints_when_asked():
    s = loop.Schedule(10, 4, loop.every(10, 3), checkpoint_every=5)
    assert [k for k in range(1, 11) if s.evaluate(k)] == [3, 6, 9, 10]
    assert [k for k in range(1, 11) if s.log(k)] == [3, 4, 6, 8, 9, 10]
    assert [k for k in range(1, 11) if s.checkpoint(k)] == [5]      # never at the last step
    assert loop.every(10, 0) == set()
    with pytest.raises(ValueError, match=r"task.eval_at must lie in \[1, task.steps=10\], got \[11\]"):
        loop.Schedule(10, 1, [11], evaluate_key="task.eval_at")
    with pytest.raises(ValueError, match="task.fid.every must be >= 0"):
        loop.every(10, -1, "task.fid.every")


def _metric_steps(folder):
    import json

    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_start_in_a_used_folder_logs_each_step_once_and_a_resume_keeps_the_checkpointed_rows(tmp_path):
    from omegaconf import OmegaConf

    from experiments.common.run import Run

    cfg = OmegaConf.create({"device": "cpu", "logger": {"name": "none"}})
    first = Run(cfg, tmp_path)  # an attempt cut off before its first checkpoint
    for step in (10, 20):
        first.log({"loss": 1.0}, step)
    first.close(failed=True)

    again = Run(cfg, tmp_path)  # the same job again (a resumed sweep): nothing to resume, so from step 0
    assert again.load_checkpoint() is None
    again.log({"loss": 1.0}, 10)
    again.save_checkpoint({"step": 10})
    again.log({"loss": 1.0}, 20)
    again.close(failed=True)
    assert _metric_steps(tmp_path) == [10, 20]

    resumed = Run(cfg, tmp_path)  # with a checkpoint: the rows after it go, the ones before it stay
    assert resumed.load_checkpoint() == {"step": 10}
    resumed.log({"loss": 1.0}, 20)
    resumed.close(failed=False)
    assert _metric_steps(tmp_path) == [10, 20]


def test_summary_names_the_commit_the_job_ran_at_not_one_made_while_it_trained(tmp_path, monkeypatch):
    """A long job outlives commits: summary.json's git_revision is the commit read when the job started,
    and a resume at another commit lists every commit the job ran at, in order."""
    import json

    from omegaconf import OmegaConf

    from experiments.common import run as run_module

    cfg = OmegaConf.create({"device": "cpu", "logger": {"name": "none"}, "task": {"name": "toy"},
                            "optim": {"name": "adamw"}, "seed": 0})
    head = {"rev": "aaaaaaa"}
    monkeypatch.setattr(run_module, "git_revision", lambda: head["rev"])

    job = run_module.Run(cfg, tmp_path / "one")
    head["rev"] = "bbbbbbb"  # a commit lands while the job trains
    out = job.finish({"loss": 1.0})
    job.close(failed=False)
    assert out["git_revision"] == "aaaaaaa" and "git_revisions" not in out
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["git_revision"] == "aaaaaaa"

    head["rev"] = "aaaaaaa"
    first = run_module.Run(cfg, tmp_path / "two")
    first.save_checkpoint({"step": 10})
    first.close(failed=True)
    head["rev"] = "bbbbbbb"  # requeued after a commit
    resumed = run_module.Run(cfg, tmp_path / "two")
    assert resumed.load_checkpoint() == {"step": 10}
    head["rev"] = "ccccccc"
    out = resumed.finish({"loss": 1.0})
    resumed.close(failed=False)
    assert out["git_revision"] == "aaaaaaa" and out["git_revisions"] == ["aaaaaaa", "bbbbbbb"]


def test_a_flushing_job_leaves_numpy_its_true_float_limits_and_no_warning():
    """numpy measures a float type's limits on first use; measured while subnormals are flushed it finds
    the smallest subnormal 0 and warns at every job. Fresh interpreter: numpy's cache is empty there."""
    import subprocess
    import sys

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats")
    torch.set_flush_denormal(False)
    code = ("import warnings, numpy as np, torch\n"
            "from omegaconf import OmegaConf\n"
            "from experiments.common.launch import set_cpu_numerics\n"
            "set_cpu_numerics(OmegaConf.create({'flush_denormal': True}))\n"
            "assert (torch.tensor([1e-40]) * 1).item() == 0.0   # flushing\n"
            "warnings.simplefilter('error')\n"
            "print(*(np.finfo(t).smallest_subnormal.tobytes() != bytes(np.dtype(t).itemsize)   # bits: a comparison\n"
            "        for t in (np.float32, np.float64)))                 # would read it as 0 (DAZ)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "True"] and "subnormal" not in res.stderr


def test_a_job_flushes_subnormal_floats_by_default_and_gives_the_caller_its_setting_back(compose, tmp_path,
                                                                                         monkeypatch):
    """x86 computes on subnormals (< 1.2e-38) ~100x slower; a DoPr SiT run at a high rate fills Adam's
    first moments with them. `flush_denormal` (default true) makes them 0 during the job, false keeps them."""
    from experiments.common import launch

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats")
    tiny = torch.finfo(torch.float32).tiny
    seen = {}

    def task(cfg, run):   # what a training loop computes on a subnormal during the job
        seen[cfg.flush_denormal] = (torch.tensor([tiny]) / 4).item()
        return {"loss_last": 0.0}

    monkeypatch.setattr(launch.hydra.utils, "get_method", lambda name: task)
    try:
        torch.set_flush_denormal(False)
        launch.run_job(compose("task=feature_learning"), tmp_path / "default")
        launch.run_job(compose("task=feature_learning", "flush_denormal=false"), tmp_path / "kept")
        assert seen == {True: 0.0, False: tiny / 4}
        assert not launch.flushing_denormals()   # the caller's setting is back after each job
        torch.set_flush_denormal(True)
        launch.run_job(compose("task=feature_learning", "flush_denormal=false"), tmp_path / "kept_again")
        assert launch.flushing_denormals()
    finally:
        torch.set_flush_denormal(False)
