"""rehearse=true: a paper-scale job's real model on a synthetic batch for a few steps, and the table."""
import json
from pathlib import Path

import pytest

from experiments.common import rehearsal
from experiments.common.checks import ConfigError, check_job
from experiments.common.launch import run_job

TINY_SIT = ["task.model=custom", "task.model_kwargs={depth: 1, hidden_size: 32, num_heads: 2, patch_size: 2}",
            "task.input_size=8"]


def test_a_sit_rehearsal_reports_loss_coverage_health_and_memory_and_the_table_lists_it(tmp_path, compose):
    # damping 1e-4 (the presets use 1e-3): the setting whose health report must name the timestep layer
    cfg = compose("task=sit_imagenet", "+tuned/sit_imagenet=dopr_adamw", "ap.damping=1e-4", "rehearse=true", *TINY_SIT)
    s = run_job(cfg, tmp_path / "sweep" / "0")
    assert s["rehearsal"] and s["finite"] and len(s["losses"]) == cfg.task.rehearsal.steps == 4
    assert s["falls"] == (s["losses"][-1] < s["losses"][0]) and s["loss_last"] == s["losses"][-1]
    assert s["preconditioned"] == "11/12"            # every module with weights but the fixed position table
    assert s["param_MB"] == pytest.approx(s["params_M"] * 1e6 * 4 / 2**20)   # float32 weights
    assert s["opt_state_MB"] > 0 and s["peak_rss_MB"] > 0 and s["step_s"] > 0 and s["device"] == "cpu"
    if Path("/proc/self/clear_refs").exists():   # Linux: the peak RSS restarts with each job
        assert s["peak_since"] == "this job's steps"
    # damping 1e-4 on the timestep MLP's input: the health report names the layer in the verdict
    assert "t_embedder.mlp.0" in s["weak_layer_names"] and s["worst_weak_share"] > 0.5
    assert s["verdict"].startswith(f"{s['weak_layers']} layer(s) in the weak-direction regime (")
    assert "t_embedder.mlp.0" in s["verdict"] or s["weak_layers"] > 3
    assert [json.loads(l)["step"] for l in (tmp_path / "sweep" / "0" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4]
    rehearsal.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "rehearsal.md")])
    md = (tmp_path / "rehearsal.md").read_text()
    assert "| sweep | sit_imagenet | dopr_adamw | custom, 8x8x4 | 4 |" in md
    assert md.count("\n| sweep | sit_imagenet") == 1 and "python -m experiments.common.rehearsal" in md


def test_rehearse_is_refused_for_a_task_without_a_rehearsal(compose):
    cfg = compose("task=feature_learning", "rehearse=true")
    with pytest.raises(ConfigError, match=r"task=feature_learning has no rehearsal .*\(rehearse:\): robomimic_lift, "
                                          r"robomimic_toolhang, .*sft_llama31_8b, sft_llama32_3b, sit_digits"):
        check_job(cfg, ["task=feature_learning", "rehearse=true"], set())


def test_a_rehearsal_without_the_health_report_says_so(tmp_path, compose):
    cfg = compose("task=sit_imagenet", "+tuned/sit_imagenet=dopr_adamw", "ap.damping=1e-4", "rehearse=true",
                  "+task.rehearsal.health=false", *TINY_SIT)
    s = run_job(cfg, tmp_path / "0")
    # the same layer as above is in the weak regime, but nothing was measured, so nothing is claimed
    assert s["weak_layers"] == "not measured" and s["weak_layer_names"] == [] and s["worst_weak_share"] is None
    assert s["verdict"].endswith("(AP health not measured: task.rehearsal.health=false)") and s["finite"]


def _summary(folder, **fields):
    folder.mkdir(parents=True)
    s = {"rehearsal": True, "task": "sit_imagenet", "optim": "adamw", "model": "SiT-S/2", "batch": 256,
         "peak_since": "this job's steps", "verdict": "ok", **fields}
    (folder / "summary.json").write_text(json.dumps(s))


def test_the_table_names_the_device_and_the_memory_measure_of_its_rows(tmp_path):
    _summary(tmp_path / "gpu" / "0", device="cuda (NVIDIA H100 80GB HBM3)", peak_cuda_alloc_MB=2048.0)
    _summary(tmp_path / "cpu" / "0", peak_rss_MB=512.0)   # written before summaries named their device
    rehearsal.main([str(tmp_path / "gpu"), "--out", str(tmp_path / "gpu.md")])
    md = (tmp_path / "gpu.md").read_text()
    assert md.splitlines()[0].endswith("synthetic batches, CUDA (NVIDIA H100 80GB HBM3)") and "CPU" not in md
    header = next(line for line in md.splitlines() if line.startswith("| sweep"))
    assert "peak_cuda_alloc_MB" in header and "peak_rss_MB" not in header and "| 2048 | ok |" in md
    rehearsal.main([str(tmp_path / "cpu"), "--out", str(tmp_path / "cpu.md")])
    md = (tmp_path / "cpu.md").read_text()
    assert md.splitlines()[0].endswith("synthetic batches, CPU") and "| peak_rss_MB | verdict |" in md
    # both kinds in one table: a device column and both measures, each row in its own
    rehearsal.main([str(tmp_path / "cpu"), str(tmp_path / "gpu"), "--out", str(tmp_path / "both.md")])
    md = (tmp_path / "both.md").read_text()
    assert md.splitlines()[0].endswith("CPU and CUDA (NVIDIA H100 80GB HBM3)")
    assert "| peak_rss_MB | peak_cuda_alloc_MB | verdict |" in md and "| sweep | task | optimizer | device |" in md
