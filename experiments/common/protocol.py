"""One command per stage of a task's tuning protocol (experiments/common/tuning.py has its rules), read from
the task's preset conf/protocol/<task>.yaml (data, not a Hydra config group):

    python -m experiments.common.protocol tune feature_learning [--variant weak25] [--arms adamw,dopr_adamw]
    python -m experiments.common.protocol refine feature_learning [--variant weak25]
    python -m experiments.common.protocol select feature_learning [--accept-edge "<reason>"] [--skip-refine "<reason>"]
    python -m experiments.common.protocol protocol feature_learning [launcher=local_parallel]
    python -m experiments.common.protocol report feature_learning [--versus soap:dopr_adamw]

tune: `run.py -m` over each arm's grid on the tuning seeds; refine: `run.py -m` over the refinement points of each
arm's coarse winner (tuning.refinement; the preset's `select: {refine_axes, refine_above}`), nothing where none is due;
select: `tuning select` over the tune and refine sweeps, writing conf/tuned/<configs>/
and <results>/selection.*; protocol: every config select wrote, on the fresh seeds; report: `tuning report`.
Sweeps go to multirun/protocol/<task>[/<variant>]/<stage>/<arm>, every launch with skip_finished=true, so a
stage resumes where it stopped. An arm a variant leaves as the task has it tunes in the task's own folder (its
jobs are shared). `--dry-run` prints the command lines, then (as `# ` lines) how many jobs they launch, about how
long they take (the median committed run time per job of the task and arm, naming the files it read) and the
folders the stage writes, and runs and writes nothing, before the earlier stages ran too. Other arguments pass
through (to Hydra for tune, refine and protocol, to tuning.py for select and report). `--root` puts multirun/,
conf/tuned/ and results/ under another folder (the tests' temporary one).

A study variant (`study: {axis, values, arms}`, `from: <variant>`; docs/protocol.md "A study at the committed
setting") tunes and selects nothing: `protocol` runs the reused selection's configs of those arms at every value of
the axis on the fresh seeds, `report` runs experiments/common/study.py.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from . import tuning
from .arms import AT_GP_SETTING, Arm
from .presets import refuse_hand_written
from .report import load_records
from .tuning import override_text

CHECKOUT = Path(__file__).resolve().parents[2]
PRESETS = CHECKOUT / "conf" / "protocol"
STAGES = ("tune", "refine", "select", "protocol", "report")
#: what a preset (and each of its variants) may say; a variant's dicts merge into the preset's, null drops a key
MERGED = ("overrides", "dopr_overrides", "grid", "gp_grid", "dopr_grid", "select")
KEYS = MERGED + ("arms", "tuning_seeds", "fresh_seeds", "fresh_axes", "configs", "results", "versus", "study", "from")


def load(task: str) -> dict:
    """The preset conf/protocol/<task>.yaml (or a path to one)."""
    path = Path(task) if task.endswith(".yaml") else PRESETS / f"{task}.yaml"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise ValueError(f"no protocol preset for task {task!r} (conf/protocol/ has {have})")
    preset = yaml.safe_load(path.read_text())
    _known(preset, KEYS + ("task", "tuned", "variants"), path.name)
    return {**preset, "name": task}   # how the commands name it (the refine stage's, in select's refusal)


def _known(spec: dict, keys: tuple, where: str) -> None:
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (a preset says {', '.join(keys)})")


def resolve(preset: dict, variant: str = None) -> dict:
    """The protocol one (preset, variant) runs: its keys with the variant's merged in, and per arm
    {preset: its +tuned/<tuned> config, overrides: fixed values, grid: {axis: [values]}}."""
    spec = {k: v for k, v in preset.items() if k != "variants"}
    if variant:
        variants = preset.get("variants") or {}
        if variant not in variants:
            raise ValueError(f"{preset['task']} has no variant {variant!r} (variants: {', '.join(variants) or 'none'})")
        _known(variants[variant], KEYS, f"{preset['task']} variant {variant}")
        for k, v in variants[variant].items():
            spec[k] = {**(spec.get(k) or {}), **v} if k in MERGED else v
        if spec.get("study"):
            return _study(preset, spec, variant)
    arms = spec["arms"]
    arms = {a: {} for a in arms} if isinstance(arms, list) else {a: e or {} for a, e in arms.items()}
    spec["arms"] = {}
    for name, entry in arms.items():
        dopr = Arm.read(name).ap
        grid = {**(spec.get("grid") or {}), **(spec.get("dopr_grid" if dopr else "gp_grid") or {}), **entry.get("grid", {})}
        fixed = {**(spec.get("overrides") or {}), **((spec.get("dopr_overrides") or {}) if dopr else {}),
                 **entry.get("overrides", {})}
        spec["arms"][name] = {"preset": entry.get("preset", name), "overrides": _present(fixed), "grid": _present(grid)}
    suffix = f"_{variant}" if variant else ""
    spec.update(variant=variant, configs=spec.get("configs", f"{spec['task']}_protocol{suffix}"),
                results=spec.get("results", f"results/{spec['task']}/protocol{suffix}"))
    return spec


def _study(preset: dict, spec: dict, variant: str) -> dict:
    """A study variant (`study: {axis, values, arms}`, optionally `from: <variant>`): nothing tuned or selected; its
    arms start from the conf/tuned/ configs of the selection it reuses (the task's own, or the variant `from`
    names), each with the axis as its grid on the fresh seeds; its tables go to its own `results` (default
    results/<task>/<variant>)."""
    where = f"{spec['task']} variant {variant}"
    study = spec["study"]
    _known(study, ("axis", "values", "arms"), f"{where}: study")
    source = spec.get("from")
    if source and (preset.get("variants") or {}).get(source, {}).get("study"):
        raise ValueError(f"{where}: from {source!r}, a study itself: a study reuses a selection")
    reused = resolve(preset, source)
    unknown = [a for a in study["arms"] if a not in reused["arms"]]
    if unknown:
        raise ValueError(f"{where}: study arm {unknown[0]!r} is not an arm of the selection it reuses "
                         f"({reused['results']}: {', '.join(reused['arms'])})")
    shared = _present(spec.get("overrides") or {})
    spec.update(variant=variant, tuned=reused["configs"], configs=reused["configs"], selection=reused["results"],
                results=preset["variants"][variant].get("results", f"results/{spec['task']}/{variant}"),
                arms={a: {"preset": a, "overrides": shared, "grid": {study["axis"]: list(study["values"])}}
                      for a in study["arms"]})
    return spec


def _present(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def check(spec: dict) -> None:
    """Each arm's preset composes with Hydra and every key it fixes or sweeps is a config key."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(CHECKOUT / "conf"), version_base="1.3"):
        for name, arm in spec["arms"].items():
            cfg = compose("config", overrides=[f"task={spec['task']}", f"+tuned/{spec['tuned']}={arm['preset']}"])
            for key in (*arm["overrides"], *arm["grid"]):
                if OmegaConf.select(cfg, key, default=KeyError) is KeyError:
                    raise ValueError(f"{spec['task']} arm {name}: {key} is not a config key "
                                     f"(task={spec['task']} +tuned/{spec['tuned']}={arm['preset']})")


