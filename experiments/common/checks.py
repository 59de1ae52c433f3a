"""Checks of a job's configuration made before any work: a mistyped key or an impossible device is
refused with one message that names it, instead of a job that runs with the defaults.

Hydra itself refuses `task.num_trajectorie=5` (no such key) but suggests `+task.num_trajectorie=5`,
which adds a key that no config declares and so nothing reads: the job would run with the default.
Config groups added with `+` (`+tuned/humanoid=dopr_adamw`) are what `+` is for here, and pass.
"""
from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .presets import roots


class ConfigError(ValueError):
    """A configuration mistake: run.py prints its message alone (DOPR_TRACEBACK=1 shows the traceback)."""


def _keys(tree: dict, prefix: str = "") -> list:
    """Every key path of a config (as a container, interpolations unresolved)."""
    out = []
    for k, v in tree.items():
        out.append(f"{prefix}{k}")
        if isinstance(v, dict):
            out += _keys(v, f"{prefix}{k}.")
    return out


def _get(tree: dict, path: str):
    for part in path.split("."):
        tree = tree[part]
    return tree


def refuse_added_keys(cfg: DictConfig, overrides: list, groups: set) -> None:
    """Refuse `+key=value` overrides of keys (not of config groups in `groups`): no config declares
    them, so no task, optimizer or AP option reads them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    added = [o for o in parsed if o.is_add() and o.key_or_group not in groups]
    if not added:
        return
    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    known = [k for k in _keys(tree) if k not in {o.key_or_group for o in added}]
    lines = []
    for o in added:
        close = difflib.get_close_matches(o.key_or_group, known, n=1, cutoff=0.6)
        close = close or difflib.get_close_matches(o.key_or_group.rsplit(".", 1)[-1],
                                                   [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.8)
        hint = ""
        if close:
            full = next((k for k in known if k == close[0] or k.endswith("." + close[0])), close[0])
            hint = f" (did you mean {full}={o.value()}?)"
        lines.append(f"+{o.key_or_group}: no task, optimizer or AP option reads this key{hint}")
    raise ConfigError("unknown key(s), refused before any work:\n  " + "\n  ".join(lines))


def refuse_unavailable_device(name: str) -> None:
    """device=cuda (or cuda:N, mps) that this machine does not have: refused, not run on the CPU."""
    import torch

    kind = str(name).split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name}: this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                          "use device=auto (a GPU when present, else the CPU) or device=cpu")
    if kind == "cuda" and ":" in str(name) and int(str(name).split(":")[1]) >= torch.cuda.device_count():
        raise ConfigError(f"device={name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if kind == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"device={name}: MPS is not available on this machine; use device=auto or device=cpu")


#: the optimizer values torch.optim (and dopr.gp) check, with their allowed ranges
_OPTIM_RANGES = {"lr": (0.0, None), "weight_decay": (0.0, None), "eps": (0.0, None), "momentum": (0.0, 1.0)}


def refuse_bad_optimizer_values(cfg: DictConfig) -> None:
    """Values that torch.optim or DoPr would refuse in their own words ("Invalid learning rate:
    -0.001"), refused here naming the config key (optim.lr, ap.damping)."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True) if "optim" in cfg else {}
    for key, (low, high) in _OPTIM_RANGES.items():
        v = optim.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise ConfigError(f"optim.{key}={v}: must be a number")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (v < low or (high is not None and v > high)):
            where = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"optim.{key}={v}: must be {where}")
    for i, beta in enumerate(optim.get("betas") or []):
        if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
            raise ConfigError(f"optim.betas[{i}]={beta}: must be in [0, 1)")
    if not {"name", "gp"} & set(optim):
        return
    from .optim import optim_identity

    try:
        _, ap = optim_identity(optim)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if ap and "ap" in cfg:
        from dopr.options import check_options

        try:
            check_options(OmegaConf.to_container(cfg.ap, resolve=True))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the ap group (conf/ap/): {e}".replace("Invalid ", "ap.", 1)) from e


def refuse_missing_task_values(cfg: DictConfig, choice: str) -> None:
    """A task config with mandatory values unset (`???`, e.g. a dataset path no default can name),
    named with the tasks that build on it."""
    tree = OmegaConf.to_container(cfg.task, resolve=False) if "task" in cfg else {}
    missing = sorted(k for k in _keys(tree) if _get(tree, k) == "???")
    if not missing:
        return
    from .tasks import built_on

    based = built_on(choice) if choice else []
    keys = ", ".join(f"task.{k}" for k in missing)
    hint = f"; the tasks built on it: {', '.join(based)}" if based else ""
    raise ConfigError(f"task={choice} leaves {keys} unset (??? in its config): set them, or choose "
                      f"a task that does{hint}")


