"""The Hydra suite: every task x optim composes and runs; multirun, aggregation, W&B, bad input, resume."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from experiments.common.launch import run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BASES = {"bc"}  # shared settings of the BC tasks, not a task of its own
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml") if p.stem not in BASES)
BC_ENVS = {"humanoid": "Humanoid-v5", "halfcheetah": "HalfCheetah-v5", "hopper": "Hopper-v5", "walker2d": "Walker2d-v5"}
OPTIMS = sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key: W&B goes offline


def _compose(*overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _run_py(*args, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("task", TASKS)
def test_every_task_and_optimizer_composes_and_runs(task, tmp_path, demo_file):
    assert {"feature_learning", "invariance", "expert", *BC_ENVS} <= set(TASKS)
    extra = []
    if task in BC_ENVS:  # small demonstration files instead of the committed experts' 60 episodes
        extra = [f"task.demos={demo_file(BC_ENVS[task])}", "task.num_trajectories=2", "task.max_trajectories=2",
                 "task.val_trajectories=1"]
    for optim in OPTIMS if task != "expert" else ["adamw"]:  # the SAC expert has its own optimizers
        cfg = _compose(f"task={task}", f"optim={optim}", "debug=default", *extra)
        summary = run_job(cfg, tmp_path / optim)
        assert summary["task"] == task and summary["optim"] == optim
        assert json.loads((tmp_path / optim / "summary.json").read_text())["optim"] == optim


def test_local_parallel_multirun_then_aggregation(tmp_path):
    sweep = tmp_path / "sweep"
    res = _run_py("-m", "launcher=local_parallel", "task=feature_learning", "optim=sgd,dopr_sgd", "debug=default",
                  f"hydra.sweep.dir={sweep}")
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    assert {json.loads(p.read_text())["optim"] for p in summaries} == {"sgd", "dopr_sgd"}
    assert list((sweep / ".submitit").iterdir())  # the jobs ran as submitit subprocesses
    out = tmp_path / "results"
    for _ in range(2):  # idempotent
        rep = subprocess.run([sys.executable, "-m", "experiments.report", str(sweep), "--out", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert rep.returncode == 0, rep.stderr[-3000:]
    files = sorted(p.name for p in (out / "feature_learning").iterdir())
    assert files == ["feature_learning.csv", "feature_learning.md", "feature_learning.png"]
    md = (out / "feature_learning" / "feature_learning.md").read_text()
    assert "python -m experiments.report" in md and "commit" in md and "dopr_sgd" in md


def test_wandb_offline_run_is_written_and_finished(tmp_path):
    res = _run_py("task=feature_learning", "optim=dopr_sgd", "debug=default", "logger=wandb",
                  f"hydra.run.dir={tmp_path / 'wb'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wandb sync" in res.stdout
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    res = _run_py("task=feature_learning", "optim=dopr_sgd", "debug=default", "logger=none",
                  f"hydra.run.dir={tmp_path / 'none'}")
    assert res.returncode == 0
    assert (tmp_path / "none" / "summary.json").exists() and not (tmp_path / "none" / "wandb").exists()


def test_bad_input_fails_clearly_and_writes_no_summary(tmp_path):
    res = _run_py("optim=lbfgs", f"hydra.run.dir={tmp_path / 'a'}")
    assert res.returncode != 0 and "Available options" in res.stderr and "dopr_adamw" in res.stderr
    res = _run_py("task=nonsense", f"hydra.run.dir={tmp_path / 'b'}")
    assert res.returncode != 0 and "Available options" in res.stderr and "feature_learning" in res.stderr
    res = _run_py("optim=dopr_sgd", "ap.damping=-1", "debug=default", f"hydra.run.dir={tmp_path / 'c'}")
    assert res.returncode != 0 and "Invalid damping: -1" in res.stderr
    assert not (tmp_path / "c" / "summary.json").exists()
    assert not (tmp_path / "c" / "metrics.jsonl").read_text()  # failed before any training step


def test_interrupted_run_resumes_from_its_checkpoint_to_the_same_result(tmp_path):
    overrides = ["task=feature_learning", "optim=dopr_adamw", "optim.lr=0.01", "task.steps=60",
                 "task.checkpoint_every=20", "task.log_every=5", "logger=none"]
    straight = run_job(_compose(*overrides), tmp_path / "straight")

    class Preempted(Exception):
        pass

    from experiments.common import run as run_module

    real_log = run_module.Run.log

    def log_until_45(self, metrics, step):
        if step >= 45:
            raise Preempted()
        real_log(self, metrics, step)

    run_module.Run.log = log_until_45
    try:
        with pytest.raises(Preempted):
            run_job(_compose(*overrides), tmp_path / "broken")
    finally:
        run_module.Run.log = real_log
    assert not (tmp_path / "broken" / "summary.json").exists()
    resumed = run_job(_compose(*overrides), tmp_path / "broken")
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["subspace_distance"] == straight["subspace_distance"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 61, 5))  # every step logged exactly once


def test_slurm_launcher_without_partition_names_the_missing_field(tmp_path):
    res = _run_py("-m", "launcher=slurm", "task=feature_learning", "debug=default", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode != 0 and "Missing mandatory value" in res.stderr and "partition" in res.stderr