def _values(values) -> str:
    return ",".join(override_text(v) for v in values)


def _where(path: Path) -> str:
    """A path as the commands name it: relative to the checkout (where they run) when inside it."""
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else str(path)


def tune_dir(preset: dict, spec: dict, arm: str, root: Path, stage: str = "tune") -> Path:
    """An arm's tune (or refine) sweep: an arm a variant leaves as the task has it shares the task's folder."""
    base = resolve(preset) if spec["variant"] else spec
    shared = base["arms"].get(arm) == spec["arms"][arm]   # the same jobs as the task's own: its folder
    return root / "multirun" / "protocol" / spec["task"] / ("" if shared else spec["variant"] or "") / stage / arm


def _jobs(grid: dict, axes, seeds: list) -> int:
    """The jobs one `run.py -m` line launches: Hydra's basic sweeper runs every combination of its swept values."""
    return math.prod(len(grid[k]) for k in axes) * len(seeds)


def _expected_chosen(spec: dict, arms: list) -> list:
    """The configs select writes before it ran: each arm's winner, and each DoPr arm at its GP's whole setting
    (dropped where that is DoPr's own winner), as tuning.chosen_settings names them."""
    pairs = [a for a in spec["arms"] if Arm.read(a).ap and Arm.read(a).but(ap=False).name in spec["arms"]]
    names = list(spec["arms"]) + [f"{a}_{AT_GP_SETTING}" for a in pairs]
    return sorted(n for n in names if Arm.read(n).optim in arms)