def refuse_base_task(argv: list, conf: Path) -> None:
    """`task=bc`: a family's shared settings (conf/task_base/), not a task; named with its tasks
    (Hydra alone would say only that conf/task/ has no such option)."""
    from .tasks import base_names, built_on, task_names

    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key != "task":
            continue
        for name in (v.strip() for v in value.split(",")):
            if name in base_names(conf) and name not in task_names(conf):
                raise ConfigError(f"task={name} is the shared settings of a family (conf/task_base/{name}.yaml), "
                                  f"not a task: choose one of the tasks built on it: {', '.join(built_on(name, conf))}")


#: task keys that count steps or sizes: a whole number >= 1 wherever a task has them
_TASK_COUNTS = ("steps", "total_steps", "log_every", "batch_size", "num_trajectories")


def refuse_bad_task_counts(cfg: DictConfig) -> None:
    """`task.steps=0` (a job that trains nothing and reports its initial loss as a result), `abc`."""
    task = OmegaConf.to_container(cfg.task, resolve=True) if "task" in cfg else {}
    for key in _TASK_COUNTS:
        v = task.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ConfigError(f"task.{key}={v}: must be a whole number >= 1")


def refuse_counts_over_their_max(cfg: DictConfig) -> None:
    """`task.num_trajectories=500` where the task's `max_trajectories` is 50: every `num_<x>` of a task
    that also names `max_<x>` is at most that."""
    task = OmegaConf.to_container(cfg.task, resolve=True) if "task" in cfg else {}
    for key, v in task.items():
        top = task.get("max_" + key.removeprefix("num_")) if key.startswith("num_") else None
        if isinstance(v, int) and isinstance(top, int) and v > top:
            raise ConfigError(f"task.{key}={v}: must be at most task.max_{key.removeprefix('num_')}={top}")


def refuse_bad_seed(cfg: DictConfig) -> None:
    """`seed=abc` (or -1): a seed is a whole number in [0, 2**32 - 1], the range numpy's seeding takes."""
    seed = OmegaConf.select(cfg, "seed", default=0)
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 32):
        raise ConfigError(f"seed={seed}: must be a whole number in [0, 2**32 - 1]")


def check_job(cfg: DictConfig, overrides: list, groups: set, task: str = "", here: bool = True) -> None:
    """Every check above, on the composed job config and its command-line overrides (`task`: the
    task config chosen; `here`: the job runs on this machine, so its device must be here too)."""
    refuse_missing_task_values(cfg, task)
    refuse_bad_task_counts(cfg)
    refuse_counts_over_their_max(cfg)
    refuse_bad_seed(cfg)
    refuse_added_keys(cfg, overrides, groups)
    if here:
        refuse_unavailable_device(OmegaConf.select(cfg, "device", default="auto"))
    refuse_bad_optimizer_values(cfg)
    refuse_missing_rehearsal(cfg)


def refuse_missing_rehearsal(cfg: DictConfig) -> None:
    """rehearse=true is for the tasks whose configs name a `rehearse:` function (the paper-scale ones
    and the families' smaller tasks that share their base)."""
    if OmegaConf.select(cfg, "rehearse", default=False) and not OmegaConf.select(cfg, "task.rehearse", default=None):
        from .tasks import with_rehearsal

        raise ConfigError(f"rehearse=true: task={cfg.task.name} has no rehearsal (it runs on this machine as it is); "
                          f"the tasks whose config names one (rehearse:): {', '.join(with_rehearsal())}")


def refuse_unwritable_output(argv: list, cwd: Path) -> None:
    """Refuse an output folder that cannot be made (a file in its path, or a parent without write
    permission) before Hydra tries to create it and fails with a bare traceback. The folder is
    `hydra.run.dir` / `hydra.sweep.dir` when given (up to its first interpolation), else outputs/
    or multirun/ under `cwd`."""
    multirun = "-m" in argv or "--multirun" in argv
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == key]
    folder = given[-1] if given else ("multirun" if multirun else "outputs")
    folder = folder.split("${", 1)[0] or "."
    path = Path(folder) if Path(folder).is_absolute() else cwd / folder
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot write the output folder {path}: {existing} is a file, not a folder "
                          f"(set {key}=<a folder>)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the output folder {path}: {existing} is not writable by this user "
                          f"(set {key}=<a writable folder>)")


