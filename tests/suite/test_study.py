"""A study at the committed setting (the `study` variants of conf/protocol/<task>.yaml, experiments/common/study.py):
the protocol stage runs the reused selection's config at every value of the axis on the fresh seeds, tune and select
refuse, and the report's verdict per value against the first follows the protocol's non-overlap rule."""
import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.common import protocol, study

ROOT = Path(__file__).resolve().parents[2]
#: task: (the reused selection's conf/tuned/ group, its results folder, the fresh seeds, overrides every job shares)
STALENESS = {
    "feature_learning": ("feature_learning_protocol", "results/feature_learning/protocol", list(range(1, 11)),
                         ["ap.damping_mode=trace"]),
    "humanoid": ("humanoid_peers_protocol", "results/peers/humanoid", [1, 2, 3, 4, 5], ["task.num_trajectories=20"]),
    "sit_digits": ("sit_digits_protocol", "results/sit_digits/protocol", [3, 4, 5],
                   ["task.steps=4000", "task.fid.every=500"]),
    "conv_digits": ("conv_digits_full_protocol", "results/conv_digits/protocol_full", [3, 4, 5], []),
}
K = [1, 3, 10, 30, 100]


@pytest.mark.parametrize("task", STALENESS)
def test_the_staleness_study_runs_the_committed_config_at_every_k_on_the_fresh_seeds(task, capsys):
    pytest.importorskip("hydra")
    configs, results, seeds, shared = STALENESS[task]
    spec = protocol.resolve(protocol.load(task), "staleness")
    assert spec["selection"] == results and spec["results"] == f"results/staleness/{task}"
    assert json.loads((ROOT / results / "selection.json").read_text())["seeds"] == [0]   # the seeds are fresh
    protocol.main(["protocol", task, "--variant", "staleness", "--dry-run"])
    out = capsys.readouterr().out
    [line] = [l for l in out.splitlines() if not l.startswith("#")]
    words = shlex.split(line)
    assert words[:5] == ["python", "run.py", "-m", f"task={task}", f"+tuned/{configs}=dopr_adamw"], line
    assert (ROOT / "conf" / "tuned" / configs / "dopr_adamw.yaml").is_file()
    assert words[5:5 + len(shared)] == shared, line
    assert f"ap.precond_every={','.join(map(str, K))}" in words and f"seed={','.join(map(str, seeds))}" in words
    assert "skip_finished=true" in words
    assert f"hydra.sweep.dir=multirun/protocol/{task}/staleness/protocol/dopr_adamw" in words
    assert f"# jobs: {len(K) * len(seeds)} (dopr_adamw {len(K) * len(seeds)}) in 1 run.py sweep" in out