def plan(stage: str, preset: dict, spec: dict, arms: list, root: Path, extra: list, dry_run: bool = False) -> dict:
    """What one stage runs: {lines: [(argv, `python` first; the arm whose runs it launches, or None; its job
    count)], writes: [(folder, what it holds)], notes: [lines]}. A stage whose earlier stage has not run is
    refused, except in a dry run, which shows the commands that stage would leave (and says so)."""
    run = ["python", "run.py", "-m", f"task={spec['task']}"]
    after = ["skip_finished=true"] + ([f"hydra.searchpath=[file://{root / 'conf'}]"] if root != CHECKOUT else [])
    stage_dir = root / "multirun" / "protocol" / spec["task"] / (spec["variant"] or "") / "protocol"
    configs, results = root / "conf" / "tuned" / spec["configs"], root / spec["results"]
    refuse_hand_written(configs, _expected_chosen(spec, list(spec["arms"])))   # `configs`: not a hand-written group
    notes = []

    def missing(message, instead):
        if not dry_run:
            raise ValueError(message)
        notes.append(f"not run yet: {message}; the lines {instead}")

    if spec.get("study"):
        return _study_plan(stage, spec, arms, root, run, after, stage_dir, extra, missing, notes)
    if stage == "tune":
        check(spec)
        lines = [(run + [*_arm_args(spec, a), *(f"{k}={_values(v)}" for k, v in a["grid"].items()),
                         f"seed={_values(spec['tuning_seeds'])}",
                         *after, f"hydra.sweep.dir={_where(tune_dir(preset, spec, name, root))}", *extra],
                  name, _jobs(a["grid"], a["grid"], spec["tuning_seeds"]))
                 for name, a in spec["arms"].items() if name in arms]
        return {"lines": lines, "writes": [(_where(tune_dir(preset, spec, a, root)), "sweep") for a in arms],
                "notes": notes}
    if stage == "refine":
        return refine_plan(preset, spec, arms, root, (run, after, extra), missing, notes)
    if stage == "select":
        every = [tune_dir(preset, spec, a, root) for a in spec["arms"]]
        dirs = [_where(d) for d in every if d.is_dir()]
        if not dirs:
            missing(f"no tuning runs of {spec['task']} under {_where(root / 'multirun' / 'protocol')}: run the tune "
                    "stage first", "name the folders the tune stage writes")
            dirs = [_where(d) for d in every]
        refined = [_where(d) for d in (tune_dir(preset, spec, a, root, "refine") for a in spec["arms"]) if d.is_dir()]
        how = [f"--{k.replace('_', '-')}={_values(v) if isinstance(v, list) else v}"
               for k, v in (spec.get("select") or {}).items()]
        line = ["python", "-m", "experiments.common.tuning", "select", *dirs,
                *(["--refined", *refined] if refined else []), "--configs", _where(configs), "--out", _where(results),
                "--seeds", _values(spec["fresh_seeds"]), "--refine-command", shlex.join(_stage_command("refine", spec, root)), *how, *extra]
        return {"lines": [(line, None, 0)], "notes": notes, "writes": [
            (_where(configs), "one +tuned config per chosen setting; earlier chosen ones it no longer picks removed"),
            (_where(results), "selection.json, selection.md, selection.csv")]}
    chosen = sorted(p.stem for p in configs.glob("*.yaml") if Arm.read(p.stem).optim in arms)
    if not chosen:
        missing(f"{_where(configs)} holds no selected config of the arms {', '.join(arms)}: run select first",
                "assume select writes each arm's winner and each DoPr arm at its GP's setting (it drops the latter "
                "where it is DoPr's own winner)")
        chosen = _expected_chosen(spec, arms)
    if stage == "protocol":
        shared = [f"{k}={override_text(v)}" for k, v in (spec.get("overrides") or {}).items() if v is not None]
        lines = []
        for name in chosen:
            grid = spec["arms"][name]["grid"] if name in spec["arms"] else {}
            axes = [k for k in spec.get("fresh_axes") or () if k in grid]
            lines.append((run + [f"+tuned/{spec['configs']}={name}", *shared,
                                 *(f"{k}={_values(grid[k])}" for k in axes), f"seed={_values(spec['fresh_seeds'])}", *after,
                                 f"hydra.sweep.dir={_where(stage_dir / name)}", *extra],
                          Arm.read(name).optim, _jobs(grid, axes, spec["fresh_seeds"])))
        return {"lines": lines, "writes": [(_where(stage_dir / n), "sweep") for n in chosen], "notes": notes}
    dirs = [_where(stage_dir / n) for n in chosen if (stage_dir / n).is_dir()]
    if not dirs:
        missing(f"no fresh-seed runs under {_where(stage_dir)}: run the protocol stage first",
                "name the folders the protocol stage writes")
        dirs = [_where(stage_dir / n) for n in chosen]
    versus = [w for pair in spec.get("versus") or () for w in ("--versus", pair)]   # verdicts beyond GP / DoPr
    line = ["python", "-m", "experiments.common.tuning", "report", *dirs, "--selection",
            _where(results / "selection.json"), "--out", _where(results), *versus, *extra]
    return {"lines": [(line, None, 0)], "notes": notes, "writes": [
        (_where(results), "protocol.md, protocol.csv, protocol_runs.csv (each run); protocol_all_seeds.md/.csv "
                          "where seeds beyond the fixed ones ran")]}


