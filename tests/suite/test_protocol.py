"""The protocol presets (conf/protocol/<task>.yaml) and their one command per stage
(experiments/common/protocol.py): every preset composes, each keeps the grids its committed selections
recorded, the dry run is the job set, and a tiny protocol runs tune -> select -> protocol -> report."""
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from experiments.common import protocol

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "conf" / "protocol").glob("*.yaml"))
#: committed selections that no preset reproduces: older runs of a protocol whose preset is the newer one
#: (sft_arith's 1-epoch tune, superseded by results/sft_arith/protocol; the Muon pair on the old Muon split, superseded
#: by its rerun after issue 46, results/sit_digits/muon_protocol_46, the claims' table)
HISTORICAL = {"results/sft_arith/protocol_epochs1", "results/sit_digits/muon_protocol"}


def _protocols():
    """(task, variant, resolved spec) of every preset and every variant."""
    out = []
    for path in PRESETS:
        preset = protocol.load(path.stem)
        out += [(path.stem, v, protocol.resolve(preset, v)) for v in [None, *(preset.get("variants") or {})]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("task", [p.stem for p in PRESETS])
def test_every_preset_and_variant_composes_and_names_real_config_keys(task):
    pytest.importorskip("hydra")
    for _, _, spec in (p for p in _protocols() if p[0] == task):
        assert spec["task"] == task and spec["arms"], spec
        protocol.check(spec)   # raises naming the arm and the key that is not a config key


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return str(text)


def test_the_presets_keep_the_grids_and_fixed_values_their_committed_selections_recorded():
    covered = set()
    for task, variant, spec in _protocols():
        sel_path = ROOT / spec["results"] / "selection.json"
        if not sel_path.is_file():
            continue
        covered.add(spec["results"])
        sel = json.loads(sel_path.read_text())
        assert set(sel["arms"]) == set(spec["arms"]), (task, variant)
        assert sel["seeds"] == spec["tuning_seeds"] and sel["fresh_seeds"] == spec["fresh_seeds"], (task, variant)
        for arm, recorded in sel["arms"].items():
            mine = spec["arms"][arm]
            grid = {k.lstrip("+"): [_number(v) for v in vs] for k, vs in recorded["grid"].items()}
            assert grid == {k: sorted(_number(v) for v in vs) for k, vs in mine["grid"].items()}, (task, variant, arm)
            fixed = {"task": spec["task"], f"tuned/{spec['tuned']}": mine["preset"], **mine["overrides"]}   # the tool names task=
            for key, value in recorded["base"].items():   # every value the committed tune fixed, fixed alike
                assert key.lstrip("+") in fixed and _number(fixed[key.lstrip("+")]) == _number(value), (
                    task, variant, arm, key, value, fixed)
        report = ROOT / spec["results"] / "protocol.md"   # its report's verdicts beyond each GP / DoPr pair
        if report.is_file():
            stamp = next(l for l in report.read_text().splitlines() if "Tables by `" in l)
            assert re.findall(r"--versus (\S+?)[ `]", stamp) == spec.get("versus", []), (task, variant)
    committed = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "results").rglob("selection.json")}
    assert committed - covered == HISTORICAL


def _jobs(line: str) -> int:
    """The number of jobs one `run.py -m` line launches: the product of its swept values."""
    return math.prod(len(t.split("=", 1)[1].split(",")) for t in shlex.split(line)
                     if "=" in t and not t.startswith("hydra."))


def _commands(out: str) -> list:
    """A dry run's command lines (its summary lines start with `# `)."""
    return [l for l in out.splitlines() if not l.startswith("#")]


def test_the_dry_run_of_a_tune_is_each_arms_grid_on_the_tuning_seeds(capsys, tmp_path):
    pytest.importorskip("hydra")
    protocol.main(["tune", "feature_learning", "--dry-run", "--root", str(tmp_path), "launcher=local_parallel"])
    out = capsys.readouterr().out
    lines = _commands(out)
    spec = protocol.resolve(protocol.load("feature_learning"))
    expected = sum(math.prod(len(v) for v in a["grid"].values()) for a in spec["arms"].values()) * len(spec["tuning_seeds"])
    assert len(lines) == len(spec["arms"]) and sum(_jobs(l) for l in lines) == expected == 60
    assert f"# jobs: {expected} (" in out
    for line, arm in zip(lines, spec["arms"]):
        assert line.startswith(f"python run.py -m task=feature_learning +tuned/feature_learning={arm} ")
        assert "skip_finished=true" in line.split() and line.endswith(" launcher=local_parallel")
        assert f"hydra.sweep.dir={tmp_path}/multirun/protocol/feature_learning/tune/{arm}" in line.split()
    assert not (tmp_path / "multirun").exists()   # a dry run launches nothing


