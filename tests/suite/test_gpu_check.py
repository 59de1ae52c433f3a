"""benchmarks/gpu_check.py, the GPU check, tested on the CPU: its smoke mode writes every section with numbers
in it, a part that raises or hangs is reported FAIL while the others still run, the targets give one
verdict per DoPr row, and the real-size rehearsal overrides resolve to the tasks' real batches."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = [sys.executable, "-m", "benchmarks.gpu_check"]


def test_a_part_that_raises_or_runs_out_of_time_is_a_fail_with_its_one_line(tmp_path):
    run = lambda name, code, limit=30: gpu_check.run_part(name, [sys.executable, "-c", code], limit, tmp_path)  # noqa: E731
    raised = run("raises", "raise ValueError('no such kernel')")
    hung = run("hangs", "import time; print('started', flush=True); time.sleep(60)", limit=1)
    fine = run("fine", "print('done')")
    assert (raised["status"], raised["line"]) == ("FAIL", "exit 1: ValueError: no such kernel")
    assert (hung["status"], hung["line"]) == ("FAIL", "timed out after 1 s (the part's limit)") and hung["seconds"] < 30
    assert (fine["status"], fine["line"]) == ("ok", "")
    assert (tmp_path / "hangs.log").read_text().startswith("started")


def test_the_targets_give_one_verdict_per_dopr_row_and_name_a_part_without_rows():
    bench = {"bench_sit": {"adamw": {"R": None}, "dopr_adamw": {"R": 1.2, "R_model": 1.25},
                           "dopr_adamw k=10": {"R": 1.3, "R_model": 1.05}},
             "bench_llama": {"dopr_muon": {"R": 2.5, "R_model": 2.4}}, "bench_toolhang": None}
    rows = gpu_check.target_rows(bench, smoke=False)
    assert [(t, row, verdict) for t, row, _, verdict in rows] == [
        ("abs(R / R_model - 1) <= 0.1", "sit/dopr_adamw", "PASS"), ("R <= 1.25 at k=1", "sit/dopr_adamw", "PASS"),
        ("abs(R / R_model - 1) <= 0.1", "sit/dopr_adamw k=10", "FAIL"),   # 1.3 / 1.05 - 1 = 0.24
        ("abs(R / R_model - 1) <= 0.1", "llama/dopr_muon", "PASS"), ("R <= 2", "llama/dopr_muon", "FAIL"),
        ("bench_toolhang's targets", "-", "not measured")]
    assert {verdict for *_, verdict in gpu_check.target_rows(bench, smoke=True)} == {"n/a (smoke)", "not measured"}


def test_the_paper_step_is_extrapolated_from_the_first_micro_batch_the_later_ones_and_the_optimizer_step():
    # steps timed in parts: [micro-batch 1, ..., micro-batch a, optimizer step]; medians 3, 2 and 5 ms
    parts = [[3.0, 2.0, 2.5, 5.0], [4.0, 1.0, 2.0, 6.0], [3.0, 2.0, 1.5, 5.0]]
    assert gpu_check.extrapolated(parts, 4) == 3.0 + 3 * 2.0 + 5.0
    assert gpu_check.extrapolated(parts, 32) == 3.0 + 31 * 2.0 + 5.0
    with pytest.raises(ValueError, match="at least two micro-batches"):
        gpu_check.extrapolated([[3.0, 5.0]], 4)
    # its targets: the extrapolation of the measured count within 10% of the measurement (GP and DoPr), R_model
    # on DoPr's rows, and R <= 1.25 at the paper's count
    step = {"adamw x4": {"t": 0.100, "t_measured": 0.100, "t_parts": 0.109, "agree": True},
            "adamw x32, from parts": {"t": 0.8, "t_measured": None, "t_parts": 0.8},
            "dopr_adamw x4": {"t": 0.150, "t_measured": 0.150, "t_parts": 0.120, "agree": False, "R": 1.5, "R_model": 1.45},
            "dopr_adamw x32, from parts": {"t": 1.0, "t_measured": None, "t_parts": 1.0, "R": 1.25, "R_model": 1.2}}
    rows = gpu_check.target_rows({"bench_llama_step": step}, smoke=False)
    assert [(t, row, verdict) for t, row, _, verdict in rows] == [
        ("abs(from parts / measured - 1) <= 0.1", "llama_step/adamw x4", "PASS"),
        ("abs(from parts / measured - 1) <= 0.1", "llama_step/dopr_adamw x4", "FAIL"),   # 120 / 150 - 1 = -0.2
        ("abs(R / R_model - 1) <= 0.1", "llama_step/dopr_adamw x4", "PASS"),
        ("abs(R / R_model - 1) <= 0.1", "llama_step/dopr_adamw x32, from parts", "PASS"),
        ("R <= 1.25 at the paper's step", "llama_step/dopr_adamw x32, from parts", "PASS")]
    assert rows[1][2] == "120.0 vs 150.0 ms"


def test_the_paper_step_part_writes_measured_and_extrapolated_rows_that_add_up(tmp_path):
    # --smoke on the CPU: the tiny Llama at the task's micro-batch (2 sequences), measured whole at 4 micro-batches
    # and extrapolated to the task's 32 from the printed parts: first + (a - 1) later + the optimizer step
    out, work = tmp_path / "g.md", tmp_path / "w"
    proc = subprocess.run([*GPU_CHECK, "--device", "cpu", "--smoke",
                           "--parts", "bench_llama_step", "--out", str(out), "--workdir", str(work)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "| bench_llama_step |" in text and "32 micro-batches of 2 x 32 tokens: measured whole at 4" in text
    rows = {r[0]: r[1:] for r in _table(text, "| optimizer step |")}
    assert list(rows) == ["adamw x4", "adamw x32, from parts", "dopr_adamw x4", "dopr_adamw x32, from parts"]
    parts = {m[0]: [float(x) for x in m[1:]] for m in re.findall(
        r"- (\w+): first micro-batch ([\d.]+) ms, later ones ([\d.]+) ms, optimizer step ([\d.]+) ms", text)}
    assert set(parts) == {"adamw", "dopr_adamw"}
    for gp in ("adamw", "dopr_adamw"):
        first, later, opt = parts[gp]
        measured, from_parts, rel = rows[f"{gp} x4"][:3]
        for a, shown in ((4, float(from_parts)), (32, float(rows[f"{gp} x32, from parts"][1]))):
            # each printed value is rounded to 0.05 ms: the sum of a + 1 of them to 0.05 (a + 2)
            assert abs(shown - (first + (a - 1) * later + opt)) <= 0.05 * (a + 2) + 1e-9
        # rel is printed to 0.1% (+-0.05%) from the unrounded times; the times to 0.1 ms (+-0.05 each): f / m moves by
        # up to 0.05 / m (1 + f / m) from them
        m, f = float(measured), float(from_parts)
        tol = 0.0005 + 0.05 / m * (1 + f / m) + 1e-9
        assert m > 0 and abs(float(rel.rstrip("%")) / 100 - (f / m - 1)) <= tol
        assert rows[f"{gp} x32, from parts"][0] == "-"
    r_paper = float(rows["dopr_adamw x32, from parts"][3])
    t_paper = {gp: float(rows[f"{gp} x32, from parts"][1]) for gp in ("adamw", "dopr_adamw")}
    # R is printed to 0.01 (+-0.005), the times to 0.1 ms (+-0.05 each)
    assert abs(r_paper - t_paper["dopr_adamw"] / t_paper["adamw"]) <= 0.005 + 0.05 / t_paper["adamw"] * (1 + r_paper) + 1e-9
    assert float(rows["dopr_adamw x4"][3]) > 0 and float(rows["dopr_adamw x4"][4]) > 1
    assert float(rows["dopr_adamw x32, from parts"][4]) > 1
    saved = json.loads((work / "bench_llama_step.json").read_text())
    assert set(saved) == set(rows) and all(isinstance(saved[k]["agree"], bool) for k in ("adamw x4", "dopr_adamw x4"))


def test_the_rehearsal_overrides_give_the_real_per_gpu_batch(compose):
    real = {sweep: overrides for sweep, (overrides, _) in gpu_check.REHEARSALS.items()}
    assert compose("sweep=paper_sit", "rehearse=true", *real["paper_sit"]).task.rehearsal.batch == 256
    assert compose("sweep=paper_toolhang", "rehearse=true", *real["paper_toolhang"]).task.rehearsal.batch == 256
    r = compose("sweep=sft_llama31_8b", "rehearse=true", *real["sft_llama31_8b"]).task.rehearsal
    assert (r.batch, r.seq_len, r.dtype) == (2, 4096, "bfloat16")     # the micro-batch of one GPU, bf16


def _table(text: str, header_start: str) -> list:
    """The rows (lists of cells) of every markdown table whose header starts with `header_start`."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith(header_start):
            inside = True
        elif inside and line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif not line.startswith("|"):
            inside = False
    return rows


