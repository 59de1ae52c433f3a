"""The tuning protocol every CPU analogue follows, so that DoPr and its gradient preconditioner (GP)
get the same budget and no reported seed took part in the choice.

1. Tune: per task, one sweep per arm over the SAME number of settings on the tuning seeds (the GP's
   grid may span learning rate x weight decay where DoPr's spans learning rate x damping or EMA).
2. Select (`select`): per arm, the setting with the best mean of the task's validation metric
   (`task.tuning.metric`, `task.tuning.mode`) over the tuning seeds; a non-finite value is the worst.
   Refused when a GP and its DoPr variant had unequal trial counts, or a setting is missing a seed.
   Writes selection.json / selection.md (seeds, grid, every trial, each arm's winner) and one tuned
   config per arm, plus `dopr_<gp>_at_gp_lr`: DoPr's winner at the GP's chosen learning rate, the
   paper's operating guideline ("swap the optimizer to DoPr, maintaining the same learning rate").
3. Re-run the winners on fresh seeds (at least 3; 5 where a job is under 5 minutes):
   `python run.py -m "+tuned/<group>=glob(*)" seed=<fresh seeds>` (the task's protocol sweep; the
   at-GP-rate config is not written when DoPr's winner already runs at the GP's rate).
4. Report (`report`): per arm, per-seed min / median / max and mean +- standard error of the task's
   metrics on the fresh seeds only; refused if a fresh seed was also a tuning seed.

    python -m experiments.common.tuning select multirun/<tune gp> multirun/<tune dopr> \
        --configs conf/tuned/<group> --out results/<task>/protocol
    python -m experiments.common.tuning report multirun/<fresh> \
        --selection results/<task>/protocol/selection.json --out results/<task>/protocol
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import yaml
from omegaconf import OmegaConf

from .report import load_records, make_stamp, write_table

# overrides that say where or how a job ran, not what it trained: never part of a setting
_NOT_A_SETTING = ("seed", "sweep", "launcher", "skip_finished", "resume", "hydra.", "logger", "device", "threads")


def _parse(override: str) -> tuple:
    key, _, value = override.partition("=")
    return key, value


def _is_setting(key: str) -> bool:
    bare = key.lstrip("+~")
    return not any(bare == k or bare.startswith(k) for k in _NOT_A_SETTING)


def _value(text: str):
    """An override's value as Hydra reads it: a number, else YAML (lists, booleans, null), else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return str(a) == str(b)


def _arm_jobs(records: list) -> dict:
    """{arm (summary['optim']): [(settings dict, seed, summary)]}, the settings being the job's
    command-line overrides that are neither its seed nor where it ran."""
    arms: dict = {}
    for r in records:
        s = r["summary"]
        over = dict(_parse(o) for o in s.get("overrides", []) if _is_setting(_parse(o)[0]))
        arms.setdefault(s["optim"], []).append((over, s["seed"], s))
    return arms


def _score(value, mode: str) -> float:
    v = float(value) if value is not None else float("nan")
    if not math.isfinite(v):
        return math.inf
    return v if mode == "min" else -v


