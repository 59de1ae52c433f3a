"""One command per stage of a task's tuning protocol (experiments/common/tuning.py has its rules), read from
the task's preset conf/protocol/<task>.yaml (data, not a Hydra config group):

    python -m experiments.common.protocol tune feature_learning [--variant weak25] [--arms adamw,dopr_adamw]
    python -m experiments.common.protocol select feature_learning [--accept-edge "<reason>"]
    python -m experiments.common.protocol protocol feature_learning [launcher=local_parallel]
    python -m experiments.common.protocol report feature_learning [--versus soap:dopr_adamw]

tune: `run.py -m` over each arm's grid on the tuning seeds; select: `tuning select`, writing conf/tuned/<configs>/
and <results>/selection.*; protocol: every config select wrote, on the fresh seeds; report: `tuning report`.
Sweeps go to multirun/protocol/<task>[/<variant>]/<stage>/<arm>, every launch with skip_finished=true, so a
stage resumes where it stopped. An arm a variant leaves as the task has it tunes in the task's own folder (its
jobs are shared). `--dry-run` prints the command lines and runs nothing; other arguments pass through (to
Hydra for tune and protocol, to tuning.py for select and report). `--root` puts multirun/, conf/tuned/ and
results/ under another folder (the tests' temporary one).
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from .arms import Arm
from .tuning import _text

CHECKOUT = Path(__file__).resolve().parents[2]
PRESETS = CHECKOUT / "conf" / "protocol"
STAGES = ("tune", "select", "protocol", "report")
#: what a preset (and each of its variants) may say; a variant's dicts merge into the preset's, null drops a key
MERGED = ("overrides", "dopr_overrides", "grid", "gp_grid", "dopr_grid", "select")
KEYS = MERGED + ("arms", "tuning_seeds", "fresh_seeds", "fresh_axes", "configs", "results", "versus")


def load(task: str) -> dict:
    """The preset conf/protocol/<task>.yaml (or a path to one)."""
    path = Path(task) if task.endswith(".yaml") else PRESETS / f"{task}.yaml"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise ValueError(f"no protocol preset for task {task!r} (conf/protocol/ has {have})")
    preset = yaml.safe_load(path.read_text())
    _known(preset, KEYS + ("task", "tuned", "variants"), path.name)
    return preset


def _known(spec: dict, keys: tuple, where: str) -> None:
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (a preset says {', '.join(keys)})")


def resolve(preset: dict, variant: str = None) -> dict:
    """The protocol one (preset, variant) runs: its keys with the variant's merged in, and per arm
    {preset: its conf/tuned/<tuned> config, overrides: fixed values, grid: {axis: [values]}}."""
    spec = {k: v for k, v in preset.items() if k != "variants"}
    if variant:
        variants = preset.get("variants") or {}
        if variant not in variants:
            raise ValueError(f"{preset['task']} has no variant {variant!r} (variants: {', '.join(variants) or 'none'})")
        _known(variants[variant], KEYS, f"{preset['task']} variant {variant}")
        for k, v in variants[variant].items():
            spec[k] = {**(spec.get(k) or {}), **v} if k in MERGED else v
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
    return ",".join(_text(v) for v in values)


def _where(path: Path) -> str:
    """A path as the commands name it: relative to the checkout (where they run) when inside it."""
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else str(path)


def tune_dir(preset: dict, spec: dict, arm: str, root: Path) -> Path:
    base = resolve(preset) if spec["variant"] else spec
    shared = base["arms"].get(arm) == spec["arms"][arm]   # the same jobs as the task's own: its folder
    return root / "multirun" / "protocol" / spec["task"] / ("" if shared else spec["variant"] or "") / "tune" / arm


def commands(stage: str, preset: dict, spec: dict, arms: list, root: Path, extra: list) -> list:
    """The command lines (argv lists, `python` first) one stage runs."""
    run = ["python", "run.py", "-m", f"task={spec['task']}"]
    after = ["skip_finished=true"] + ([f"hydra.searchpath=[file://{root / 'conf'}]"] if root != CHECKOUT else [])
    stage_dir = root / "multirun" / "protocol" / spec["task"] / (spec["variant"] or "") / "protocol"
    configs, results = root / "conf" / "tuned" / spec["configs"], root / spec["results"]
    if stage == "tune":
        check(spec)
        return [run + [f"+tuned/{spec['tuned']}={a['preset']}", *(f"{k}={_text(v)}" for k, v in a["overrides"].items()),
                       *(f"{k}={_values(v)}" for k, v in a["grid"].items()), f"seed={_values(spec['tuning_seeds'])}",
                       *after, f"hydra.sweep.dir={_where(tune_dir(preset, spec, name, root))}", *extra]
                for name, a in spec["arms"].items() if name in arms]
    if stage == "select":
        dirs = [_where(d) for d in (tune_dir(preset, spec, a, root) for a in spec["arms"]) if d.is_dir()]
        if not dirs:
            raise ValueError(f"no tuning runs of {spec['task']} under {_where(root / 'multirun' / 'protocol')}: run "
                             "the tune stage first")
        how = [f"--{k}={v}" for k, v in (spec.get("select") or {}).items()]
        return [["python", "-m", "experiments.common.tuning", "select", *dirs, "--configs", _where(configs), "--out",
                 _where(results), "--seeds", _values(spec["fresh_seeds"]), *how, *extra]]
    chosen = sorted(p.stem for p in configs.glob("*.yaml") if Arm.read(p.stem).optim in arms)
    if not chosen:
        raise ValueError(f"{_where(configs)} holds no selected config of the arms {', '.join(arms)}: run select first")
    if stage == "protocol":
        shared = [f"{k}={_text(v)}" for k, v in (spec.get("overrides") or {}).items() if v is not None]
        return [run + [f"+tuned/{spec['configs']}={name}", *shared,
                       *(f"{k}={_values(spec['arms'][name]['grid'][k])}" for k in spec.get("fresh_axes") or ()
                         if name in spec["arms"] and k in spec["arms"][name]["grid"]),
                       f"seed={_values(spec['fresh_seeds'])}", *after,
                       f"hydra.sweep.dir={_where(stage_dir / name)}", *extra] for name in chosen]
    dirs = [_where(stage_dir / n) for n in chosen if (stage_dir / n).is_dir()]
    if not dirs:
        raise ValueError(f"no fresh-seed runs under {_where(stage_dir)}: run the protocol stage first")
    versus = [w for pair in spec.get("versus") or () for w in ("--versus", pair)]   # verdicts beyond GP / DoPr
    return [["python", "-m", "experiments.common.tuning", "report", *dirs, "--selection",
             _where(results / "selection.json"), "--out", _where(results), *versus, *extra]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("task", help="a preset in conf/protocol/ (e.g. feature_learning), or a path to one")
    p.add_argument("--variant", help="one of the preset's variants (e.g. weak25, peers)")
    p.add_argument("--arms", help="only these arms, comma-separated (e.g. one arm a process)")
    p.add_argument("--dry-run", action="store_true", help="print the command lines, run nothing")
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
        lines = commands(args.stage, preset, spec, arms, args.root.resolve(), extra)
    except ValueError as e:
        raise SystemExit(f"protocol: {e}")
    for line in lines:
        print(shlex.join(line), flush=True)
        if not args.dry_run and subprocess.run([sys.executable, *line[1:]], cwd=CHECKOUT).returncode:
            raise SystemExit(f"protocol: the {args.stage} stage stopped: this command failed: {shlex.join(line)}")


if __name__ == "__main__":
    main()
