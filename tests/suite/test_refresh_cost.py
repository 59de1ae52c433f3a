"""benchmarks.refresh_cost (issue 76 item 3): the projection's arithmetic on a synthetic GPU report, the parser's
error on a missing row, the refresh fractions read from a synthetic study_runs.csv, and the smoke mode's three
tables."""
import pytest

from benchmarks import refresh_cost

HEADER = ("| optimizer | n | t_step (ms) | R | R_model | opt state (MB) | step transient (MB) | peak CUDA (MB) |\n"
          "|---|---|---|---|---|---|---|---|\n")


def _section(heading, gp, t_gp, dp, t1, t10):
    return (f"#### {heading}: 1 M params\n\ntiming: ...\n\n" + HEADER
            + f"| {gp} | 10 | {t_gp} |  |  | 1 | 1 | 1 |\n| {dp} | 10 | {t1} | 2 | 1 | 1 | 1 | 1 |\n"
            + f"| {dp} k=10 | 10 (1 refresh) | {t10} | 1 | 1 | 1 | 1 | 1 |\n\n"
            # a profile table under the same heading: its rows must not be read as bench rows
            + "| optimizer | steps | wall (ms) |\n|---|---|---|\n"
            + f"| {gp} | 1 | 999.0 |\n\n")


def _report(tmp_path, drop=None):
    text = "# GPU check\n\n### bench_sit: ok\n\n"
    text += _section("SiT-S_2_b256_bf16", "adamw", 100.0, "dopr_adamw", 190.0, 109.0)
    text += _section("SiT-S_2_b256_bf16", "muon", 200.0, "dopr_muon", 290.0, 209.0)
    text += "### bench_toolhang: ok\n\n"
    text += _section("toolhang_policy_b256", "adamw", 50.0, "dopr_adamw", 140.0, 59.0)
    text += _section("toolhang_policy_b256", "muon", 60.0, "dopr_muon", 150.0, 69.0)
    if drop:
        text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"| {drop} |"))
    path = tmp_path / "gpu.md"
    path.write_text(text)
    return path


def test_the_projection_reads_the_bench_rows_and_projects_exactly(tmp_path):
    times = refresh_cost.gpu_step_times(_report(tmp_path))
    assert times["SiT-S/2"] == {"adamw": 100.0, "dopr_adamw": 190.0, "dopr_adamw k=10": 109.0,
                                "muon": 200.0, "dopr_muon": 290.0, "dopr_muon k=10": 209.0}
    assert times["Tool Hang"]["dopr_adamw k=10"] == 59.0
    rows = refresh_cost.projection(times, {"a": 0.2, "target": 0.15}, probe=0.05)
    sit = {(r["gp"], r["f_label"]): r for r in rows if r["model"] == "SiT-S/2"}
    r = sit[("adamw", "a")]
    # t_other = (10 * 109 - 190) / 9 = 100; R = (0.2 * 190 + 0.8 * 100) / 100 = 1.18; probe adds 0.8 * 0.05 * 100
    assert r["t_refresh"] == 190.0 and r["t_other"] == pytest.approx(100.0)
    assert r["R"] == pytest.approx(1.18) and r["R_probe"] == pytest.approx(1.22)
    # muon: t_other = (2090 - 290) / 9 = 200; R at 0.15 = (0.15 * 290 + 0.85 * 200) / 200 = 1.0675
    assert sit[("muon", "target")]["R"] == pytest.approx(1.0675)
    hang = next(r for r in rows if r["model"] == "Tool Hang" and r["gp"] == "adamw" and r["f_label"] == "a")
    # t_other = (590 - 140) / 9 = 50; R = (0.2 * 140 + 0.8 * 50) / 50 = 1.36
    assert hang["t_other"] == pytest.approx(50.0) and hang["R"] == pytest.approx(1.36)
    assert refresh_cost.projection(times, {"a": 0.2}, probe=None)[0]["R_probe"] is None


def test_a_missing_gpu_row_fails_naming_the_file_and_the_row(tmp_path):
    path = _report(tmp_path, drop="dopr_muon k=10")
    with pytest.raises(ValueError, match=r"gpu\.md: no row 'dopr_muon k=10' in the SiT-S/2 bench table"):
        refresh_cost.gpu_step_times(path)
    with pytest.raises(ValueError, match="no such GPU report"):
        refresh_cost.gpu_step_times(tmp_path / "absent.md")


