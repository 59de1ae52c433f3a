"""Configuration mistakes refused before any work, with one message naming the key (run.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.common import checks
from experiments.common.checks import ConfigError, check_job

ROOT = Path(__file__).resolve().parents[2]


def _check(compose, *overrides):
    cfg = compose(*overrides, hydra_config=True)
    check_job(cfg, list(overrides), set(cfg.hydra.runtime.choices), cfg.hydra.runtime.choices.task)


def test_a_key_added_with_plus_is_refused_naming_the_likely_key(compose):
    with pytest.raises(ConfigError, match=r"\+task\.num_trajectorie: no task.*did you mean task\.num_trajectories=5"):
        _check(compose, "task=humanoid", "+task.num_trajectorie=5")
    with pytest.raises(ConfigError, match=r"\+damping: .*did you mean ap\.damping=-1"):
        _check(compose, "+damping=-1")


@pytest.mark.parametrize("argv", [["task=humanoid", "+task.num_trajectorie=5"], ["task=feature_learning", "task.step=5"],
                                  ["task=feature_learning", "optm.lr=0.1"]])
def test_the_override_a_refusal_suggests_passes_every_check(compose, argv):
    """The advice of an unknown key ("did you mean task.steps=5?") is a command that works."""
    import re

    def refuse(args):
        checks.suggest_key(args, ROOT / "conf")
        _check(compose, *args)

    with pytest.raises(ConfigError) as e:
        refuse(argv)
    fixed = [*argv[:-1], re.search(r"did you mean (\S+)\?", str(e.value)).group(1)]
    refuse(fixed)


def test_config_groups_added_with_plus_and_plain_overrides_pass(compose):
    _check(compose, "task=humanoid", "optim=dopr_adamw", "+tuned/humanoid=dopr_adamw", "task.num_trajectories=30")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_refused(compose):
    with pytest.raises(ConfigError, match="device=cuda: this machine has no CUDA GPU"):
        _check(compose, "device=cuda")


@pytest.mark.slow
def test_run_py_prints_one_line_and_exits_2_without_writing_a_job(tmp_path):
    out = tmp_path / "job"
    r = subprocess.run([sys.executable, "run.py", "task=feature_learning", "+task.num_trajectorie=5",
                        f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("Error: unknown key(s), refused before any work:") and "Traceback" not in r.stderr
    assert not (out / "summary.json").exists() and not (out / "metrics.jsonl").exists()


def test_an_invalid_optimizer_or_ap_value_names_its_config_key(compose):
    with pytest.raises(ConfigError, match=r"optim\.lr=-0\.001: must be >= 0"):
        _check(compose, "optim=dopr_adamw", "optim.lr=-0.001")
    with pytest.raises(ConfigError, match=r"ap\.damping: -1\.0 \(must be a finite number >= 0\)"):
        _check(compose, "optim=dopr_adamw", "ap.damping=-1.0")
    _check(compose, "optim=adamw", "ap.damping=-1.0")   # the AP's options apply to dopr_* optimizers only


def test_a_family_base_task_is_refused_naming_the_tasks_built_on_it(tmp_path):
    with pytest.raises(ConfigError, match=r"task=bc is the shared settings of a family \(conf/task_base/bc\.yaml\), not a "
                                          r"task: choose one of the tasks built on it: halfcheetah, hopper, humanoid, walker2d"):
        checks.refuse_base_task(["task=bc"], ROOT / "conf")
    with pytest.raises(ConfigError, match=r"task=sit is the shared settings .* sit_digits, sit_imagenet, sit_mnist"):
        checks.refuse_base_task(["-m", "task=sit_digits,sit"], ROOT / "conf")
    checks.refuse_base_task(["task=humanoid", "task.env=bc"], ROOT / "conf")   # tasks and other keys pass


@pytest.mark.slow
def test_run_py_refuses_a_family_base_task_in_one_line():
    out = ROOT / "outputs"
    r = subprocess.run([sys.executable, "run.py", "task=bc", f"hydra.run.dir={out}/never"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("Error: task=bc is the shared settings of a family")
    assert not (out / "never").exists()


def test_a_job_runs_on_its_task_configs_thread_count(compose, tmp_path, monkeypatch):
    """Small tasks name 1 thread (5-10x faster than torch's default here); 0 leaves torch's default."""
    from experiments.common.launch import run_job

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    cfg = compose("task=feature_learning", "optim=sgd", "debug=default")
    assert cfg.task.threads == 1
    run_job(cfg, tmp_path / "one")
    assert calls == [1]
    run_job(compose("task=feature_learning", "optim=sgd", "debug=default", "task.threads=0"), tmp_path / "default")
    assert calls == [1]


@pytest.mark.slow
def test_a_job_ends_with_one_line_naming_its_metrics_and_folder_also_in_run_log(tmp_path):
    out = tmp_path / "job"
    r = subprocess.run([sys.executable, "run.py", "task=feature_learning", "optim=adamw", "debug=default",
                        f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = [line for line in r.stdout.splitlines() if line.strip()][-1]   # Hydra logs to stdout, bars to stderr
    assert "feature_learning/adamw seed 0: finished" in last and "val_loss" in last and "subspace_distance" in last
    assert last.endswith(f"wrote {out}")
    log = (out / "run.log").read_text()
    assert "started, writing to" in log and log.strip().endswith(f"wrote {out}")


@pytest.mark.slow
def test_resume_true_continues_the_latest_unfinished_run_of_the_same_command(tmp_path):
    import shutil

    from experiments.common.resume import find_previous, with_resume

    args = ["task=feature_learning", "optim=sgd", "debug=default", "seed=918273"]   # a seed no other test uses
    first = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = Path(first.stdout.strip().splitlines()[-1].rsplit("wrote ", 1)[1])
    try:
        assert find_previous([*args, "resume=true"], ROOT) == ("run", folder)   # it finished: with_resume says so
        (folder / "summary.json").unlink()                                   # as if it had been interrupted
        assert with_resume([*args, "logger=none", "resume=true"], ROOT)[-1] == f"hydra.run.dir={folder}"
        assert with_resume([*args, "seed=1", "resume=true"], ROOT) == [*args, "seed=1"]   # another command: new
        again = subprocess.run([sys.executable, "run.py", *args, "resume=true"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert f"resume=true: continuing {folder}" in again.stdout and (folder / "summary.json").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for parent in folder.resolve().relative_to(ROOT).parents:   # outputs/feature_learning/sgd, ... if now empty
            if parent != Path(".") and (ROOT / parent).is_dir() and not any((ROOT / parent).iterdir()):
                (ROOT / parent).rmdir()


def test_resume_true_on_a_finished_run_says_so_in_one_line_and_runs_nothing(tmp_path):
    # issue 72 item 9: it printed "no earlier unfinished run ...; starting a new one", then "the earlier attempt
    # stopped before its first checkpoint", and ran the command again in a new folder
    env = {**os.environ, "WANDB_MODE": "disabled"}
    args = ["task=feature_learning", "debug=default", "resume=true"]

    def run():
        return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    first = run()   # nothing earlier: a new run, which does not look for an earlier attempt
    assert first.returncode == 0, first.stderr[-2000:]
    assert "earlier attempt" not in first.stdout + first.stderr, first.stdout[-2000:]
    assert first.stdout.splitlines()[0] == "resume=true: no earlier run of this command; starting a new one"
    (folder,) = (tmp_path / "outputs" / "feature_learning" / "dopr_sgd").iterdir()
    again = run()
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines() == [
        f"resume=true: the latest run of this command, {folder}, ran to its end already (finished); nothing to "
        "resume. To run it again in a new folder: python run.py task=feature_learning debug=default"]
    assert list(folder.parent.iterdir()) == [folder]   # not run again
    from experiments.common.resume import with_resume   # a command that names its folder continues there

    assert with_resume([*args, f"hydra.run.dir={folder}"], tmp_path) == [*args, f"hydra.run.dir={folder}"]
    assert with_resume(["-m", *args, "hydra.sweep.dir=x"], tmp_path) == ["-m", *args, "hydra.sweep.dir=x",
                                                                         "skip_finished=true"]


def test_resume_true_on_a_sweep_continues_its_folder_skipping_finished_jobs(tmp_path):
    from omegaconf import OmegaConf

    from experiments.common.resume import with_resume

    for name, overrides, age in (("old", ["sweep=robomimic_lift", "+tuned/robomimic_lift=muon"], 100),
                                 ("new", ["sweep=robomimic_lift", "+tuned/robomimic_lift=muon", "launcher=local"], 50),
                                 ("other", ["sweep=robomimic_lift", "+tuned/robomimic_lift=adamw"], 0)):
        folder = tmp_path / "multirun" / "robomimic_lift" / name
        folder.mkdir(parents=True)
        OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": overrides}}}), folder / "multirun.yaml")
        os.utime(folder, (1e9 - age, 1e9 - age))
    argv = ["-m", "sweep=robomimic_lift", "+tuned/robomimic_lift=muon", "resume=true"]
    assert with_resume(argv, tmp_path)[-2:] == [f"hydra.sweep.dir={tmp_path / 'multirun/robomimic_lift/new'}",
                                                "skip_finished=true"]


def test_a_task_that_trains_nothing_is_not_filed_under_an_optimizer(compose):
    cfg = compose("task=lds", hydra_config=True)
    assert "/lds/no_optimizer/seed0_" in cfg.hydra.run.dir
    assert "/expert/sac/seed0_" in compose("task=expert", hydra_config=True).hydra.run.dir   # SAC's own optimizers
    assert "/feature_learning/dopr_sgd/" in compose("task=feature_learning", hydra_config=True).hydra.run.dir


def test_an_output_folder_under_a_file_is_refused_before_hydra_with_one_line(tmp_path):
    (tmp_path / "results.txt").write_text("keep me")
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), "task=feature_learning", "optim=sgd",
                          f"hydra.run.dir={tmp_path / 'results.txt' / 'job'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == (f"Error: cannot write the output folder {tmp_path / 'results.txt' / 'job'}: "
                                  f"{tmp_path / 'results.txt'} is a file, not a folder (set hydra.run.dir=<a folder>)")
    assert (tmp_path / "results.txt").read_text() == "keep me"


def test_an_output_folder_without_write_permission_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checks.os, "access", lambda p, mode: Path(p) != tmp_path)  # root ignores chmod
    with pytest.raises(ConfigError, match=f"{tmp_path} is not writable by this user "
                                          r"\(set hydra.sweep.dir=<a writable folder>\)"):
        checks.refuse_unwritable_output(["-m", f"hydra.sweep.dir={tmp_path}/" + "${now:%H}"], Path("/"))
    (tmp_path / "sub").mkdir()
    checks.refuse_unwritable_output(["task=x"], tmp_path / "sub")  # outputs/ under a writable folder: fine