def select(records: list, metric: str, mode: str = "min", allow_unequal: bool = False) -> dict:
    """Each arm's best setting on the tuning seeds (see the module doc)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    arms = {}
    for arm, jobs in sorted(_arm_jobs(records).items()):
        keys = sorted({k for over, _, _ in jobs for k in over})
        varying = [k for k in keys if len({over.get(k) for over, _, _ in jobs}) > 1]
        base = {k: jobs[0][0][k] for k in keys if k not in varying}
        trials: dict = {}
        for over, seed, s in jobs:
            if metric not in s:
                raise ValueError(f"{arm}: summary.json of seed {seed} has no {metric!r} (has {sorted(s)[:12]}...)")
            trials.setdefault(tuple(over.get(k) for k in varying), {})[seed] = s[metric]
        seeds = sorted({seed for _, seed, _ in jobs})
        for setting, by_seed in trials.items():
            if sorted(by_seed) != seeds:
                raise ValueError(f"{arm}: setting {dict(zip(varying, setting))} ran seeds {sorted(by_seed)}, the "
                                 f"others {seeds}: finish the tuning sweep (skip_finished=true) before selecting")
        rows = [{"setting": dict(zip(varying, setting)), "value": float(np.mean([float(v) for v in by_seed.values()])),
                 "per_seed": {str(k): float(v) for k, v in sorted(by_seed.items())}} for setting, by_seed in trials.items()]
        rows.sort(key=lambda t: _score(t["value"], mode))
        order = lambda v: (float(_value(v)) if isinstance(_value(v), (int, float)) else math.inf, str(v))
        grid = {k: sorted({over[k] for over, _, _ in jobs if k in over}, key=order) for k in varying}
        edge = [k for k, values in grid.items() if len(values) > 2 and isinstance(_value(values[0]), (int, float))
                and rows[0]["setting"][k] in (values[0], values[-1])]
        arms[arm] = {"base": base, "grid": grid, "seeds": seeds, "trials": rows, "winner": rows[0]["setting"],
                     "value": rows[0]["value"], "at_grid_edge": edge}
    pairs = [(arm.removeprefix("dopr_"), arm) for arm in arms if arm.startswith("dopr_") and arm[5:] in arms]
    if not pairs:
        raise ValueError(f"no GP with its DoPr variant among the arms {sorted(arms)}: nothing to compare")
    for gp, dopr in pairs:
        n_gp, n_dopr = len(arms[gp]["trials"]), len(arms[dopr]["trials"])
        if n_gp != n_dopr and not allow_unequal:
            raise ValueError(f"unequal tuning budgets: {gp} had {n_gp} settings, {dopr} {n_dopr}; the protocol gives "
                             "both arms the same number (or pass --allow-unequal and say so in the results)")
    seeds = sorted({s for a in arms.values() for s in a["seeds"]})
    return {"metric": metric, "mode": mode, "seeds": seeds, "arms": arms, "pairs": pairs}


def _lr_key(settings: dict):
    return next((k for k in settings if k.lstrip("+") == "optim.lr"), None)


def chosen_settings(selection: dict) -> dict:
    """{name: overrides} to re-run on fresh seeds: each arm's winner (on its base) and, per pair,
    DoPr's winner at the GP's chosen learning rate (`<dopr>_at_gp_lr`)."""
    out = {arm: {**a["base"], **a["winner"]} for arm, a in selection["arms"].items()}
    for gp, dopr in selection["pairs"]:
        gp_all, key = out[gp], _lr_key(out[gp])
        if key is None:
            continue
        moved = {k: v for k, v in out[dopr].items() if k.lstrip("+") != "optim.lr"}
        out[f"{dopr}_at_gp_lr"] = {**moved, "optim.lr": gp_all[key]}
    return out


def tuned_config(overrides: dict, note: str) -> str:
    """A `+tuned/<group>=<name>` config file holding these overrides: group choices in its defaults
    list (`+tuned/x=y` becomes `/tuned/x@_global_: y`, `optim=y` an override), values as YAML."""
    defaults, values = [], OmegaConf.create()
    for key, value in overrides.items():
        bare = key.lstrip("+~")
        if "/" in bare:
            defaults.append(f"  - /{bare}@_global_: {value}")
        elif bare in ("optim", "task", "model"):
            defaults.append(f"  - override /{bare}: {value}")
        else:
            OmegaConf.update(values, bare, _value(value), force_add=True)
    lines = ["# @package _global_", *(f"# {l}" for l in note.splitlines())]
    if defaults:
        lines += ["defaults:", *defaults]
    if values:
        lines.append(OmegaConf.to_yaml(values).rstrip())
    return "\n".join(lines) + "\n"


def _fmt(settings: dict) -> str:
    return ", ".join(f"{k.lstrip('+')}={v}" for k, v in settings.items()) or "(no knob varied)"


def write_selection(selection: dict, out: Path, stamp: str, configs: Path = None, command: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "selection.json").write_text(json.dumps(selection, indent=1) + "\n")
    rows = [{"arm": arm, "setting": _fmt(t["setting"]), selection["metric"]: t["value"],
             "per_seed": " ".join(f"{v:.4g}" for v in t["per_seed"].values()),
             "chosen": ("yes" + (f" (at the grid's edge in {', '.join(a['at_grid_edge'])}: widen it)"
                                 if a["at_grid_edge"] else "")) if t["setting"] == a["winner"] else ""}
            for arm, a in selection["arms"].items() for t in a["trials"]]
    grids = "; ".join(f"{arm}: " + " x ".join(f"{k.lstrip('+')} in {{{', '.join(v)}}}" for k, v in a["grid"].items())
                      + f" ({len(a['trials'])} settings)" for arm, a in selection["arms"].items())
    title = (f"Tuning: {selection['metric']} ({selection['mode']}, mean over tuning seeds "
             f"{selection['seeds']}) per setting. Grids: {grids}")
    write_table(rows, ["arm", "setting", selection["metric"], "per_seed", "chosen"], out / "selection", stamp, title)
    if configs is not None:
        configs.mkdir(parents=True, exist_ok=True)
        chosen = chosen_settings(selection)
        for stale in configs.glob("*.yaml"):  # an earlier selection's files: the protocol sweep globs the folder
            if stale.stem not in chosen and "chosen by the tuning protocol" in stale.read_text():
                stale.unlink()
        for name, overrides in chosen.items():
            twin = name.removesuffix("_at_gp_lr")
            if name != twin and _same_settings(overrides, chosen[twin]):
                (configs / f"{name}.yaml").unlink(missing_ok=True)  # DoPr chose the GP's rate: nothing new to run
                continue
            note = (f"{name}: chosen by the tuning protocol (experiments/common/tuning.py) on seeds "
                    f"{selection['seeds']} by {selection['metric']} ({selection['mode']}); see {out / 'selection.md'}\n"
                    f"made by: {command}")
            if name.endswith("_at_gp_lr"):
                note += "\nDoPr's winner at the GP's chosen learning rate (the paper's 'same learning rate' guideline)"
            (configs / f"{name}.yaml").write_text(tuned_config(overrides, note))


def _same_settings(a: dict, b: dict) -> bool:
    norm = lambda d: {k.lstrip("+"): v for k, v in d.items()}
    a, b = norm(a), norm(b)
    return a.keys() == b.keys() and all(_same(_value(a[k]), _value(b[k])) for k in a)


def _matches(record: dict, overrides: dict) -> bool:
    cfg = record["config"]
    for key, value in overrides.items():
        bare = key.lstrip("+~")
        if "/" in bare:
            continue  # a group choice: its values are checked through the keys below
        if bare in ("optim", "task"):
            if str(OmegaConf.select(cfg, f"{bare}.name")) != value:
                return False
        elif not _same(OmegaConf.select(cfg, bare), _value(value)):
            return False
    return True


def report(records: list, selection: dict, metrics: list) -> list:
    """Rows of the fresh-seed results: per chosen setting, each metric's min / median / max and mean
    +- standard error over the seeds."""
    tuning = set(selection["seeds"])
    reused = sorted({r["summary"]["seed"] for r in records} & tuning)
    if reused:
        raise ValueError(f"seeds {reused} were tuning seeds: report only fresh seeds (the protocol re-runs the "
                         "winners on seeds the selection never saw)")
    rows = []
    for name, overrides in chosen_settings(selection).items():
        arm = name.removesuffix("_at_gp_lr")
        runs = {}  # one run per seed: when DoPr's winner is at the GP's rate, two names launch the same setting
        for r in sorted((r for r in records if r["summary"]["optim"] == arm and _matches(r, overrides)),
                        key=lambda r: not any(o.endswith(f"={name}") for o in r["summary"].get("overrides", []))):
            runs.setdefault(r["summary"]["seed"], r)
        runs = list(runs.values())
        row = {"arm": name, "setting": _fmt({k: v for k, v in overrides.items() if "/" not in k}),
               "seeds": " ".join(str(s) for s in sorted(r["summary"]["seed"] for r in runs))}
        diverged = sum(1 for r in runs if r["summary"].get("diverged_at") is not None)
        if diverged:
            row["diverged"] = diverged
        for m in metrics:
            # a run that diverged has no value of the selection metric: it counts as the worst
            worst = (math.inf if selection["mode"] == "min" else -math.inf) if m == selection["metric"] else math.nan
            v = np.array([worst if r["summary"][m] is None else float(r["summary"][m])
                          for r in runs if m in r["summary"]])
            if v.size:
                row.update({f"{m}_min": float(v.min()), f"{m}_median": float(np.median(v)), f"{m}_max": float(v.max()),
                            f"{m}_mean": float(v.mean()),
                            f"{m}_se": float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 and np.isfinite(v).all() else float("nan")})
        rows.append(row)
    return rows


def _task_tuning(records: list) -> dict:
    cfg = records[0]["config"]
    t = OmegaConf.select(cfg, "task.tuning") if cfg is not None else None
    if t is None:
        raise SystemExit(f"task {records[0]['summary']['task']} has no task.tuning (metric, mode, report) in its "
                         "config: pass --metric")
    return OmegaConf.to_container(t)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["select", "report"])
    p.add_argument("sweeps", nargs="+", help="the tuning sweeps (select) or the fresh-seed sweeps (report)")
    p.add_argument("--out", required=True, help="where selection.* / protocol.* go")
    p.add_argument("--metric", help="default: the task's task.tuning.metric")
    p.add_argument("--mode", choices=["min", "max"], help="default: the task's task.tuning.mode")
    p.add_argument("--configs", help="select: write one tuned config per arm into this conf/tuned/<group> folder")
    p.add_argument("--selection", help="report: the selection.json that chose the settings")
    p.add_argument("--allow-unequal", action="store_true", help="select: accept unequal trial counts per pair")
    args = p.parse_args(argv)
    records = load_records(args.sweeps)
    if not records:
        raise SystemExit(f"no finished job (summary.json) under {args.sweeps}")
    command = "python -m experiments.common.tuning " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    stamp = make_stamp(records, command)
    out = Path(args.out)
    try:
        if args.action == "select":
            task = _task_tuning(records) if not (args.metric and args.mode) else {}
            sel = select(records, args.metric or task["metric"], args.mode or task["mode"], args.allow_unequal)
            write_selection(sel, out, stamp, Path(args.configs) if args.configs else None, command)
            for arm, a in sel["arms"].items():
                edge = f"; at the grid's edge in {a['at_grid_edge']}" if a["at_grid_edge"] else ""
                print(f"{arm}: {len(a['trials'])} settings, chosen {_fmt(a['winner'])} ({sel['metric']} {a['value']:.4g}){edge}")
        else:
            if not args.selection:
                raise SystemExit("report needs --selection <selection.json>")
            sel = json.loads(Path(args.selection).read_text())
            metrics = _task_tuning(records).get("report", [sel["metric"]])
            rows = report(records, sel, metrics)
            cols = ["arm", "setting", "seeds"] + [f"{m}_{s}" for m in metrics
                                                  for s in ("min", "median", "max", "mean", "se")]
            write_table(rows, cols, out / "protocol", stamp,
                        f"Fresh seeds, each arm at its setting chosen on seeds {sel['seeds']} by {sel['metric']} "
                        f"({sel['mode']}); {{metric}}_min/median/max over seeds, mean and standard error")
            for r in rows:
                print(r["arm"], r["seeds"], {m: r.get(f"{m}_median") for m in metrics})
    except ValueError as e:
        raise SystemExit(f"refused: {e}")


if __name__ == "__main__":
    main()
