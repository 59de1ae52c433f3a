"""Each job's last line says how it went (finished / diverged / failed) with its task's headline
metrics, read from the task config; each sweep ends with its counts and the report command."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra")

import toy_task  # noqa: E402
from experiments.common.callbacks import SummarizeSweep, job_ending, sweep_line  # noqa: E402
from experiments.common.launch import finished_line, job_status, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


@pytest.fixture
def toy(tmp_path):
    """The override that adds tests/toy_task.py's task config (task=toy) from outside conf/."""
    return f"hydra.searchpath=[file://{toy_task.write_config(tmp_path / 'toyconf')}]"


def test_the_last_line_shows_the_task_configs_headline_and_the_status(compose):
    cfg = compose("task=sit_digits", "optim=adamw")
    summary = {"quality": 381.79, "best_quality": 300.0, "train_loss": 1.575, "quality_metric": "fd_digits",
               "diverged_at": None, "wall_time_s": 14.2}
    assert finished_line(cfg, summary, "out/0") == \
        "sit_digits/adamw seed 0: finished in 14 s: quality 381.8, best_quality 300, train_loss 1.575; wrote out/0"
    assert job_status(cfg, {**summary, "quality": float("nan")}) == "diverged"
    assert job_status(cfg, {**summary, "diverged_at": 120}) == "diverged"   # flagged by the job
    assert job_status(cfg, {**summary, "train_loss": float("inf")}) == "diverged"
    line = finished_line(compose("task=feature_learning", "optim=sgd"), {"val_loss": float("nan")}, "d")
    assert line == "feature_learning/sgd seed 0: diverged: val_loss nan, subspace_distance n/a; wrote d"
    cfg = compose("task=sft_llama32_3b", "optim=adamw")
    assert "lm_eval.gsm8k.accuracy 0.61" in finished_line(cfg, {"val_nll": 0.5, "lm_eval": {"gsm8k": {"accuracy": 0.61}}}, "d")


def test_a_rehearsal_ends_with_its_verdict(compose):
    cfg = compose("task=sit_imagenet", "optim=adamw", "rehearse=true")
    s = {"loss_first": 2.0, "loss_last": 1.5, "step_s": 0.25, "verdict": "ok", "finite": True, "wall_time_s": 3}
    assert finished_line(cfg, s, "d") == \
        "sit_imagenet/adamw seed 0: finished in 3 s: loss_first 2, loss_last 1.5, step_s 0.25, verdict ok; wrote d"
    bad = {**s, "loss_last": float("nan"), "finite": False, "verdict": "loss not finite; loss does not fall"}
    assert job_status(cfg, bad) == "diverged" and "verdict loss not finite" in finished_line(cfg, bad, "d")


def test_a_job_logs_and_records_its_ending(compose, tmp_path, caplog):
    caplog.set_level("INFO", logger="experiments")
    summary = run_job(compose("task=feature_learning", "optim=adamw", "debug=default"), tmp_path / "a")
    last = caplog.records[-1].getMessage()
    assert last.startswith("feature_learning/adamw seed 0: finished in ") and \
        f"val_loss {summary['val_loss']:.4g}, subspace_distance {summary['subspace_distance']:.4g}; wrote" in last
    assert json.loads((tmp_path / "a" / "status.json").read_text()) == {"status": "finished", "line": last}
    run_job(compose("task=feature_learning", "optim=sgd", "debug=default"), tmp_path / "b")   # SGD's rate is too high here
    last = caplog.records[-1].getMessage()
    assert last.startswith("feature_learning/sgd seed 0: diverged in ") and "val_loss inf, subspace_distance" in last
    assert json.loads((tmp_path / "b" / "status.json").read_text())["status"] == "diverged"
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["val_loss"] == float("inf")   # as it was


def test_a_new_task_needs_no_edit_in_experiments_common(compose, toy, tmp_path, caplog):
    """A task config added outside conf/ (hydra.searchpath) names its job and headline: nothing in
    experiments/common knows it, and its last line shows its own metrics."""
    caplog.set_level("INFO", logger="experiments")
    run_job(compose(toy, "task=toy", "optim=sgd", "task.value=0.25"), tmp_path / "ok")
    assert caplog.records[-1].getMessage().startswith("toy/sgd seed 0: finished in ")
    assert caplog.records[-1].getMessage().endswith(f": toy_metric 0.25, toy_label ok; wrote {tmp_path / 'ok'}")
    common = "".join(p.read_text() for p in (ROOT / "experiments" / "common").glob("*.py"))
    assert "toy_task" not in common and "toy_metric" not in common