def test_an_arm_a_variant_leaves_alone_tunes_in_the_tasks_folder(capsys, tmp_path):
    pytest.importorskip("hydra")
    protocol.main(["tune", "feature_learning", "--variant", "weak25", "--dry-run", "--root", str(tmp_path)])
    dirs = {l.split(" +tuned/feature_learning=")[1].split()[0]: l.split("hydra.sweep.dir=")[1].split()[0]
            for l in _commands(capsys.readouterr().out)}
    assert dirs["adamw"].endswith("protocol/feature_learning/tune/adamw")
    assert dirs["dopr_adamw"].endswith("protocol/feature_learning/weak25/tune/dopr_adamw")


def _preset_jobs(task: str, stage: str) -> dict:
    """{arm: jobs} of a stage, from the preset's YAML as written (not through protocol.resolve): a tune line runs
    every combination of the grid's values on every tuning seed; a protocol line, per selected config, the fresh
    seeds (times any fresh axis's values)."""
    raw = yaml.safe_load((ROOT / "conf" / "protocol" / f"{task}.yaml").read_text())
    arms = raw["arms"] if isinstance(raw["arms"], list) else list(raw["arms"])
    if stage == "tune":
        out = {}
        for arm in arms:
            own = raw.get("dopr_grid" if arm.startswith("dopr_") else "gp_grid") or {}
            out[arm] = math.prod(len(v) for v in {**raw.get("grid", {}), **own}.values()) * len(raw["tuning_seeds"])
        return out
    assert not raw.get("fresh_axes")
    out = {}
    for config in (ROOT / "conf" / "tuned" / raw["configs"]).glob("*.yaml"):
        arm = config.stem.removesuffix("_at_gp_setting")
        out[arm] = out.get(arm, 0) + len(raw["fresh_seeds"])
    return out


def test_the_dry_run_prints_the_number_of_jobs_the_stage_launches(capsys, tmp_path):
    """Humanoid's tune is 4 arms x 6 rates x 2 (weight decay or damping) on one seed: 48 jobs; its protocol stage
    the 6 committed selected configs on 5 fresh seeds: 30. The printed count is each line's sweep's."""
    pytest.importorskip("hydra")
    for stage, root, total in (("tune", tmp_path, 48), ("protocol", ROOT, 30)):
        protocol.main([stage, "humanoid", "--dry-run", "--root", str(root)])
        out = capsys.readouterr().out
        per_arm = _preset_jobs("humanoid", stage)
        assert sum(per_arm.values()) == sum(_jobs(l) for l in _commands(out)) == total, (stage, per_arm)
        jobs = next(l for l in out.splitlines() if l.startswith("# jobs: "))
        assert jobs.startswith(f"# jobs: {total} (") and all(f"{arm} {n}" in jobs for arm, n in per_arm.items()), jobs


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_every_stages_dry_run_says_jobs_time_and_folders_and_writes_nothing(capsys, tmp_path):
    """On an empty root, before any stage ran: each stage's dry run exits 0 with its command lines, the jobs, the
    time and the folders it writes (select and report: their committed folders); no file appears or changes."""
    pytest.importorskip("hydra")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "keep.md").write_text("unchanged\n")
    before, git = _tree(tmp_path), ["git", "-C", str(ROOT), "status", "--porcelain", "--", "results", "conf"]
    status = subprocess.run(git, capture_output=True, text=True).stdout
    results = tmp_path / "results" / "peers" / "humanoid"
    configs = tmp_path / "conf" / "tuned" / "humanoid_peers_protocol"
    for stage in protocol.STAGES:
        protocol.main([stage, "humanoid", "--dry-run", "--root", str(tmp_path)])   # returns: exit status 0
        out = capsys.readouterr().out
        assert (_commands(out) or stage == "refine") and all(l.startswith("python ") for l in _commands(out)), out
        assert re.search(r"^# jobs: \d+", out, re.M) and re.search(r"^# time: ", out, re.M), out
        assert "# a dry run: nothing ran, nothing was written" in out
        if stage == "refine":   # its points come from the tune's winners; humanoid's grids have no wide gap
            assert "# not run yet: " in out and "nothing to refine whatever wins" in out, out
        elif stage in ("select", "report"):
            writes = next(l for l in out.splitlines() if l.startswith("# writes, committed: "))
            assert "# jobs: 0 (" in out and f"{results}/ (" in writes
            assert (f"{configs}/ (" in writes) == (stage == "select"), writes
            assert "# not run yet: " in out          # the stage before it has not run: shown, not refused
        else:
            assert f"# writes: the sweep folders {tmp_path}/multirun/protocol/humanoid/{stage}/" in out, out
    assert _tree(tmp_path) == before
    assert subprocess.run(git, capture_output=True, text=True).stdout == status


