"""The cluster path (issue "Safe on a cluster and in real code", section 1): a signal checkpoints a
running job, which resumes bit-identically; bad sweeps are refused before any job is launched or
submitted; a sweep without -m and a SLURM launcher without SLURM are one line and leave nothing."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.common import interrupt
from experiments.common.checks import ConfigError, refuse_multirun_that_prints, refuse_sweep_without_multirun
from experiments.common.loop import Schedule

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def _run(*args, env=None, **kw):
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env or ENV, capture_output=True, text=True,
                          timeout=300, **kw)


# --------------------------------------------------------------------------- signals and checkpoints
def test_a_signal_or_the_wall_clock_makes_the_schedule_checkpoint_and_the_save_stop_the_job():
    schedule = Schedule(steps=100, log_every=10, checkpoint_every=0)
    interrupt.install(0)
    try:
        interrupt.arm()
        assert not schedule.checkpoint(5)
        interrupt._handler(signal.SIGUSR1, None)            # as the signal would
        assert interrupt.requested() == signal.SIGUSR1
        assert schedule.checkpoint(5) and not schedule.checkpoint(100)   # the last step finishes the job anyway
        with pytest.raises(interrupt.JobInterrupted, match="SIGUSR1 after the checkpoint of step 5"):
            interrupt.saved(5)
        interrupt.install(1e-9)                             # a wall-time interval that has passed
        interrupt.arm()
        time.sleep(0.01)
        assert schedule.checkpoint(7)
        interrupt.saved(7)                                  # no signal: the job goes on
    finally:
        interrupt.uninstall()


def _metric_rows(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if isinstance(v, float) and not k.endswith("time_s")}


JOB = ["task=feature_learning", "optim=dopr_sgd", "task.steps=400", "task.log_every=10", "task.checkpoint_every=0",
       "task.step_delay_s=0.01"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_a_running_job_which_resumes_bit_identically(tmp_path, sig):
    # checkpoints on steps only (task.checkpoint_every=0: none): before, the signal lost every step
    whole = _run(*JOB, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "run.py", *JOB, f"hydra.run.dir={cut}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while _metric_rows(cut) < 5 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-2000:]
    name = signal.Signals(sig).name
    lines = [ln for ln in out.splitlines() if f"interrupted by {name}" in ln]
    assert len(lines) == 1 and "checkpoint" in lines[0] and "resume=true" in lines[0], out[-2000:]
    assert "Traceback" not in out
    assert (cut / "checkpoint.pt").exists() and not (cut / "summary.json").exists()
    step = int(lines[0].split("checkpoint of step ")[1].split(":")[0])
    assert 0 < step < 400
    again = _run(*JOB, f"hydra.run.dir={cut}")
    assert again.returncode == 0 and f"resuming from step {step}" in again.stdout + again.stderr
    a, b = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "whole", cut))
    assert _numbers(a) and _numbers(a) == _numbers(b)


# ---------------------------------------------------------------------------- refused before launch
def test_a_sweep_or_a_cluster_launcher_without_m_is_refused_by_name():
    for argv in (["sweep=feature_learning"], ["task=lds", "launcher=slurm", "slurm.partition=gpu"],
                 ["launcher=local_parallel"]):
        with pytest.raises(ConfigError, match=r"is for sweeps, which run with -m: python run\.py -m "):
            refuse_sweep_without_multirun(argv)
    refuse_sweep_without_multirun(["-m", "sweep=feature_learning"])
    refuse_sweep_without_multirun(["task=lds", "launcher=local"])


def test_printing_a_sweep_presets_configuration_runs_nothing_and_is_not_refused():
    for argv in (["sweep=lds", "--cfg", "job"], ["sweep=lds", "--cfg", "job", "--resolve"], ["sweep=lds", "--info"],
                 ["sweep=lds", "--cfg=hydra"], ["launcher=slurm", "-c", "job"]):
        refuse_sweep_without_multirun(argv)
        with pytest.raises(ConfigError, match=r"^(--cfg|-c|--info) prints and runs nothing, and Hydra refuses it "
                                              r"with -m \(a sweep\); without -m .*: python run\.py "):
            refuse_multirun_that_prints(["-m", *argv])
    with pytest.raises(ConfigError, match="run with -m"):   # --resolve alone prints nothing: the job would run
        refuse_sweep_without_multirun(["sweep=lds", "--resolve"])


def _advice(stderr: str) -> list:
    """The command a one-line refusal advises (after its last ': '), to run with this interpreter."""
    line = stderr.strip()
    assert line.count("\n") == 0 and line.startswith("Error: "), stderr[-2000:]
    command = shlex.split(line.rsplit(": ", 1)[1])
    assert command[:2] == ["python", "run.py"], line
    return command[2:]


@pytest.mark.slow
@pytest.mark.parametrize("show", [["--cfg", "job", "--resolve"], ["--info"]])
def test_run_py_prints_a_sweep_presets_configuration(show):
    r = _run("sweep=lds", *show)
    assert r.returncode == 0 and "Error" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert ("sweep_name: lds" if "--cfg" in show else "Config search path") in r.stdout


@pytest.mark.slow
def test_run_py_refuses_m_with_cfg_in_one_line_and_its_advice_runs():
    r = _run("-m", "sweep=lds", "--cfg", "job")
    assert r.returncode == 2
    advised = _run(*_advice(r.stderr))
    assert advised.returncode == 0 and "sweep_name: lds" in advised.stdout, advised.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("launch", [["sweep=lds"], ["task=lds", "launcher=local_parallel"]])
def test_the_advice_of_a_refused_sweep_without_m_runs_into_the_folder_asked_for(tmp_path, launch):
    out = tmp_path / "a folder"
    r = _run(*launch, "debug=default", f"hydra.run.dir={out}")
    assert r.returncode == 2 and not out.exists()
    advice = _advice(r.stderr)
    assert advice[0] == "-m" and f"hydra.sweep.dir={out}" in advice
    advised = _run(*advice)
    assert advised.returncode == 0, advised.stderr[-2000:]
    assert json.loads((out / "0" / "summary.json").read_text())["lval_closed"] > 0


def test_run_py_refuses_a_sweep_without_m_and_runs_nothing(tmp_path):
    r = _run("sweep=feature_learning", "launcher=slurm", "slurm.partition=gpu", f"hydra.run.dir={tmp_path / 'x'}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "run with -m" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("launcher", ["local_parallel", "slurm"])
def test_a_bad_job_is_refused_before_a_submitit_launcher_submits_anything(tmp_path, launcher):
    # a fake sbatch on PATH: the refusal must come before it is ever called
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "sbatch_called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV.get('PATH', '')}"}
    sweep = tmp_path / "sweep"
    extra = ["slurm.partition=gpu"] if launcher == "slurm" else []
    r = _run("-m", "task=feature_learning", "optim=sgd,adamw", "optim.lr=-1", f"launcher={launcher}", *extra,
             "debug=default", f"hydra.sweep.dir={sweep}", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "optim.lr=-1" in err and "nothing was submitted" in err and "job 0 of 2" in err
    assert not sweep.exists() and not marker.exists()


def test_launcher_slurm_without_slurm_is_one_line_and_leaves_no_folder(tmp_path):
    env = {**ENV, "PATH": str(tmp_path)}   # no sbatch anywhere
    sweep = tmp_path / "sweep"
    r = _run("-m", "task=feature_learning", "optim=sgd", "launcher=slurm", "slurm.partition=gpu",
             f"hydra.sweep.dir={sweep}", env=env)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "sbatch" in r.stderr
    assert "Traceback" not in r.stderr and not sweep.exists()


def test_resume_true_says_when_there_is_no_checkpoint_to_resume_from(tmp_path, caplog):
    from types import SimpleNamespace

    from experiments.common.checkpoint import TrainingState

    caplog.set_level("INFO", logger="experiments")   # the job's log (run.log under Hydra)
    run = SimpleNamespace(cfg={"resume": True}, checkpoint_path=tmp_path / "checkpoint.pt", load_checkpoint=lambda: None)
    assert TrainingState().resume(run) == (0, {})
    out = caplog.text
    assert "checkpoint.pt does not exist" in out and "starting from step 0" in out
    interrupt.uninstall()


# ---------------------------------------------------------------------- Ctrl-C outside the training step
def _evaluating_job(tmp_path, folder, *extra):
    """`python run.py task=evaluating` (tests/evaluating_task.py) into `folder`, started; returns the process
    once the job's last-step evaluation has begun (a checkpoint of step 2 exists by then)."""
    import evaluating_task

    conf = evaluating_task.write_config(tmp_path / "conf")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    argv = ["task=evaluating", "optim=sgd", f"hydra.searchpath=[file://{conf}]", f"hydra.run.dir={folder}", *extra]
    proc = subprocess.Popen([sys.executable, "run.py", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (folder / "evaluating").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None and (folder / "checkpoint.pt").exists(), proc.communicate()
    return proc, argv, env


@pytest.mark.slow
def test_a_first_ctrl_c_during_the_last_evaluation_is_acknowledged_and_the_job_says_it_finished(tmp_path):
    # before: the signal was silently ignored, the job finished and exited 0 with no word of it
    folder = tmp_path / "job"
    proc, _, _ = _evaluating_job(tmp_path, folder)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    ack = [ln for ln in err.splitlines() if ln.startswith("SIGINT received:")]
    assert len(ack) == 1 and "stops at the end of the step in progress" in ack[0] and "Ctrl-C again" in ack[0], err
    said = "SIGINT came during the last step (or its evaluation): the job finished instead of stopping"
    assert said in out and said in (folder / "run.log").read_text()
    assert (folder / "summary.json").exists()


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_evaluation_names_the_last_checkpoint_which_resumes(tmp_path):
    # before: "nothing to resume from this attempt" while checkpoint.pt of step 2 existed, and the resumed
    # job's "resuming from step 2" was missing from its run.log
    folder = tmp_path / "job"
    proc, argv, env = _evaluating_job(tmp_path, folder, "task.eval_s=120")
    proc.send_signal(signal.SIGINT)   # acknowledged: the job would stop after the evaluation
    time.sleep(1)
    proc.send_signal(signal.SIGINT)   # stops it at once
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out + err, err[-2000:]
    stopped = [ln for ln in out.splitlines() if "interrupted (Ctrl-C)" in ln]
    assert len(stopped) == 1 and f"the last checkpoint is {folder / 'checkpoint.pt'} (step 2)" in stopped[0], out
    assert "resume=true" in stopped[0] and "nothing to resume" not in stopped[0]
    assert stopped[0].split("] - ", 1)[1] in (folder / "run.log").read_text()
    again = subprocess.run([sys.executable, "run.py", *argv, "task.eval_s=0"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from step 2" in (folder / "run.log").read_text()