def test_the_refresh_fractions_are_the_medians_over_seeds_of_each_drift_study(tmp_path):
    folder = tmp_path / "toy_drift"
    folder.mkdir()
    (folder / "study_runs.csv").write_text(
        "arm,ap.precond_every,seed,val_loss,refresh_fraction,wall_time_s\n"
        "dopr_adamw,1,1,0.3,1.0,5\ndopr_adamw,10,1,0.2,0.30,5\ndopr_adamw,10,2,0.2,0.10,5\n"
        "dopr_adamw,10,3,0.2,0.20,5\ndopr_adamw,100,1,0.2,0.05,5\ndopr_adamw,100,2,0.2,0.07,5\n")
    (tmp_path / "toy").mkdir()   # a staleness study (not drift) is not read
    (tmp_path / "toy" / "study_runs.csv").write_text("arm,ap.precond_every,seed,refresh_fraction\ndopr_adamw,10,1,0.1\n")
    fractions = refresh_cost.policy_fractions(tmp_path)
    assert list(fractions) == ["toy"]
    assert {cap: f for cap, (f, _) in fractions["toy"].items()} == {10: pytest.approx(0.2), 100: pytest.approx(0.06)}
    assert fractions["toy"][10][1] == folder / "study_runs.csv"
    assert refresh_cost.measured_fractions(fractions) == {"cap 10, toy": pytest.approx(0.2),
                                                          "cap 100, toy": pytest.approx(0.06), "target": 0.15}


def test_the_committed_studies_and_gpu_report_parse():
    fractions = refresh_cost.policy_fractions()
    assert {"feature_learning", "conv_digits"} <= set(fractions)
    assert all(0 < f < 1 for caps in fractions.values() for f, _ in caps.values())
    assert set(refresh_cost.gpu_step_times()) == {"SiT-S/2", "Tool Hang"}


def test_the_smoke_mode_writes_the_three_tables(tmp_path):
    out = tmp_path / "smoke.md"
    refresh_cost.main(["--smoke", "--threads", "1", "--out", str(out)], command="python -m benchmarks.refresh_cost --smoke")
    text = out.read_text()
    assert text.startswith("`python -m benchmarks.refresh_cost --smoke`") and "load average" in text
    assert "## 1. Step times" in text and "## 2. R under the policy" in text
    assert "## 3. Projection, not a measurement" in text and "H200" in text and "assumption" in text
    for label in ("| adamw | gp |", "| dopr_adamw | every | 1 |", "| dopr_adamw k=2 | every | 2 |",
                  "| dopr_adamw k=2 drift | drift | 2 |", "| SiT-S/2 | muon |", "| Tool Hang | adamw |"):
        assert label in text
    assert "| n partial | partial refresh step (ms) |" in text
    assert "smoke run: no verdict" in text and "PASS" not in text and "FAIL" not in text


def test_the_verdicts_take_the_largest_measured_fraction_and_the_probe():
    policy = [{"model": "transformer", "cap": 10, "source": "a (`x`)", "f": 0.2, "R": 1.05, "target": False},
              {"model": "transformer", "cap": 10, "source": "b (`y`)", "f": 0.3, "R": 1.12, "target": False},
              {"model": "transformer", "cap": 10, "source": "issue 76's target", "f": 0.15, "R": 1.0, "target": True}]
    proj = [{"model": "SiT-S/2", "gp": "adamw", "f_label": "cap 10, b", "f": 0.3, "R": 1.09, "R_probe": 1.11},
            {"model": "Tool Hang", "gp": "adamw", "f_label": "cap 10, b", "f": 0.3, "R": 1.3, "R_probe": 1.19},
            {"model": "Tool Hang", "gp": "adamw", "f_label": "target", "f": 0.15, "R": 1.0, "R_probe": 1.0}]
    lines = refresh_cost.target_checks(policy, proj)
    assert len(lines) == 3
    assert lines[0].startswith("transformer drift cap 10: R = 1.120 at f = 0.300 (b)") and "FAIL" in lines[0]
    assert "SiT-S/2" in lines[1] and "R_proj = 1.110" in lines[1] and "FAIL" in lines[1]
    assert "Tool Hang" in lines[2] and "R_proj = 1.190" in lines[2] and "PASS" in lines[2]


def test_a_drift_row_files_partial_refresh_steps_apart():
    import torch

    torch.set_num_threads(1)
    row = refresh_cost.DriftRow("mlp", "adamw", 4, "cpu", options={"refresh_policy": "drift", "drift_threshold": 0.01})
    try:
        assert row.label == "dopr_adamw k=4 drift"
        for _ in range(12):
            before = row.opt.stats()
            sizes = len(row.refresh), len(row.other), len(row.partial)
            row.step()
            after = row.opt.stats()
            grew = [a - b for a, b in zip((len(row.refresh), len(row.other), len(row.partial)), sizes)]
            full = after["refreshes"] > before["refreshes"]
            some = after["factorizations"] > before["factorizations"]
            assert grew == ([1, 0, 0] if full else [0, 0, 1] if some else [0, 1, 0])
        assert len(row.refresh) == 3 and row.partial and row.other   # the cap every 4th step; 0.01 fires between
    finally:
        row.opt.close()