def test_a_failed_job_says_so_in_one_line_and_keeps_its_traceback(compose, toy, tmp_path, caplog):
    cfg = compose(toy, "task=toy", "optim=sgd", "task.outcome=fail")
    with pytest.raises(RuntimeError, match="the toy task was told to fail"):   # a single run: raised
        run_job(cfg, tmp_path / "one")
    assert run_job(cfg, tmp_path / "sweep_job", keep_going=True) is None   # a sweep's job: recorded, not raised
    failed = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert failed == [f"toy/sgd seed 0: failed: RuntimeError: the toy task was told to fail; wrote {d} "
                      "(traceback in status.json)" for d in (tmp_path / "one", tmp_path / "sweep_job")]
    status = json.loads((tmp_path / "sweep_job" / "status.json").read_text())
    assert status["status"] == "failed" and "Traceback" in status["traceback"] and "toy_task.py" in status["traceback"]
    assert not (tmp_path / "sweep_job" / "summary.json").exists()


def _job(folder, cfg, **files):
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))


def test_the_sweep_summary_counts_every_job_and_names_the_report(compose, tmp_path, capsys):
    """What SummarizeSweep reads on the submitting host once the jobs ended (any launcher): status.json,
    a job finished before status files (its summary.json and headline), a job that left neither, and a
    job of the sweep that never made its folder."""
    cfg = compose("task=feature_learning", "optim=sgd")
    _job(tmp_path / "0", cfg, status={"status": "finished", "line": "l0"})
    _job(tmp_path / "1", cfg, status={"status": "diverged", "line": "l1"})
    _job(tmp_path / "2", cfg, summary={"val_loss": 0.5, "subspace_distance": 0.1})
    _job(tmp_path / "3", cfg, summary={"val_loss": float("inf"), "subspace_distance": 0.1})
    _job(tmp_path / "4", cfg)
    assert [job_ending(tmp_path / str(i))["status"] for i in range(5)] == \
        ["finished", "diverged", "finished", "diverged", "failed"]
    sweep = compose("task=feature_learning", "optim=sgd", hydra_config=True)
    OmegaConf.set_struct(sweep, False)
    sweep.hydra.sweep.dir = str(tmp_path)
    sweep.hydra.overrides.task = ["task=feature_learning", "optim=sgd,adamw,muon,signum,lion,adamuon"]
    with pytest.raises(SystemExit) as e:
        SummarizeSweep().on_multirun_end(sweep)
    assert e.value.code == 1   # a job failed
    assert capsys.readouterr().out == \
        f"2 finished, 2 diverged, 2 failed; report with: python -m experiments.report {tmp_path}\n"
    assert sweep_line({"failed": 3}, tmp_path) == f"0 finished, 0 diverged, 3 failed; nothing to report in {tmp_path}"
    assert sweep_line({"finished": 1}, Path("multirun/x"), rehearsals=True) == \
        "1 finished, 0 diverged, 0 failed; report with: python -m experiments.common.rehearsal multirun/x --out " \
        "multirun/x/rehearsal.md"


def test_the_sweep_summary_counts_the_jobs_of_a_glob_over_the_tuned_presets(compose):
    """The protocol sweeps launch `+tuned/<group>: glob(*)`: counting their jobs needs the group's
    listing (before, the summary raised "ConfigLoader is not set" and no line was printed)."""
    from experiments.common.callbacks import sweep_jobs

    from omegaconf import open_dict

    sweep = compose("task=sit_mnist", hydra_config=True)
    with open_dict(sweep):   # what the protocol stage's sweeps did as a preset (conf/sweep/sit_mnist_protocol.yaml)
        sweep.hydra.sweeper.params = {"+tuned/sit_mnist_protocol": "glob(*)", "seed": "3,4,5"}
    jobs = sweep_jobs(sweep)
    presets = sorted(p.stem for p in (ROOT / "conf" / "tuned" / "sit_mnist_protocol").glob("*.yaml"))
    assert len(jobs) == 3 * len(presets)   # seeds 3, 4, 5 x every preset the selection wrote
    assert sorted({o for job in jobs for o in job if o.startswith("+tuned/")}) == \
        [f"+tuned/sit_mnist_protocol={p}" for p in presets]