def test_the_feature_learning_study_dry_run_prints_50_jobs():
    res = subprocess.run([sys.executable, "-m", "experiments.common.protocol", "protocol", "feature_learning",
                          "--variant", "staleness", "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and "# jobs: 50 (dopr_adamw 50)" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("stage", ["tune", "refine", "select"])
def test_tune_and_select_of_a_study_refuse_naming_the_selection_it_reuses(stage):
    with pytest.raises(SystemExit, match=f"nothing to {stage}, it reuses the selection "
                                         "results/conv_digits/protocol_full/selection.json"):
        protocol.main([stage, "conv_digits", "--variant", "staleness", "--dry-run"])


def test_the_report_stage_of_a_study_runs_the_study_tables(capsys, tmp_path):
    protocol.main(["report", "humanoid", "--variant", "staleness", "--dry-run", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    words = shlex.split(out.splitlines()[0])
    assert words[:4] == ["python", "-m", "experiments.common.study",
                         f"{tmp_path}/multirun/protocol/humanoid/staleness/protocol/dopr_adamw"]
    assert " --selection " + f"{tmp_path}/results/peers/humanoid/selection.json --axis ap.precond_every --values " \
           "1,3,10,30,100 --arms dopr_adamw --seeds 1,2,3,4,5 " + f"--out {tmp_path}/results/staleness/humanoid" in \
           out.splitlines()[0]
    assert f"# writes, committed: {tmp_path}/results/staleness/humanoid/ (study.md, study.csv, study_runs.csv)" in out


def test_a_study_reuses_a_selection_not_another_study_and_only_its_arms(tmp_path):
    preset = protocol.load("conv_digits")
    bad = {**preset, "variants": {**preset["variants"], "again": {"from": "staleness", "study": {
        "axis": "ap.precond_every", "values": [1, 3], "arms": ["dopr_adamw"]}}}}
    with pytest.raises(ValueError, match="from 'staleness', a study itself"):
        protocol.resolve(bad, "again")
    bad["variants"]["again"] = {"study": {"axis": "ap.precond_every", "values": [1, 3], "arms": ["dopr_sgd"]}}
    with pytest.raises(ValueError, match="study arm 'dopr_sgd' is not an arm of the selection it reuses"):
        protocol.resolve(bad, "again")


SELECTION = {"metric": "val_loss", "mode": "min", "seeds": [0], "fresh_seeds": [1, 2, 3],
             "pairs": [["adamw", "dopr_adamw"]],
             "arms": {"adamw": {"base": {"+tuned/feature_learning": "adamw"}, "winner": {"optim.lr": "0.01"}},
                      "dopr_adamw": {"base": {"+tuned/feature_learning": "dopr_adamw"},
                                     "winner": {"optim.lr": "0.03"}}}}
#: k: val_loss per seed 1, 2, 3 (None: the seed did not run)
LOSSES = {1: [1.0, 1.1, 1.2], 3: [1.15, 1.05, 1.25], 10: [2.0, 2.1, 2.2], 30: [0.5, 0.6, 0.7], 100: [0.4, 0.5, None]}


def _runs(root: Path, lr: float = 0.03, shift: float = 0.0) -> None:
    """Fake finished jobs of DoPr-AdamW at each k and seed: summary.json and .hydra/config.yaml, no training."""
    for k, losses in LOSSES.items():
        for seed, loss in zip((1, 2, 3), losses):
            if loss is None:
                continue
            job = root / f"k{k}_s{seed}"
            (job / ".hydra").mkdir(parents=True)
            (job / "summary.json").write_text(json.dumps({
                "task": "feature_learning", "optim": "dopr_adamw", "seed": seed, "val_loss": loss + shift,
                "subspace_distance": loss / 10, "wall_time_s": 2.0,
                "dopr": {"preconditioned": 2000, "factorizations": 2000 // k},
                "overrides": ["+tuned/feature_learning_protocol=dopr_adamw", f"ap.precond_every={k}", f"seed={seed}"]}))
            (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({
                "task": {"name": "feature_learning", "tuning": {"metric": "val_loss", "mode": "min",
                                                                 "report": ["val_loss", "subspace_distance"]}},
                "optim": {"lr": lr}, "ap": {"precond_every": k}, "seed": seed}))


def test_the_verdict_per_k_follows_the_non_overlap_rule(tmp_path):
    _runs(tmp_path / "sweep")
    _runs(tmp_path / "other_rate", lr=0.1, shift=5.0)   # another setting than the committed one: not counted
    from experiments.common.report import load_records
    records = load_records([tmp_path / "other_rate", tmp_path / "sweep"])   # the other setting first
    rows = study.study_rows(records, SELECTION, "dopr_adamw", "ap.precond_every", K, ["val_loss"], [1, 2, 3])
    assert [r["ap.precond_every"] for r in rows] == K
    assert {r["ap.precond_every"]: r["verdict"] for r in rows} == {
        1: "reference", 3: "inconclusive", 10: "worse", 30: "better", 100: "no verdict (partial)"}
    assert rows[1]["val_loss_median"] == 1.15 and rows[2]["val_loss_min"] == 2.0 and rows[4]["missing"] == "3"


def test_the_study_report_writes_a_table_per_arm_and_the_per_seed_csv(tmp_path, capsys):
    _runs(tmp_path / "sweep")
    (tmp_path / "selection.json").write_text(json.dumps(SELECTION))
    out = tmp_path / "results"
    study.main([str(tmp_path / "sweep"), "--selection", str(tmp_path / "selection.json"), "--axis",
                "ap.precond_every", "--values", "1,3,10,30,100", "--arms", "dopr_adamw", "--seeds", "1,2,3",
                "--out", str(out)])
    md = (out / "study.md").read_text()
    assert "## dopr_adamw" in md and "| 10 | 1 2 3 | 2.1 [2-2.2] | 0.21 [0.2-0.22] | worse |" in md, md
    assert "Verdict per value against ap.precond_every=1 by val_loss (lower is better)" in md
    table = list(csv.DictReader(open(out / "study.csv")))
    assert [(r["ap.precond_every"], r["verdict"]) for r in table] == [
        ("1", "reference"), ("3", "inconclusive"), ("10", "worse"), ("30", "better"), ("100", "no verdict (partial)")]
    runs = list(csv.DictReader(open(out / "study_runs.csv")))
    assert list(runs[0]) == ["arm", "ap.precond_every", "seed", "val_loss", "subspace_distance", "refresh_fraction",
                             "wall_time_s"]
    assert len(runs) == 14 and runs[0] == {"arm": "dopr_adamw", "ap.precond_every": "1", "seed": "1",
                                           "val_loss": "1.0", "subspace_distance": "0.1", "refresh_fraction": "1.0",
                                           "wall_time_s": "2.0"}
    # the share of layer-steps that refreshed: the run's factorizations over its preconditioned layer-steps
    assert {r["ap.precond_every"]: r["refresh_fraction"] for r in runs}["10"] == "0.1"


def test_a_study_report_refuses_a_tuning_seed(tmp_path):
    _runs(tmp_path / "sweep")
    (tmp_path / "selection.json").write_text(json.dumps({**SELECTION, "seeds": [2]}))
    with pytest.raises(SystemExit, match=r"seeds \[2\] were tuning seeds"):
        study.main([str(tmp_path / "sweep"), "--selection", str(tmp_path / "selection.json"), "--axis",
                    "ap.precond_every", "--values", "1,3", "--arms", "dopr_adamw", "--out", str(tmp_path / "out")])