def _arm_args(spec: dict, arm: dict) -> list:
    """The overrides that make a job one arm's: its conf/tuned preset and its fixed values."""
    return [f"+tuned/{spec['tuned']}={arm['preset']}", *(f"{k}={override_text(v)}" for k, v in arm["overrides"].items())]


def _stage_command(stage: str, spec: dict, root: Path) -> list:
    """`python -m experiments.common.protocol <stage> <task> [--variant V] [--root R]` for this protocol."""
    return ["python", "-m", "experiments.common.protocol", stage, spec.get("name", spec["task"]),
            *(["--variant", spec["variant"]] if spec["variant"] else []),
            *(["--root", str(root)] if root != CHECKOUT else [])]


def refine_rule(spec: dict) -> tuple:
    """(axes, above): the refinement rule of the preset's `select` (tuning.REFINE_AXES / REFINE_ABOVE by default)."""
    how = spec.get("select") or {}
    return tuple(how.get("refine_axes", tuning.REFINE_AXES)), float(how.get("refine_above", tuning.REFINE_ABOVE))


def refine_plan(preset: dict, spec: dict, arms: list, root: Path, args: tuple, missing, notes: list) -> dict:
    """The refine stage: each arm's coarse winner from its tune sweep and, where tuning.refinement finds it due,
    one `run.py -m` line per refined axis over its points on the tuning seeds, the other winning values fixed,
    into the arm's refine folder (per axis below it when several are refined). args: (the run.py command, the
    arguments after the seeds, the arguments passed through)."""
    (run, after, extra), (axes, above) = args, refine_rule(spec)
    tuned = {a: tune_dir(preset, spec, a, root) for a in arms}
    if not any(d.is_dir() for d in tuned.values()):
        missing(f"no tuning runs of {', '.join(arms)} under {_where(root / 'multirun' / 'protocol')}: run the tune stage "
                "first", f"come from the tune's winners ({could_refine(spec, arms, axes, above)})")
        return {"lines": [], "notes": notes, "writes": [(_where(tune_dir(preset, spec, a, root, 'refine')), "sweep")
                                                        for a in arms]}
    lines, writes = [], []
    for arm, folder in tuned.items():
        coarse = coarse_winner(spec, arm, folder, missing, notes)
        due = tuning.refinement({arm: coarse}, axes, above)[arm] if coarse else None
        if due and not due["points"]:
            notes.append(f"{arm}: no refinement: {due['note']}")
        if not due or not due["points"]:
            continue
        points = {}
        for step in due["steps"]:
            points.setdefault(step["axis"], []).append(step["point"])
        for axis, values in points.items():
            out = tune_dir(preset, spec, arm, root, "refine") / (axis.lstrip("+") if len(points) > 1 else "")
            fixed = [f"{k}={v}" for k, v in coarse["winner"].items() if k != axis]
            lines.append((run + [*_arm_args(spec, spec["arms"][arm]), *fixed, f"{axis}={','.join(values)}",
                                 f"seed={_values(coarse['seeds'])}", *after, f"hydra.sweep.dir={_where(out)}", *extra],
                          arm, len(values) * len(coarse["seeds"])))
            writes.append((_where(out), "sweep"))
        notes.append(f"{arm}: refine {tuning.describe_steps(due['steps'])} (a gap beyond {above:g}x)")
    return {"lines": lines, "notes": notes, "writes": writes}


