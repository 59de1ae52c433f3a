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
    assert report.in_repo(str(ROOT / "multirun" / "x")) == "multirun/x"
    assert report.in_repo("/elsewhere/sweep") == "/elsewhere/sweep"


def test_a_long_stamp_sits_under_the_axes_and_is_saved_whole(tmp_path):
    """A stamp naming six sweeps used to be drawn over the lowest axes (text anchored inside the figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    stamp = "Runs made by " + "; ".join(f"`python run.py -m sweep=robomimic_lift_rollouts seed={s} "
                                        f"hydra.sweep.dir=multirun/robomimic_lift_rollouts/pair_s{s}` (2 runs)"
                                        for s in range(6))
    fig, axes = plt.subplots(2, 1, figsize=(5.5, 7))
    for ax in axes:
        ax.plot([0, 1], [0, 1])
    report.stamp_figure(fig, stamp)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    text = fig.texts[-1]
    box = text.get_window_extent(renderer)
    for ax in axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), "the stamp covers an axes"
    assert text.get_text().replace("\n", " ") == stamp.replace("`", "")    # wrapped, nothing dropped
    assert box.x1 <= fig.bbox.x1                                           # no line runs off the right edge
    plt.close(fig)

    heights = []
    for s in ("short", stamp):
        fig, ax = plt.subplots(figsize=(5.5, 3))
        ax.plot([0, 1], [0, 1])
        report.save_figure(fig, tmp_path / "f.png", s)
        heights.append(Image.open(tmp_path / "f.png").size[1])
    assert heights[1] > heights[0] + 6 * 8                                 # the file holds the extra lines


def test_a_missing_sweep_folder_is_one_line(tmp_path):
    # issue 63: `python -m experiments.report <missing path>` raised a FileNotFoundError traceback
    with pytest.raises(SystemExit) as stop:
        report.main([str(tmp_path / "nope"), str(tmp_path)])
    said = str(stop.value)
    assert said.startswith(f"sweep directory not found: {tmp_path / 'nope'} (") and "\n" not in said
    assert "multirun/<sweep>/<time>" in said


def test_a_table_rewritten_from_values_that_differ_beyond_its_digits_is_the_same_file(tmp_path):
    # issue 63: each `make demo` rewrote 17-digit CSVs whose last digits differ from run to run
    rows = [{"optimizer": "dopr_muon", "lr": 1.0, "seeds": 10, "loss": 50487.470703125, "dist": 0.25518977918830105,
             "tiny": 4.697255272881172e-10, "diverged": float("inf")}]
    noisy = [{k: v * (1 + 3e-12) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    files = []
    for i, rs in enumerate((rows, noisy)):
        report.write_table(rs, list(rs[0]), tmp_path / str(i) / "t", "stamp", "title")
        files.append([(tmp_path / str(i) / f"t.{ext}").read_bytes() for ext in ("csv", "md")])
    assert noisy[0]["dist"] != rows[0]["dist"] and files[0] == files[1]
    values = (tmp_path / "0" / "t.csv").read_text().splitlines()[1].split(",")
    assert values == ["dopr_muon", "1.0", "10", "50487.47", "0.2551898", "4.697255e-10", "inf"]


def test_a_commit_of_results_alone_leaves_the_code_revision(tmp_path, monkeypatch):
    """The stamps name git_revision(): the code's commit, so a report regenerated after committing its
    outputs names the same commit and its files read the same."""
    import subprocess

    from experiments.common import provenance

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "."), git("commit", "-qm", "code")
    code = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    assert provenance.git_revision() == code
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "t.csv").write_text("a\n1\n")
    git("add", "."), git("commit", "-qm", "results")
    assert git("rev-parse", "--short", "HEAD") != code and provenance.git_revision() == code
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.git_revision() == code + "-dirty"
    git("commit", "-qam", "more code")
    assert provenance.git_revision() == git("rev-parse", "--short", "HEAD") != code
