"""The input files a job reads are checked before a sweep is submitted (experiments/common/inputs.py),
with the message the job's own loader gives, and without reading or writing them; each family declares its
check in its task config (`task.check_inputs`)."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")

from experiments.common.inputs import check_inputs  # noqa: E402
from experiments.common.tasks import task_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, message", [
    (["task=mup_mlp_cifar10"], "task.data=cifar10 needs task.data_path="),
    (["task=grafting_cifar10", "task.data_path=/nonexistent"], "CIFAR-10 is incomplete under /nonexistent"),
    (["task=mup_gpt_openwebtext", "task.data_path=/nonexistent"], "missing train.bin, val.bin"),
    (["task=humanoid", "task.expert_demos=/nonexistent/d.npz", "task.expert_version=none"],
     "no demonstrations at /nonexistent/d.npz and no committed expert at "),
    (["task=humanoid", "task.demos=/nonexistent/d.npz"],     # a path of one's own is never written
     "demonstration file not found: /nonexistent/d.npz"),
    (["task=humanoid", "task.demos=/nonexistent/d.npz", "task.generate_demos=false"],
     "demonstration file not found: /nonexistent/d.npz"),
    (["task=robomimic_lift", "task.dataset=/nonexistent/lift.hdf5"], "no robomimic dataset file at /nonexistent/lift.hdf5"),
    (["task=sit_imagenet", "task.data_path=/nonexistent"], "latent directory /nonexistent lacks"),
    (["task=sit_imagenet", "task.data=imagenet_images", "task.data_path=/nonexistent"],
     "ImageNet directory /nonexistent does not exist"),
])
def test_a_missing_input_is_named_before_the_job_runs(compose, overrides, message):
    cfg = compose(*overrides)
    with pytest.raises(FileNotFoundError, match=message.replace(".", r"\.")):
        check_inputs(cfg)
    check_inputs(compose(*overrides, "rehearse=true"))   # a rehearsal reads no input file


def test_inputs_that_are_there_pass_and_nothing_is_written(compose, tmp_path):
    (tmp_path / "d.npz").write_bytes(b"")
    demos = ROOT / "data" / "demos"
    before = sorted(demos.iterdir()) if demos.exists() else None
    for overrides in (["task=feature_learning"], ["task=mup_mlp_digits"],
                      ["task=humanoid", f"task.expert_demos={tmp_path / 'new.npz'}"],   # written later, by the expert
                      ["task=humanoid"], ["task=hopper", f"task.demos={tmp_path / 'd.npz'}"]):
        check_inputs(compose(*overrides))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz"]
    assert (sorted(demos.iterdir()) if demos.exists() else None) == before


def test_every_declared_check_is_a_function_of_the_task_s_own_family(compose):
    """`task.check_inputs` names a function of the family whose `entry` the task runs; the six families that read
    input files declare one, the tasks that generate their data (or read only what ships) none."""
    declared = {}
    for t in task_names():
        task = compose(f"task={t}").task
        check = task.get("check_inputs")
        if check:
            module, function = str(check).rsplit(".", 1)
            assert callable(getattr(importlib.import_module(module), function)), (t, check)
            assert module.split(".")[:2] == str(task.entry).split(".")[:2], (t, check, task.entry)
            declared[str(task.entry)] = str(check)
    assert declared == {
        "experiments.appendix.grafting.run": "experiments.appendix.data.check_inputs",
        "experiments.appendix.mup.run": "experiments.appendix.data.check_inputs",
        "experiments.appendix.gpt.run": "experiments.appendix.gpt.check_inputs",
        "experiments.bc.train.run": "experiments.bc.train.check_inputs",
        "experiments.robomimic.train.run": "experiments.robomimic.data.check_inputs",
        "experiments.sit.train.run": "experiments.sit.train.check_inputs",
    }


def test_a_task_that_declares_no_check_is_not_checked(compose):
    cfg = compose("task=robomimic_lift", "task.dataset=/nonexistent/lift.hdf5", "task.check_inputs=null")
    check_inputs(cfg)   # no check declared: the job's own loader names the missing file


@pytest.mark.slow
def test_a_parallel_sweep_with_a_missing_dataset_is_refused_before_launch(tmp_path):
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    res = subprocess.run([sys.executable, "run.py", "-m", "launcher=local_parallel", "task=mup_mlp_cifar10",
                          "debug=default", "optim=sgd,adamw", f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "task.data=cifar10 needs task.data_path" in errors[0], res.stderr[-2000:]
    assert errors[0].endswith("nothing was submitted") and not sweep.exists()
