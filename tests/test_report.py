"""experiments.report: where the tables go. The committed results/ are replaced only on request and
never from debug runs; a debug report says so; unfinished jobs are counted."""
import pytest
from omegaconf import OmegaConf

from experiments.common import report
from experiments.common.launch import run_job
from experiments.common.provenance import ROOT


@pytest.fixture
def debug_sweep(tmp_path, compose):
    sweep = tmp_path / "sweep"
    for i, optim in enumerate(("sgd", "dopr_sgd")):
        cfg = compose("task=feature_learning", f"optim={optim}", "debug=default")
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, job / ".hydra" / "config.yaml")      # as Hydra writes it before the job
        run_job(cfg, job)
    (sweep / "2" / ".hydra").mkdir(parents=True)                  # a job that never finished
    return sweep


def test_the_report_goes_beside_the_sweep_and_says_it_is_from_debug_runs(debug_sweep, capsys):
    report.main([str(debug_sweep)])
    md = (debug_sweep / "report" / "feature_learning" / "feature_learning.md").read_text()
    assert "2 of them debug runs" in md
    assert "1 unfinished job(s) (no summary.json) left out" in capsys.readouterr().err


def test_the_committed_results_are_refused_without_the_flag_and_always_for_debug_runs(debug_sweep):
    before = {p: p.read_bytes() for p in (ROOT / "results" / "feature_learning").rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match="debug runs"):
        report.main([str(debug_sweep), "--out", str(ROOT / "results"), "--replace-results"])
    with pytest.raises(SystemExit, match="debug runs"):
        report.main([str(debug_sweep), "--out", "results"])
    assert {p: p.read_bytes() for p in (ROOT / "results" / "feature_learning").rglob("*") if p.is_file()} == before


def test_full_runs_need_the_flag_to_replace_the_committed_tables(debug_sweep, tmp_path):
    records = [r for r in report.load_records([debug_sweep])]
    for r in records:
        r["config"].debug_run = False
    with pytest.raises(SystemExit, match="pass --replace-results"):
        report.output_root(str(ROOT / "results"), [debug_sweep], records, replace_results=False)
    assert report.output_root(str(ROOT / "results"), [debug_sweep], records, True) == ROOT / "results"
    assert report.output_root(None, [debug_sweep], records, False) == debug_sweep / "report"


def test_the_stamp_names_paths_inside_the_repository():
    assert report._in_repo(str(ROOT / "multirun" / "x")) == "multirun/x"
    assert report._in_repo("/elsewhere/sweep") == "/elsewhere/sweep"