def coarse_winner(spec: dict, arm: str, folder: Path, missing, notes: list) -> dict:
    """An arm's tuning record (tuning.tune_arms) from its finished tune sweep in `folder`, by the preset's metric
    (else the task's); None, with a note, where there is no sweep or it has not run every setting of the grid."""
    if not folder.is_dir():
        notes.append(f"{arm}: no tune runs under {_where(folder)}: nothing to refine")
        return None
    how, records = spec.get("select") or {}, load_records([folder])
    task = {} if {"metric", "mode"} <= set(how) else tuning.task_tuning(records)
    coarse = next(iter(tuning.tune_arms(records, how.get("metric", task.get("metric")),
                                        how.get("mode", task.get("mode", "min"))).values()))
    grid = spec["arms"][arm]["grid"]
    if len(coarse["trials"]) < _jobs(grid, grid, [0]):   # a winner of part of the grid is no coarse winner
        missing(f"{arm}'s tune under {_where(folder)} ran {len(coarse['trials'])} of its {_jobs(grid, grid, [0])} "
                "settings: finish the tune stage (it resumes) first", "leave it out")
        return None
    return coarse


def could_refine(spec: dict, arms: list, axes: tuple, above: float) -> str:
    """Which winners of each arm's grid the refinement rule would refine (before the tune has run)."""
    say: dict = {}
    for arm in arms:
        for axis, values in spec["arms"][arm]["grid"].items():
            text = [override_text(v) for v in sorted(values)] if axis.lstrip("+") in axes else []
            due = [v for v in text if tuning.refine_steps(axis, text, v, above)[0]]
            if due:
                say.setdefault(f"at {axis.lstrip('+')} in {{{', '.join(due)}}}", []).append(arm)
    return ("refined if it wins " + "; ".join(f"{', '.join(a)}: {w}" for w, a in say.items()) if say else
            f"no grid has a gap beyond {above:g}x beside an inner value: nothing to refine whatever wins")