def refuse_renamed_at_gp_preset(argv: list) -> None:
    """`<dopr>_at_gp_lr` copied only the GP's learning rate; the tuning protocol now writes
    `<dopr>_at_gp_setting`, DoPr at the GP's whole winning setting: name the old one and the new."""
    for arg in argv:
        key, _, value = arg.partition("=")
        old = [v for v in value.split(",") if v.strip().endswith("_at_gp_lr")]
        if key.lstrip("+~").startswith("tuned/") and old:
            new = old[0].strip().removesuffix("_at_gp_lr") + "_at_gp_setting"
            raise ConfigError(f"{key.lstrip('+~')}={old[0].strip()} is gone: it ran DoPr at the GP's learning rate with "
                              f"DoPr's own weight decay and other settings. {new} runs DoPr at the GP's whole winning "
                              "setting (experiments/common/tuning.py writes it); use that")


#: launchers whose jobs run as other processes (submitit): a job's own checks come too late there
SUBMITIT_LAUNCHERS = ("local_parallel", "slurm", "slurm_multigpu")


#: Hydra's flags that print (a configuration, its info, shell completion) and run nothing; Hydra refuses them
#: with -m ("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified")
PRINT_FLAGS = ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


def _prints_only(argv: list) -> bool:
    return any(a.split("=", 1)[0] in PRINT_FLAGS for a in argv)


def refuse_sweep_without_multirun(argv: list) -> None:
    """`sweep=...` or a submitit launcher without -m would run one local job of the defaults; printing its
    configuration (`--cfg job`, `--resolve`, `--info`) runs nothing and passes. The advice is the command
    with -m, its hydra.run.dir as the sweep's folder (hydra.sweep.dir)."""
    if "-m" in argv or "--multirun" in argv or _prints_only(argv):
        return
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "sweep" or (key == "launcher" and value in SUBMITIT_LAUNCHERS):
            swept = [f"hydra.sweep.dir={a.split('=', 1)[1]}" if a.startswith("hydra.run.dir=") else a for a in argv]
            raise ConfigError(f"{arg} is for sweeps, which run with -m: {shlex.join(['python', 'run.py', '-m', *swept])}")


def refuse_multirun_that_prints(argv: list) -> None:
    """`-m ... --cfg job`: Hydra refuses printing with -m in a traceback; printing runs nothing, so the advice
    is the command without -m (which refuse_sweep_without_multirun lets through)."""
    if ("-m" in argv or "--multirun" in argv) and _prints_only(argv):
        rest = [a for a in argv if a not in ("-m", "--multirun")]
        flag = next(a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in PRINT_FLAGS)
        raise ConfigError(f"{flag} prints and runs nothing, and Hydra refuses it with -m (a sweep); without -m it "
                          f"prints for the sweep preset too: {shlex.join(['python', 'run.py', *rest])}")


def discard_fresh_folder(folder: Path) -> None:
    """Remove a job folder Hydra made for a command that was then refused (only Hydra's .hydra/ and
    an empty or start-only run.log in it), and its sweep folder if nothing else is left there: a
    refused command leaves nothing. A folder with anything else (a run being resumed) stays."""
    folder = Path(folder)
    if not folder.is_dir() or any(p.name not in (".hydra", "run.log") for p in folder.iterdir()):
        return
    import shutil

    shutil.rmtree(folder)
    sweep = folder.parent
    if (sweep / "multirun.yaml").exists() and all(p.name == "multirun.yaml" for p in sweep.iterdir()):
        shutil.rmtree(sweep)


def _group_dirs(conf: Path, group: str) -> list:
    """The folders of a config group over the config roots (conf/, conf_handwritten/: experiments/common/presets.py)."""
    return [r / group for r in roots(conf) if (r / group).is_dir()]


def _where(conf: Path, group: str) -> str:
    """A group's folder(s) as a message names them: conf_handwritten/tuned/sit_digits/, conf/tuned/sit_mnist_protocol/."""
    return " and ".join(f"{d.relative_to(conf.parent)}/" for d in _group_dirs(conf, group)) or f"conf/{group}/"


