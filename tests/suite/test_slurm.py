"""`launcher=slurm` against a real one-node Slurm cluster (scripts/slurm_cluster.sh): a sweep is one
job array, a preempted job is requeued and resumes from its checkpoint to the same result as an
uninterrupted run, and a missing partition fails with a message naming slurm.partition. A missing
input, resources no node has, and a forgotten SLURM_CONF are each refused in one line before
anything is queued; a job that stops on its node returns its failure, so the sweep ends with its counts.

Needs the Debian packages slurmctld slurmd slurm-client munge (`bash scripts/slurm_cluster.sh install`,
which CI runs) and root; skipped otherwise. Without slurmdbd there is no `sacct`, so submitit cannot
see a job that died without a result: every wait here is bounded.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a real Slurm cluster: tens of seconds per test
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
PY = sys.executable
#: a guard against a hung launch, not a speed check: a 2-core machine loaded by other jobs needed over 110 s
RUN_TIMEOUT = 300

if shutil.which("slurmctld") is None or shutil.which("slurmd") is None or shutil.which("sbatch") is None:
    pytest.skip("Slurm is not installed (slurmctld/slurmd/sbatch not on PATH): run "
                "`bash scripts/slurm_cluster.sh install` (Debian: slurmctld slurmd slurm-client munge)",
                allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the test cluster's slurmd must run as root", allow_module_level=True)

# Small jobs that fit the one test node (its CPUs are nproc, often 2): conf/launcher/slurm_local.yaml
SLURM_ARGS = ["launcher=slurm_local"]
DOCS = ROOT / "docs" / "suite.md"


def _documented_sweep() -> list:
    """The overrides of the test-cluster sweep docs/suite.md shows (`python run.py -m launcher=slurm_local ...`)."""
    lines = [line.strip() for line in DOCS.read_text().splitlines()
             if line.strip().startswith("python run.py -m launcher=slurm_local")]
    assert len(lines) == 1, f"docs/suite.md should show one test-cluster command, found {lines}"
    return shlex.split(lines[0])[2:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running cluster for this module; SLURM_CONF is set for every subprocess (jobs inherit it)."""
    d = tmp_path_factory.mktemp("slurm")
    # started from a shell that pins threads, as the README's runs do: the node must still get every CPU
    res = subprocess.run(["bash", str(SCRIPT), "start", str(d)], capture_output=True, text=True, timeout=90,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, timeout=60)
        if "another slurmctld" in res.stderr:
            pytest.skip(f"a Slurm cluster is already running on this machine: {res.stderr.strip()}")
        pytest.fail(f"scripts/slurm_cluster.sh start failed:\n{res.stdout}\n{res.stderr}")
    conf = d / "slurm.conf"
    assert f"export SLURM_CONF={conf}" in res.stdout
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "OMP_NUM_THREADS")}
    os.environ["SLURM_CONF"] = str(conf)
    os.environ["OMP_NUM_THREADS"] = "1"  # same threads on the node and in the local reference run
    try:
        yield d
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(d)], capture_output=True, timeout=60)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_py(*args, timeout):
    return subprocess.run([PY, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _tail(text: str, n: int = 3000) -> str:
    return "\n".join(line for line in text.splitlines() if "sacct" not in line)[-n:]


def _cluster_logs(d: Path) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log"):
        p = d / "log" / name
        if p.exists():
            out.append(f"--- {name}\n" + "\n".join(p.read_text().splitlines()[-15:]))
    q = subprocess.run(["squeue"], capture_output=True, text=True, timeout=10)
    return "\n".join(out) + "\n--- squeue\n" + q.stdout + q.stderr


def _submitit_logs(sweep: Path) -> str:
    return "\n".join(f"--- {p}\n{_tail(p.read_text())}" for p in sorted((sweep / ".submitit").glob("*/*_log.*")))


def test_the_documented_sweep_runs_as_one_job_array(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    t0 = time.time()
    documented = _documented_sweep()   # as docs/suite.md writes it, into a folder of the test's
    assert {"launcher=slurm_local", "task=feature_learning", "optim=sgd,dopr_sgd"} <= set(documented)
    res = _run_py(*documented, f"hydra.sweep.dir={sweep}", timeout=RUN_TIMEOUT)
    assert res.returncode == 0, f"{_tail(res.stderr)}\n{_submitit_logs(sweep)}\n{_cluster_logs(cluster)}"
    # submitit_folder is .submitit/%j: an array's tasks are <array id>_<index>
    tasks = sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    assert len(tasks) == 2 and all(re.fullmatch(r"\d+_\d+", t) for t in tasks), tasks
    assert len({t.split("_")[0] for t in tasks}) == 1, f"two submissions, not one array: {tasks}"
    assert sorted(t.split("_")[1] for t in tasks) == ["0", "1"]
    script = next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --partition=debug" in script
    for num, optim in enumerate(("sgd", "dopr_sgd")):
        summary = json.loads((sweep / str(num) / "summary.json").read_text())
        assert summary["optim"] == optim and summary["task"] == "feature_learning"
        # each job's last line reaches the submitting console (the jobs' own output is in .submitit/)
        assert re.search(rf"feature_learning/{optim} seed 0: (finished|diverged) in \d+ s: val_loss .*; wrote "
                         rf"{re.escape(str(sweep / str(num)))}$", res.stdout, re.M), res.stdout[-2000:]
    # and the sweep ends with its counts, read on the submitting host once the array ended
    last = res.stdout.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(rf"\d finished, \d diverged, 0 failed; report with: python -m experiments.report "
                        rf"{re.escape(str(sweep))}", last), last
    print(f"2-job array sweep: {time.time() - t0:.1f} s")


def _wait(cond, timeout_s: float, what: str, on_fail=lambda: ""):
    end = time.time() + timeout_s
    while time.time() < end:
        if cond():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{on_fail()}")


def _metric_steps(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_preempted_job_is_requeued_and_resumes_to_the_uninterrupted_result(cluster, tmp_path):
    # 300 steps at 50 ms: ~15 s of training (plus start-up), a checkpoint every 20 steps.
    overrides = ["task=feature_learning", "optim=dopr_sgd", "seed=0", "task.steps=300", "task.log_every=10",
                 "task.checkpoint_every=20", "task.n_val=512", "task.step_delay_s=0.05"]
    sweep, local_dir = tmp_path / "sweep", tmp_path / "local"
    job_dir = sweep / "0"
    t0 = time.time()
    launcher_log = open(tmp_path / "launcher.log", "w")
    proc = subprocess.Popen([PY, "run.py", "-m", *SLURM_ARGS, *overrides, f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, stdout=launcher_log, stderr=subprocess.STDOUT, start_new_session=True)
    local = None
    try:
        diag = lambda: f"{_tail((tmp_path / 'launcher.log').read_text())}\n{_submitit_logs(sweep)}\n{_cluster_logs(cluster)}"
        # step 100 is logged right after its checkpoint is saved: preempt mid-run, past several checkpoints
        _wait(lambda: any(s >= 100 for s in _metric_steps(job_dir / "metrics.jsonl")), 180,
              "the job to reach step 100", diag)
        assert (job_dir / "checkpoint.pt").exists()
        t_preempt = time.time() - t0
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-t", "1", "-J", "urgent",
                                 "-o", str(tmp_path / "urgent-%j.out"), "--wrap", "sleep 3"],
                                capture_output=True, text=True, timeout=30)
        assert urgent.returncode == 0, urgent.stderr
        # the same configuration without the launcher, in process, while the Slurm job is preempted
        local = subprocess.Popen([PY, "run.py", *overrides, f"hydra.run.dir={local_dir}"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the preempted sweep did not finish within 240 s\n{diag()}")
        assert rc == 0, diag()
        local_out, _ = local.communicate(timeout=60)
        assert local.returncode == 0, local_out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if local is not None and local.poll() is None:
            local.kill()
            local.wait(timeout=10)
        launcher_log.close()
    elapsed = time.time() - t0

    logs = list((sweep / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 1, logs
    log = logs[0].read_text()
    # the same Slurm job ran twice: signalled (USR2), requeued by submitit, restarted, resumed
    assert log.count("Starting with JobEnvironment") == 2, _tail(log)
    assert "Caught signal SIGUSR2" in log and "Requeued job" in log, _tail(log)
    m = re.search(r"resumed from (\S+) \((\d+) metric rows\)", log)
    assert m and Path(m.group(1)) == job_dir / "checkpoint.pt" and int(m.group(2)) >= 10, _tail(log)
    # every step logged once across the two runs
    assert _metric_steps(job_dir / "metrics.jsonl") == list(range(0, 301, 10))
    got = json.loads((job_dir / "summary.json").read_text())
    want = json.loads((local_dir / "summary.json").read_text())
    assert got["val_loss"] == want["val_loss"] and got["subspace_distance"] == want["subspace_distance"], (got, want)
    print(f"preempted at {t_preempt:.1f} s (step >= 100), finished after requeue at {elapsed:.1f} s")


def test_missing_partition_names_slurm_partition(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    extra = ["slurm.partition=???"] if (ROOT / "conf" / "local" / "default.yaml").exists() else []
    res = _run_py("-m", "launcher=slurm", "task=feature_learning", "debug=default", *extra,
                  f"hydra.sweep.dir={sweep}", timeout=60)
    assert res.returncode != 0
    assert "slurm.partition" in res.stderr, res.stderr[-2000:]
    assert not (sweep / ".submitit").exists()  # stopped before anything was submitted


def test_multigpu_launcher_runs_one_task_per_device_under_torch_distributed(cluster, tmp_path):
    """launcher=slurm_multigpu on CPUs: two tasks of one job form a gloo process group from submitit's
    environment; rank 0 alone writes the summary."""
    sweep = tmp_path / "ddp"
    res = _run_py("-m", "launcher=slurm_multigpu", "slurm.partition=debug", "slurm.gpus_per_node=0",
                  "slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "slurm.mem_gb=2", "slurm.time_min=10",
                  "task=feature_learning", "optim=dopr_sgd", "debug=default", f"hydra.sweep.dir={sweep}", timeout=RUN_TIMEOUT)
    assert res.returncode == 0, _tail(res.stderr) + _cluster_logs(cluster)
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optim"] == "dopr_sgd"


def _queued() -> list:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()


def _errors(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_a_missing_dataset_is_refused_before_sbatch_in_one_line(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    before = _queued()
    res = _run_py("-m", *SLURM_ARGS, "task=mup_mlp_cifar10", "debug=default", "optim=sgd,adamw",
                  f"hydra.sweep.dir={sweep}", timeout=120)
    assert res.returncode == 2, _tail(res.stderr)
    errors = _errors(res.stderr)
    assert len(errors) == 1 and "task.data=cifar10 needs task.data_path" in errors[0], _tail(res.stderr)
    assert "(job 0 of 2: " in errors[0] and errors[0].endswith("nothing was submitted")
    assert "Traceback" not in res.stderr and not sweep.exists() and set(_queued()) <= set(before)   # nothing new


def test_a_job_missing_its_dataset_on_the_node_fails_and_the_sweep_ends_with_its_counts(cluster, tmp_path):
    """The check before sbatch bypassed (the files would be on the nodes only): the job stops on its node
    and returns its failure; without sacct the sweep used to wait for it forever."""
    sweep = tmp_path / "sweep"
    res = _run_py("-m", *SLURM_ARGS, "task=mup_mlp_cifar10", "debug=default", "task.data=digits,cifar10",
                  "hydra.callbacks.check_jobs.inputs=false", f"hydra.sweep.dir={sweep}", timeout=RUN_TIMEOUT)
    assert res.returncode == 1, f"{_tail(res.stderr)}\n{_submitit_logs(sweep)}"   # a job failed
    assert res.stdout.rstrip("\n").splitlines()[-1] == \
        f"1 finished, 0 diverged, 1 failed; report with: python -m experiments.report {sweep}"
    assert "failed: FileNotFoundError: task.data=cifar10 needs task.data_path" in res.stdout
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "failed"


def test_resources_no_node_has_are_one_line_with_sbatchs_message(cluster, tmp_path):
    """launcher=slurm's defaults (1 GPU, 8 CPUs, 32 GB) on the test node (no GPU): a warning naming the
    partition's largest node, then sbatch's own refusal in one line, and no folder left behind."""
    sweep = tmp_path / "sweep"
    res = _run_py("-m", "launcher=slurm", "slurm.partition=debug", "task=lds", "debug=default",
                  f"hydra.sweep.dir={sweep}", timeout=120)
    assert res.returncode == 2, _tail(res.stderr)
    assert re.search(r"^Warning: a job asks for 8 CPUs, 32 GB, 1 GPUs per node .* more than any node of "
                     r"partition debug has \(at most \d+ CPUs, [\d.]+ GB, 0 GPUs\)", res.stderr, re.M), res.stderr
    errors = _errors(res.stderr)
    assert len(errors) == 1 and errors[0].startswith("Error: sbatch refuses the sweep's jobs: sbatch: error: ")
    assert errors[0].endswith("; nothing was submitted") and "Traceback" not in res.stderr
    assert not sweep.exists()


def test_a_forgotten_slurm_conf_is_one_line_naming_it(cluster, tmp_path):
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has a system-wide /etc/slurm/slurm.conf: Slurm finds a cluster without SLURM_CONF")
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    res = subprocess.run([PY, "run.py", "-m", *SLURM_ARGS, "task=lds", "debug=default", f"hydra.sweep.dir={sweep}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, _tail(res.stderr)
    errors = _errors(res.stderr)
    assert len(errors) == 1 and "SLURM_CONF is not set" in errors[0] and "Traceback" not in res.stderr, res.stderr
    assert not sweep.exists()