def _run_py(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("launcher", ["local", pytest.param("local_parallel", marks=pytest.mark.slow)])
def test_a_sweep_ends_with_its_counts_and_every_job_with_its_line(launcher, toy, tmp_path):
    sweep = tmp_path / "sweep"
    res = _run_py("-m", f"launcher={launcher}", toy, "task=toy", "task.value=1.0,nan", "task.outcome=ok,fail",
                  "optim=sgd", f"hydra.sweep.dir={sweep}")
    out = res.stdout
    assert res.returncode == 1, res.stderr[-3000:]   # a job failed: the sweep says so in its status
    assert out.rstrip("\n").splitlines()[-1] == \
        f"1 finished, 1 diverged, 2 failed; report with: python -m experiments.report {sweep}"
    # every job's line reaches the console, also when the jobs ran as submitit subprocesses
    assert f"toy/sgd seed 0: finished in 0 s: toy_metric 1, toy_label ok; wrote {sweep / '0'}" in out
    assert f"toy/sgd seed 0: diverged in 0 s: toy_metric nan, toy_label ok; wrote {sweep / '2'}" in out
    for job in (1, 3):
        assert f"toy/sgd seed 0: failed: RuntimeError: the toy task was told to fail; wrote {sweep / str(job)}" in out
    assert "Traceback" not in res.stderr


def test_a_submitted_job_missing_an_input_returns_its_failure(compose, toy, tmp_path, monkeypatch):
    """Run here, a missing input stops the sweep with its one line (raised); in a job that submitit
    launched, whose sweep waits for a result, the job returns with its failure in status.json."""
    cfg = compose(toy, "task=toy", "optim=sgd", "task.outcome=missing")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    with pytest.raises(FileNotFoundError):
        run_job(cfg, tmp_path / "here", keep_going=True)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert run_job(cfg, tmp_path / "submitted", keep_going=True) is None
    status = json.loads((tmp_path / "submitted" / "status.json").read_text())
    assert status["status"] == "failed" and "FileNotFoundError: the toy task's input file is missing" in status["line"]


@pytest.mark.slow
def test_a_parallel_sweep_with_a_job_missing_an_input_ends_with_its_counts(toy, tmp_path):
    sweep = tmp_path / "sweep"
    res = _run_py("-m", "launcher=local_parallel", toy, "task=toy", "task.outcome=ok,missing", "optim=sgd",
                  f"hydra.sweep.dir={sweep}", timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stdout.rstrip("\n").splitlines()[-1] == \
        f"1 finished, 0 diverged, 1 failed; report with: python -m experiments.report {sweep}"
    assert f"toy/sgd seed 0: failed: FileNotFoundError: the toy task's input file is missing; wrote {sweep / '1'}" \
        in res.stdout
    assert "Traceback" not in res.stderr and "UncompletedJobError" not in res.stderr


def test_a_sweep_over_several_tasks_writes_one_folder_counts_every_job_and_reports_both(tmp_path):
    # issue 72 item 5: each job resolved ${sweep_name} to its own task, so job 1 landed in multirun/invariance/
    # and the sweep ended "1 finished, 0 diverged, 1 failed" (rc 1), its report command naming one folder
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "task=feature_learning,invariance",
                          "debug=default"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-300:] + res.stderr[-3000:]
    assert [p.name for p in (tmp_path / "multirun").iterdir()] == ["feature_learning+invariance"]
    (sweep,) = (tmp_path / "multirun" / "feature_learning+invariance").iterdir()
    where = sweep.relative_to(tmp_path)
    assert res.stdout.rstrip("\n").splitlines()[-1] == \
        f"2 finished, 0 diverged, 0 failed; report with: python -m experiments.report {where}"
    assert [job_ending(sweep / str(i))["line"].split(":")[0] for i in (0, 1)] == \
        ["feature_learning/dopr_sgd seed 0", "invariance/dopr_sgd seed 0"]
    report = subprocess.run([sys.executable, "-m", "experiments.report", str(where)], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert f"feature_learning (feature_learning): 1 run -> {where}/report/feature_learning" in report.stdout
    assert f"invariance (invariance): 1 run -> {where}/report/invariance" in report.stdout


@pytest.mark.parametrize("folder", ["multirun/a+b/20260101-000000", "/tmp/it's here, x=1", "back\\slash\\", "q\\'"])
def test_the_pinned_sweep_folder_is_one_override_value_however_it_is_spelled(folder):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.common.callbacks import _quoted

    assert OverridesParser.create().parse_override(f"hydra.sweep.dir={_quoted(folder)}").value() == folder