def _study_plan(stage: str, spec: dict, arms: list, root: Path, run: list, after: list, stage_dir: Path, extra: list,
                missing, notes: list) -> dict:
    """plan() of a study variant: tune and select refused (it reuses a selection); protocol: each arm's committed
    config at every value of the axis on the fresh seeds; report: `experiments.common.study`, its tables."""
    configs, selection = root / "conf" / "tuned" / spec["configs"], root / spec["selection"] / "selection.json"
    if stage in ("tune", "refine", "select"):
        raise ValueError(f"{spec['task']} variant {spec['variant']} is a study at the committed setting: nothing to "
                         f"{stage}, it reuses the selection {_where(selection)} ({_where(configs)}); run its protocol "
                         "stage, then report")
    if stage == "protocol":
        lines = []
        for name in arms:
            if not (configs / f"{name}.yaml").is_file():
                missing(f"{_where(configs)} holds no config of {name}: the selection the study reuses has not run",
                        "assume its select wrote it")
            a = spec["arms"][name]
            lines.append((run + [f"+tuned/{spec['configs']}={name}", *(f"{k}={override_text(v)}" for k, v in a["overrides"].items()),
                                 *(f"{k}={_values(v)}" for k, v in a["grid"].items()),
                                 f"seed={_values(spec['fresh_seeds'])}", *after,
                                 f"hydra.sweep.dir={_where(stage_dir / name)}", *extra],
                          Arm.read(name).optim, _jobs(a["grid"], a["grid"], spec["fresh_seeds"])))
        return {"lines": lines, "writes": [(_where(stage_dir / n), "sweep") for n in arms], "notes": notes}
    if not selection.is_file():
        missing(f"no {_where(selection)}: the selection the study reuses has not run", "name the file select writes")
    dirs = [_where(stage_dir / n) for n in arms if (stage_dir / n).is_dir()]
    if not dirs:
        missing(f"no study runs under {_where(stage_dir)}: run the protocol stage first",
                "name the folders the protocol stage writes")
        dirs = [_where(stage_dir / n) for n in arms]
    study = spec["study"]
    line = ["python", "-m", "experiments.common.study", *dirs, "--selection", _where(selection), "--axis",
            study["axis"], "--values", _values(study["values"]), "--arms", ",".join(arms), "--seeds",
            _values(spec["fresh_seeds"]), "--out", _where(root / spec["results"]), *extra]
    return {"lines": [(line, None, 0)], "notes": notes, "writes": [
        (_where(root / spec["results"]), "study.md, study.csv, study_runs.csv")]}


def committed_times(task: str, results: Path = CHECKOUT / "results") -> dict:
    """{optim: [(seconds, jobs, file)]}: the run times committed under results/ for the task: each job's
    summary.json (`wall_time_s`, its `task` and `optim`), a timing table `<task>_timing.csv` (`wall_s_median` of
    `jobs` jobs per `optimizer`) and a per-run table `<task>.csv` with a `wall_time_s` column."""
    out: dict = {}
    for path in sorted(results.rglob("summary.json")):
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(s, dict) and s.get("task") == task and isinstance(s.get("wall_time_s"), (int, float)):
            out.setdefault(s.get("optim"), []).append((float(s["wall_time_s"]), 1, path))
    for name, seconds, count in ((f"{task}_timing.csv", "wall_s_median", "jobs"), (f"{task}.csv", "wall_time_s", None)):
        for path in sorted(results.rglob(name)):
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    try:
                        value, jobs = float(row[seconds]), int(row[count]) if count else 1
                    except (KeyError, TypeError, ValueError):
                        continue
                    out.setdefault(row.get("optimizer"), []).append((value, jobs, path))
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _sources(records: list) -> str:
    """The files a median read: a sweep's summary.json files as one glob, a table by its name."""
    groups: dict = {}
    for _, jobs, path in records:
        where = _where(path.parent.parent / "*" / path.name) if path.name == "summary.json" else _where(path)
        groups[where] = groups.get(where, 0) + jobs
    return ", ".join(f"{g} ({n})" for g, n in sorted(groups.items()))