def _median(values: list) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def test_the_dry_runs_time_is_the_median_committed_run_time_and_names_its_files(capsys, tmp_path):
    """sit_mnist's tune: each arm's median `wall_time_s` over the committed summary.json files of the task and
    arm, their folders named; a task with no committed run time says so."""
    pytest.importorskip("hydra")
    protocol.main(["tune", "sit_mnist", "--dry-run", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    times = {}
    for path in (ROOT / "results").rglob("summary.json"):
        s = json.loads(path.read_text())
        if s.get("task") == "sit_mnist":
            times.setdefault(s["optim"], []).append((s["wall_time_s"], path))
    assert set(times) == {"adamw", "dopr_adamw"}
    raw = yaml.safe_load((ROOT / "conf" / "protocol" / "sit_mnist.yaml").read_text())
    jobs = len(raw["grid"]["optim.lr"]) * len(raw["tuning_seeds"])
    total = sum(jobs * _median([t for t, _ in v]) for v in times.values())
    assert f"# time: about {total / 3600:.1f} h of job time" in out, out
    for arm, v in times.items():
        assert f"{arm} {_median([t for t, _ in v]) / 60:.0f} min (median of {len(v)} committed jobs)" in out, out
        for _, path in v:
            assert str(path.parent.parent.relative_to(ROOT)) + "/*/summary.json" in out, out
    protocol.main(["tune", "feature_learning", "--dry-run", "--root", str(tmp_path)])
    assert "# time: no committed run time of feature_learning for " in capsys.readouterr().out


def test_a_timing_table_counts_its_median_once_per_job(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "toy_timing.csv").write_text("optimizer,jobs,wall_s_median\nadamw,3,10.0\nsgd,1,99\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "summary.json").write_text(json.dumps({"task": "toy", "optim": "adamw", "wall_time_s": 40.0}))
    (tmp_path / "b" / "toy.csv").write_text("optimizer,wall_time_s\nadamw,41\n")
    times = protocol.committed_times("toy", tmp_path)
    assert sorted(v for v, n, _ in times["adamw"] for _ in range(n)) == [10.0, 10.0, 10.0, 40.0, 41.0]
    spec = {"task": "toy"}
    lines = protocol.summary("tune", spec, {"lines": [([], "adamw", 2), ([], "muon", 1)], "writes": [], "notes": []},
                             tmp_path)
    assert "# jobs: 3 (adamw 2, muon 1) in 2 run.py sweeps" in lines
    assert any(l.startswith("# time: about 20 s of job time") and "muon: no committed run time" in l for l in lines)


def _fails(args, match):
    res = subprocess.run([sys.executable, "-m", "experiments.common.protocol", *args], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and match in res.stderr, res.stderr
    return res.stderr


def test_a_bad_task_variant_arm_or_axis_is_refused_in_one_line_naming_it(tmp_path):
    _fails(["tune", "feature_learning", "--variant", "weak99", "--dry-run"], "feature_learning has no variant 'weak99'")
    _fails(["tune", "feature_learnin", "--dry-run"], "no protocol preset for task 'feature_learnin'")
    _fails(["tune", "sit_digits", "--arms", "adamw,sgd", "--dry-run"], "--arms: no arm 'sgd' in sit_digits")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"task": "feature_learning", "tuned": "feature_learning", "arms": ["sgd"],
                                   "grid": {"optim.lrr": [1e-3]}, "tuning_seeds": [0], "fresh_seeds": [1]}))
    _fails(["tune", str(bad), "--dry-run"], "feature_learning arm sgd: optim.lrr is not a config key")
    bad.write_text(yaml.safe_dump({"task": "feature_learning", "tuned": "feature_learning", "arms": ["sgd"],
                                   "grids": {}}))
    _fails(["tune", str(bad), "--dry-run"], "unknown key 'grids'")
    # the fresh seeds before any selection: nothing to run, and the stage to run first named (a dry run shows them)
    _fails(["protocol", "sit_digits", "--root", str(tmp_path)],
           f"{tmp_path}/conf/tuned/sit_digits_protocol holds no selected config of the arms adamw, dopr_adamw: run "
           "select first")


def _stage(*args):
    res = subprocess.run([sys.executable, "-m", "experiments.common.protocol", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_a_tiny_protocol_runs_tune_select_protocol_report(tmp_path):
    pytest.importorskip("hydra")
    toy = tmp_path / "toy.yaml"
    toy.write_text(yaml.safe_dump({"task": "feature_learning", "tuned": "feature_learning",
                                   "overrides": {"ap.damping_mode": "trace"}, "grid": {"optim.lr": [1e-3, 1e-2]},
                                   "arms": ["sgd", "dopr_sgd"], "tuning_seeds": [0], "fresh_seeds": [1],
                                   "configs": "toy_protocol", "results": "results/toy"}))
    root = ["--root", str(tmp_path), "debug=default"]
    _stage("tune", str(toy), *root)
    tuned = sorted(p.parent.parent.name for p in (tmp_path / "multirun" / "protocol" / "feature_learning" / "tune")
                   .rglob("summary.json"))
    assert tuned == ["dopr_sgd", "dopr_sgd", "sgd", "sgd"]
    _stage("select", str(toy), "--root", str(tmp_path), "--accept-edge", "two rates in a test")
    sel = json.loads((tmp_path / "results" / "toy" / "selection.json").read_text())
    assert sel["fresh_seeds"] == [1] and set(sel["arms"]) == {"sgd", "dopr_sgd"}
    assert "| chosen |" in (tmp_path / "results" / "toy" / "selection.md").read_text()
    chosen = {p.stem for p in (tmp_path / "conf" / "tuned" / "toy_protocol").glob("*.yaml")}
    assert {"sgd", "dopr_sgd"} <= chosen
    _stage("protocol", str(toy), *root)
    fresh = [json.loads(p.read_text()) for p in (tmp_path / "multirun" / "protocol" / "feature_learning" / "protocol")
             .rglob("summary.json")]
    assert sorted(s["seed"] for s in fresh) == [1] * len(chosen)
    assert {s["lr"] for s in fresh if s["optim"] == "sgd"} == {float(sel["arms"]["sgd"]["winner"]["optim.lr"])}
    _stage("report", str(toy), "--root", str(tmp_path))
    md = (tmp_path / "results" / "toy" / "protocol.md").read_text()
    assert "Verdict, dopr_sgd vs sgd by val_loss" in md and "| sgd |" in md


def _fake_sweep(folder: Path, arm: str, values: dict, seed: int = 0):
    """A finished tune or refine sweep of feature_learning as run.py leaves it: per rate a job folder with its
    summary.json (the overrides Hydra records) and .hydra/config.yaml (the task's tuning metric)."""
    for n, (lr, loss) in enumerate(values.items()):
        job = folder / str(n)
        (job / ".hydra").mkdir(parents=True)
        over = ["task=feature_learning", f"+tuned/feature_learning={arm}", "ap.damping_mode=trace", f"optim.lr={lr}",
                f"seed={seed}", "skip_finished=True"]
        (job / "summary.json").write_text(json.dumps({"task": "feature_learning", "optim": arm, "seed": seed,
                                                      "val_loss": loss, "overrides": over}))
        (job / ".hydra" / "config.yaml").write_text("task:\n  name: feature_learning\n  tuning: {metric: val_loss, "
                                                    "mode: min}\n")


def _peers_tuned(root: Path) -> tuple:
    """Fake tune sweeps of feature_learning --variant peers' AdamW and SOAP pairs under root: SOAP's coarse winner
    1e-2 (1e-3 10x below, 3e-2 3x above), the others' within 3.5x of their neighbours. (the sweeps' folder, the
    refinement point of SOAP's winner)"""
    spec = protocol.resolve(protocol.load("feature_learning"), "peers")
    lrs = [protocol.override_text(v) for v in spec["arms"]["soap"]["grid"]["optim.lr"]]
    assert lrs[4:8] == ["0.001", "0.01", "0.03", "0.1"]
    tune = root / "multirun" / "protocol" / "feature_learning"
    for arm, folder, best in (("adamw", tune / "tune", "0.03"), ("dopr_adamw", tune / "tune", "0.03"),
                              ("soap", tune / "peers" / "tune", "0.01"), ("dopr_soap", tune / "peers" / "tune", "0.1")):
        _fake_sweep(folder / arm, arm, {lr: 1.0 if lr == best else 2.0 + i for i, lr in enumerate(lrs)})
    return tune, protocol.override_text(math.sqrt(1e-3 * 1e-2))


def test_the_refine_stages_dry_run_prints_the_midpoints_of_each_coarse_winners_wide_gaps(capsys, tmp_path):
    """feature_learning --variant peers: SOAP's coarse winner 1e-2 has 1e-3 10x below, so the refine stage runs
    sqrt(1e-3 * 1e-2) on the tuning seed in peers/refine/soap; AdamW's 3e-2 (1e-2 3x below, 0.1 3.33x above) and
    DoPr-SOAP's 0.1 need none. The dry run prints that line, the jobs and each arm's word, and writes nothing."""
    tune, point = _peers_tuned(tmp_path)
    before = _tree(tmp_path)
    protocol.main(["refine", "feature_learning", "--variant", "peers", "--dry-run", "--root", str(tmp_path),
                   "--arms", "adamw,dopr_adamw,soap,dopr_soap"])
    out = capsys.readouterr().out
    assert _commands(out) == [
        f"python run.py -m task=feature_learning +tuned/feature_learning=soap ap.damping_mode=trace optim.lr={point} "
        f"seed=0 skip_finished=true 'hydra.searchpath=[file://{tmp_path}/conf]' "
        f"hydra.sweep.dir={tune}/peers/refine/soap"]
    assert "# jobs: 1 (soap 1) in 1 run.py sweep" in out
    assert "# adamw: no refinement: optim.lr=0.03: nearest neighbours within 3.5x (0.01 3x, 0.1 3.33x)" in out
    assert "# dopr_soap: no refinement: optim.lr=0.1: nearest neighbours within 3.5x (0.03 3.33x, 0.3 3x)" in out
    assert "# soap: refine optim.lr=0.01 (its neighbour 0.001 10x away) -> 0.00316" in out
    assert _tree(tmp_path) == before   # a dry run launches nothing
    # before the tune: no line, and which winners would be refined
    protocol.main(["refine", "feature_learning", "--variant", "peers", "--dry-run", "--root", str(tmp_path / "none")])
    out = capsys.readouterr().out
    assert not _commands(out) and "# jobs: 0 (" in out and "at optim.lr in {1e-06, 1e-05, 0.0001, 0.001, 0.01}" in out


@pytest.mark.slow
def test_select_names_the_refine_stage_until_its_runs_are_there_then_takes_them_in(capfd, tmp_path):
    tune, point = _peers_tuned(tmp_path)
    with pytest.raises(SystemExit, match="the select stage stopped"):
        protocol.main(["select", "feature_learning", "--variant", "peers", "--root", str(tmp_path)])
    assert (f"Run it: python -m experiments.common.protocol refine feature_learning --variant peers --root {tmp_path}, "
            "then select again") in capfd.readouterr().err
    _fake_sweep(tune / "peers" / "refine" / "soap", "soap", {point: 0.5})
    protocol.main(["select", "feature_learning", "--variant", "peers", "--root", str(tmp_path)])
    assert f"--refined {tune}/peers/refine/soap --configs" in capfd.readouterr().out
    sel = json.loads((tmp_path / "results" / "peers" / "feature_learning" / "selection.json").read_text())
    assert sel["arms"]["soap"]["winner"] == {"optim.lr": point} and sel["arms"]["soap"]["refinement"]["points"]
    assert sel["arms"]["adamw"]["refinement"]["points"] == [] and sel["arms"]["adamw"]["winner"] == {"optim.lr": "0.03"}