def refuse_unknown_group(argv: list, conf: Path) -> None:
    """`+tuned/sit_mnist=adamw`: a config group path (with a /) that no config root (conf/, conf_handwritten/)
    has, which Hydra takes for a key; refused naming the close groups (tuned/sit_mnist_protocol). A command
    that adds a config search path (hydra.searchpath) is left to Hydra."""
    if any(a.startswith("hydra.searchpath") for a in argv):
        return
    for arg in argv:
        group = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if arg.startswith("-") or "=" not in arg or "/" not in group or group.startswith("hydra/") or \
                _group_dirs(conf, group):
            continue
        parent = group.rsplit("/", 1)[0]
        groups = sorted({str(d.relative_to(r)) for r in roots(conf) for d in (r / parent).glob("*") if d.is_dir()})
        leaf = {g.rsplit("/", 1)[-1]: g for g in groups}
        close = ([g for g in groups if g.startswith(group)] or
                 [leaf[n] for n in difflib.get_close_matches(group.rsplit("/", 1)[-1], leaf, n=3, cutoff=0.6)])
        hint = (f"did you mean {' or '.join(close[:3])}{' or ...' if len(close) > 3 else ''}?" if close else
                f"the groups under {parent}/ are in {_where(conf, parent)}" if groups else
                f"conf/{parent}/ does not exist either")
        raise ConfigError(f"{arg}: no config group {group} (conf/{group}/ does not exist; {hint})")


def _options(conf: Path, group: str) -> list:
    return sorted({f.stem for d in _group_dirs(conf, group) for f in d.glob("*.yaml")})


def _values(override, conf: Path):
    """An override's values (a sweep's, lazily). `glob(...)` is matched here against the group's files in
    conf/: Hydra expands a glob only with its config loader, which exists once the sweep runs."""
    from hydra.core.override_parser.types import Glob

    value, group = override.value(), override.key_or_group.lstrip("+~")
    if isinstance(value, Glob):
        matched = value.filter(_options(conf, group))
        if not matched:
            raise ConfigError(f"{override.input_line}: the glob matches no option of "
                              f"{_where(conf, group)} (it has {', '.join(_options(conf, group)) or 'none'})")
        return matched
    if override.is_sweep_override():
        return override.sweep_string_iterator()
    return value if isinstance(value, list) else [value]


def refuse_unknown_option(parsed: list, conf: Path) -> None:
    """`optim=dopr_adamww`: an option that its config group in conf/ does not have, refused in one line
    naming the close one (Hydra lists the group's every option instead)."""
    for o in parsed:
        group = o.key_or_group.lstrip("+~")
        if o.is_delete() or group.startswith("hydra/") or not _group_dirs(conf, group):
            continue
        for value in _values(o, conf):
            if value is None or any((d / f"{value}.yaml").is_file() for d in _group_dirs(conf, group)):
                continue
            close = difflib.get_close_matches(str(value), _options(conf, group), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"its options: {', '.join(_options(conf, group))}"
            raise ConfigError(f"{o.input_line}: {_where(conf, group)} has no option {value} ({hint})")


def suggest_key(argv: list, conf: Path) -> None:
    """A key override without `+` that no config has (`task.step=5`): Hydra's advice is to add `+`,
    which makes a key nothing reads. Refused here with the likely key. The config is composed once
    with the command's group choices (a sweep's first value) to know the keys. A config group that
    conf/ does not have, or an option that its group lacks, is named first (refuse_unknown_group,
    refuse_unknown_option)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    refuse_unknown_group(argv, conf)
    plain = [a for a in argv if not a.startswith("-") and "=" in a and not a.split("=", 1)[0].startswith("hydra.")]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except HydraException:
        return  # Hydra names a malformed override itself
    if not any(a.startswith("hydra.searchpath") for a in argv):   # options from elsewhere: left to Hydra
        refuse_unknown_option(parsed, conf)
    firsts = [f"{o.get_key_element()}={next(iter(_values(o, conf)))}" if o.is_sweep_override()
              else o.input_line for o in parsed]
    groups = [o for o, p in zip(firsts, parsed) if not p.is_add() and "." not in p.key_or_group.lstrip("~")]
    keys = [(o, p) for o, p in zip(firsts, parsed) if not p.is_add() and not p.is_delete() and "." in p.key_or_group]
    if not keys:
        return
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="config", overrides=groups)
    except HydraException:
        return  # a bad group choice: Hydra's own message names it
    tree = OmegaConf.to_container(cfg, resolve=False)
    known = _keys(tree)
    for line, o in keys:
        if o.key_or_group in known:
            continue
        close = difflib.get_close_matches(o.key_or_group, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}={line.split('=', 1)[1]}?" if close else "no config has it"
        raise ConfigError(f"{o.key_or_group}: no such key ({hint}); adding it with + would make a key that no task, "
                          "optimizer or AP option reads")