def summary(stage: str, spec: dict, planned: dict, results: Path = CHECKOUT / "results") -> list:
    """The `# ` lines a dry run prints after the command lines: the jobs, the time, its sources, the folders."""
    out = [f"# {note}" for note in planned["notes"]]
    launched = [(arm, jobs) for _, arm, jobs in planned["lines"] if arm is not None]
    if not launched and stage == "refine":
        out += ["# jobs: 0 (no refinement to run now: the lines above say why)", "# time: none (no training job)"]
    elif not launched:
        out.append(f"# jobs: 0 (one local command: {'tuning select' if stage == 'select' else 'tuning report'} reads "


                   "the finished jobs' summary.json files; no training job)")
        out.append("# time: seconds (no training job)")
    else:
        per_arm: dict = {}
        for arm, jobs in launched:
            per_arm[arm] = per_arm.get(arm, 0) + jobs
        total = sum(per_arm.values())
        out.append(f"# jobs: {total} ({', '.join(f'{a} {n}' for a, n in per_arm.items())}) in {len(launched)} "
                   f"run.py sweep{'s' * (len(launched) != 1)}")
        times = committed_times(spec["task"], results)
        known, unknown, used, seconds = [], [], [], 0.0
        for arm, n in per_arm.items():
            records = times.get(arm)
            if not records:
                unknown.append(arm)
                continue
            every = [v for v, jobs, _ in records for _ in range(jobs)]
            seconds += n * statistics.median(every)
            known.append(f"{arm} {_duration(statistics.median(every))} (median of {len(every)} committed jobs)")
            used += records
        if known:
            rest = f"; {', '.join(unknown)}: no committed run time, not counted" if unknown else ""
            out.append(f"# time: about {_duration(seconds)} of job time, one job after another (a parallel launcher "
                       f"divides it by its workers){rest}")
            out.append(f"#   a job: {', '.join(known)}, from committed runs of {spec['task']} (their settings and "
                       "machine may differ)")
            tables = any(path.name != "summary.json" for _, _, path in used)
            out.append(f"#   read: {_sources(used)}"
                       + (" (a timing table's median stands for each of its jobs)" if tables else ""))
        else:
            out.append(f"# time: no committed run time of {spec['task']} for {', '.join(unknown)} (results/ holds no "
                       f"summary.json, {spec['task']}_timing.csv or {spec['task']}.csv with a wall time for them)")
    committed = [(w, what) for w, what in planned["writes"] if what != "sweep"]
    sweeps = [w for w, what in planned["writes"] if what == "sweep"]
    if sweeps:
        out.append(f"# writes: the sweep folders {', '.join(sweeps)} (not committed)")
    if committed:
        out.append("# writes, committed: " + "; ".join(f"{w}/ ({what})" for w, what in committed))
    out.append("# a dry run: nothing ran, nothing was written")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("task", help="a preset in conf/protocol/ (e.g. feature_learning), or a path to one")
    p.add_argument("--variant", help="one of the preset's variants (e.g. weak25, peers)")
    p.add_argument("--arms", help="only these arms, comma-separated (e.g. one arm a process)")
    p.add_argument("--dry-run", action="store_true", help="print the command lines, the job count, the time "
                   "estimate and the folders the stage writes; run and write nothing")
    p.add_argument("--root", type=Path, default=CHECKOUT, help="where multirun/, conf/tuned/, results/ go")
    args, extra = p.parse_known_args(argv)
    try:
        preset = load(args.task)
        spec = resolve(preset, args.variant)
        arms = list(spec["arms"]) if args.arms is None else args.arms.split(",")
        unknown = [a for a in arms if a not in spec["arms"]]
        if unknown:
            raise ValueError(f"--arms: no arm {unknown[0]!r} in {spec['task']}"
                             f"{' variant ' + args.variant if args.variant else ''} (arms: {', '.join(spec['arms'])})")
        planned = plan(args.stage, preset, spec, arms, args.root.resolve(), extra, args.dry_run)
    except ValueError as e:
        raise SystemExit(f"protocol: {e}")
    if not args.dry_run and planned["notes"]:   # the refine stage's word on each arm
        print("\n".join(f"# {note}" for note in planned["notes"]), flush=True)
    for line, _, _ in planned["lines"]:
        print(shlex.join(line), flush=True)
        if not args.dry_run and subprocess.run([sys.executable, *line[1:]], cwd=CHECKOUT).returncode:
            raise SystemExit(f"protocol: the {args.stage} stage stopped: this command failed: {shlex.join(line)}")
    if args.dry_run:
        print("\n".join(summary(args.stage, spec, planned)))


if __name__ == "__main__":
    main()