@pytest.mark.slow
def test_the_smoke_check_writes_every_section_with_numbers_and_a_failing_part_stops_nothing(tmp_path):
    out = tmp_path / "gpu_cpu.md"
    proc = subprocess.run([*GPU_CHECK, "--device", "cpu", "--smoke",
                           "--out", str(out), "--workdir", str(tmp_path / "work"), "--fail", "rehearse_paper_sit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# GPU check: ") and "--fail rehearse_paper_sit" in text
    assert "device cpu (" in text and f"torch {torch.__version__}" in text and "commit " in text
    status = {row[0]: row[4] for row in _table(text, "| part |")}
    assert list(status) == list(gpu_check.PARTS)
    failed = status.pop("rehearse_paper_sit")
    assert failed == "FAIL: RuntimeError: --fail rehearse_paper_sit: made to fail (a check of the report)"
    assert status.pop("solvers").split(":")[0] in ("ok", "SKIPPED")   # benchmarks/bench_solvers.py may be absent
    assert all(s.startswith("ok") for s in status.values()), status
    for section in ("## Environment", "## Bench rows and profiles", "## Agreement", "## Rehearsals", "## Solver benchmark", "## Targets"):
        assert section in text
    # every bench row has its numbers: t for all, R and R_model for DoPr's, and a profile
    rows = _table(text, "| optimizer |")
    labels = [f"dopr_{gp}" + (" k=2" if k == 2 else "") if k else gp for gp in ("adamw", "muon") for k in (0, 1, 2)]
    assert [r[0] for r in rows] == labels * 3
    for r in rows:
        assert float(r[2]) > 0 and float(r[5]) >= 0 and (r[0].startswith("dopr") == bool(r[3]))
        assert not r[3] or (float(r[3]) > 0 and float(r[4]) > 1)
    profiles = _table(text, "| row |")
    assert len(profiles) == 3 * 2 * 4 and all(float(p[2]) > 0 and "`" in p[7] for p in profiles)
    assert len(_table(text, "| check |")) == 6
    targets = _table(text, "| target |")
    # the three bench parts' DoPr rows; at the paper's step 2 extrapolations, 2 R_model and the paper's R
    assert len(targets) == 3 * 4 + 2 * 2 + 4 + 5 and {t[3] for t in targets} == {"n/a (smoke)"}
    rehearsals = _table(text, "| sweep |")
    assert [r[:3] for r in rehearsals] == [["paper_toolhang", "robomimic_toolhang", "dopr_adamw"],
                                           ["sft_llama31_8b", "sft_llama31_8b", "dopr_adamw"]]
    assert "synthetic batches, CPU**" in text


@pytest.mark.slow
def test_the_smoke_check_s_peer_rows_have_ratios_and_name_their_package_and_an_absent_one_is_a_row(tmp_path):
    # issue 61 item 9: SOAP (f=10), Shampoo and PSGD-Kron against AdamW and DoPr-AdamW in one round-robin;
    # the second run hides pytorch-optimizer (sitecustomize, in every part's process): rows say so, no crash
    pytest.importorskip("pytorch_optimizer")
    from importlib import metadata

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['pytorch_optimizer'] = None\n")
    script = [*GPU_CHECK, "--device", "cpu", "--smoke",
              "--parts", "peers_sit"]
    texts = {}
    for case, path in (("installed", ""), ("hidden", str(hide))):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        out = tmp_path / f"{case}.md"
        proc = subprocess.run([*script, "--out", str(out), "--workdir", str(tmp_path / case)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts[case] = out.read_text()
    labels = ["adamw", "dopr_adamw", "soap f=10", "shampoo", "psgd_kron"]
    rows = _table(texts["installed"], "| run |")
    assert [r[0] for r in rows] == labels and [row[4] for row in _table(texts["installed"], "| part |")] == [
        "ok: 5 of 5 rows ran"]
    assert all(float(r[3]) > 0 and 0 < float(r[4]) < float("inf") for r in rows) and rows[0][4] == "1.00"
    version = metadata.version("pytorch-optimizer")
    assert [r[1] for r in rows[2:]] == [f"pytorch-optimizer {version}, `pytorch_optimizer.{c}`"
                                        for c in ("SOAP(precondition_frequency=10)", "Shampoo()", "Kron()")]
    assert "- soap f=10: lr=" in texts["installed"] and "- shampoo: lr=" in texts["installed"]
    assert re.search(r"DoPr-AdamW k=1 cheaper than SOAP f=10 \(issue 61\): R \d+\.\d\d vs \d+\.\d\d, n/a \(smoke\)",
                     texts["installed"])
    rows = _table(texts["hidden"], "| run |")
    assert [r[0] for r in rows] == labels and all(float(r[4]) > 0 for r in rows[:2])
    assert [r[1] for r in rows[2:]] == ["pytorch-optimizer: missing: pytorch-optimizer is not installed "
                                        "(pyproject's `peers` extra; `make gpu-deps` carries it to a GPU machine)"] * 3
    assert [row[4] for row in _table(texts["hidden"], "| part |")] == [
        "ok: 2 of 5 rows ran; soap f=10 missing; shampoo missing; psgd_kron missing"]


def test_limit_scale_multiplies_each_parts_limit_and_a_non_positive_one_is_refused(tmp_path):
    script = [*GPU_CHECK, "--device", "cpu", "--smoke", "--parts", "env"]
    out = tmp_path / "g.md"
    proc = subprocess.run([*script, "--limit-scale", "0.5", "--out", str(out), "--workdir", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    limit = gpu_check.PARTS["env"][1] * 0.5
    assert [row[2] for row in _table(out.read_text(), "| part |")] == [f"{limit:g}"]
    bad = subprocess.run([*script, "--limit-scale", "0", "--out", str(tmp_path / "x.md")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--limit-scale must be positive, got 0.0" in bad.stderr
    assert not (tmp_path / "x.md").exists()


def test_a_dopr_option_reaches_every_dopr_row_of_the_bench_parts_and_a_bad_one_is_refused(tmp_path):
    # --dopr-option solver=span: the DoPr rows eigendecompose (the profiles' ops say so) and the header says
    # which rule ran; without it the same rows factor by Cholesky and run no eigh
    script = [*GPU_CHECK, "--device", "cpu", "--smoke", "--parts", "bench_sit"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra, eigh in ((["--dopr-option", "solver=span", "--dopr-option", "span_cap=3"], True), ([], False)):
        out = tmp_path / f"g{len(extra)}.md"
        proc = subprocess.run([*script, *extra, "--out", str(out), "--workdir", str(tmp_path / f"w{len(extra)}")],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        text = out.read_text()
        assert ("DoPr rows with solver=span, span_cap=3" in text) is eigh
        profiles = _table(text, "| row |")
        dopr_rows = [r for r in profiles if r[0].startswith("dopr_") and "other step" not in r[0]]   # refreshing steps
        assert dopr_rows and all(("_linalg_eigh" in r[7]) is eigh for r in dopr_rows)
        assert not any("_linalg_eigh" in r[7] for r in profiles if not r[0].startswith("dopr_"))
    bad = subprocess.run([*script, "--dopr-option", "solver=foo", "--out", str(tmp_path / "x.md")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dopr-option: Invalid solver: 'foo'" in bad.stderr
    assert not (tmp_path / "x.md").exists()


