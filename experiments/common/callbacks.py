"""Hydra callbacks of the submitit launchers (conf/launcher/)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .launch import STATUS_FILE, STATUSES, finished_line, job_status


class RemoveSubmititTemplateFolder(Callback):
    """submitit creates its folder template literally (`.submitit/%j`) beside the per-job folders it
    fills; the sweep ends without that empty folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        template = Path(str(config.hydra.launcher.submitit_folder))
        if "%j" in template.name and template.is_dir() and not any(template.iterdir()):
            template.rmdir()


def _config_loader(config: DictConfig):
    """The running Hydra's config loader, else one over the config sources the job config records."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return GlobalHydra.instance().config_loader()
    search_path = create_config_search_path(None)
    for source in OmegaConf.select(config, "hydra.runtime.config_sources", default=None) or []:
        search_path.append(source.provider, f"{source.schema}://{source.path}")
    return ConfigLoaderImpl(config_search_path=search_path)


def sweep_jobs(config: DictConfig) -> list:
    """The override lists of the sweep's jobs, as Hydra's basic sweeper makes them (its params first,
    then the command line's)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    overrides = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    # a glob(*) over a config group (the protocol sweeps' tuned presets) lists the group: needs a loader
    parsed = OverridesParser.create(config_loader=_config_loader(config)).parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


#: id(a sweep's config) -> (that config, its jobs with their configs): composed once per sweep
_COMPOSED: dict = {}


def job_configs(config: DictConfig) -> list:
    """(overrides, config) of every job of the sweep, composed as its launcher will (with the command's
    hydra overrides: hydra.searchpath adds a task outside conf/), once: the callbacks share them."""
    if id(config) not in _COMPOSED:
        loader = _config_loader(config)
        _COMPOSED[id(config)] = config, [(job, loader.load_sweep_config(config, job)) for job in sweep_jobs(config)]
    return _COMPOSED[id(config)][1]


def _quoted(value: str) -> str:
    """`value` as a quoted Hydra override value (a quote, and the backslashes before one, escaped)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"


def one_sweep_folder(config: DictConfig) -> None:
    """Each job composes its own hydra.sweep.dir, in which `${sweep_name}` is its own task's name, and
    Hydra composes the sweep's (its multirun.yaml, this summary) with the default task: the jobs of
    `-m task=feature_learning,invariance` landed in two folders. The folder is resolved once here, from
    the jobs' own (the parts in which they differ joined with +: multirun/feature_learning+invariance/
    <time>), and given to every job (a hydra.sweep.dir override). A job that does not compose is left
    to Hydra."""
    from hydra.errors import HydraException
    from omegaconf import read_write
    from omegaconf.errors import OmegaConfBaseException

    sweep = Path(str(config.hydra.sweep.dir))   # resolves ${now:...} once: every job's copy keeps that time
    try:
        folders = [Path(str(cfg.hydra.sweep.dir)) for _, cfg in job_configs(config)]
    except (HydraException, OmegaConfBaseException):
        return
    if all(f == sweep for f in folders):
        return
    same_depth = len({len(f.parts) for f in folders}) == 1
    folder = str(Path(*map("+".join, map(dict.fromkeys, zip(*(f.parts for f in folders))))) if same_depth
                 else folders[0])
    with read_write(config.hydra):
        config.hydra.sweep.dir = folder
        config.hydra.overrides.hydra.append(f"hydra.sweep.dir={_quoted(folder)}")


class CheckJobsBeforeLaunch(Callback):
    """Every launcher (local, local_parallel, slurm, slurm_multigpu): every job's config checks run here,
    before the first job starts or anything is submitted, with the one-line messages a job gives (a
    job's own check runs when it starts: on SLURM after the queue). `runs_here`: the jobs run on this
    machine, so their device is checked too (not for SLURM: a login node has no GPU). `needs`: a command
    the launcher calls (sbatch). `inputs`: the jobs' input files (datasets, demonstrations, weights) are
    checked too (experiments/common/inputs.py; hydra.callbacks.check_jobs.inputs=false when they are
    only on the nodes). SystemExit: Hydra turns a callback's exceptions into warnings and goes on."""

    def __init__(self, runs_here: bool = True, needs: str | None = None, inputs: bool = True) -> None:
        self.runs_here, self.needs, self.inputs = runs_here, needs, inputs

    def _check(self, cfg: DictConfig, job: list, inputs: bool, which: str = "") -> None:
        from .checks import ConfigError, check_job
        from .inputs import check_inputs

        choices = cfg.hydra.runtime.choices
        try:
            check_job(cfg, job, set(choices), choices.get("task", ""), here=self.runs_here)
            if inputs:
                check_inputs(cfg)
        except (ConfigError, FileNotFoundError) as e:
            if os.environ.get("DOPR_TRACEBACK"):
                raise
            _refuse(f"{e}{which}")

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        """A single run: its checks before Hydra makes its folder, so a refused run leaves no folder and
        no empty parents (its input files are its job's: a missing one is said in the folder's run.log)."""
        self._check(config, list(config.hydra.overrides.task), inputs=False)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if self.needs and shutil.which(self.needs) is None:
            _refuse(f"launcher={config.hydra.runtime.choices.get('launcher')} submits with {self.needs}, which is not "
                    "on this machine's PATH: run the sweep on the cluster's login node, or use launcher=local_parallel here")
        jobs = job_configs(config)
        done = "submitted" if "submitit" in str(config.hydra.runtime.choices.get("hydra/launcher")) else "run"
        for i, (job, cfg) in enumerate(jobs):
            which = f" (job {i} of {len(jobs)}: {' '.join(job)})" if len(jobs) > 1 else ""
            self._check(cfg, job, self.inputs, f"{which}; nothing was {done}")


def _refuse(message: str) -> None:
    """The message alone, exit status 2, as run.py's own refusals."""
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(2)


def job_folders(sweep_dir: Path) -> list:
    """The sweep's job folders (each has Hydra's .hydra/), in job order."""
    found = [p.parent for p in Path(sweep_dir).glob("*/.hydra")]
    return sorted(found, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def job_ending(folder: Path) -> dict:
    """How the job in `folder` ended: its status.json, or for a job finished before status files were
    written its summary.json read with its config's headline; "failed" when it left neither (it
    crashed, or was killed, before it could write one)."""
    folder = Path(folder)
    if (folder / STATUS_FILE).exists():
        return json.loads((folder / STATUS_FILE).read_text())
    config = folder / ".hydra" / "config.yaml"
    if (folder / "summary.json").exists() and config.exists():
        cfg, summary = OmegaConf.load(config), json.loads((folder / "summary.json").read_text())
        return {"status": job_status(cfg, summary), "line": finished_line(cfg, summary, folder)}
    return {"status": "failed", "line": f"{folder}: failed: it ended without status.json or summary.json "
                                        "(killed, or crashed; its log says how)"}


def sweep_line(counts: dict, sweep_dir: Path, rehearsals: bool = False) -> str:
    """"N finished, M diverged, K failed; report with: <command>"."""
    where = Path(sweep_dir)
    try:
        where = where.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    counted = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
    if not counts.get("finished") and not counts.get("diverged"):
        return f"{counted}; nothing to report in {where}"
    folder = shlex.quote(str(where))
    command = (f"python -m experiments.common.rehearsal {folder} --out {shlex.quote(str(where / 'rehearsal.md'))}"
               if rehearsals else f"python -m experiments.report {folder}")
    return f"{counted}; report with: {command}"


class SummarizeSweep(Callback):
    """Every launcher: the sweep's jobs write into one folder (one_sweep_folder), and the sweep ends with
    "N finished, M diverged, K failed; report with: <command>", from the status.json its jobs wrote (a
    job that left none failed; a job the sweep launched that made no folder failed too), and exits 1
    when a job failed. `echo_jobs`: the jobs run as other processes (submitit: local_parallel, SLURM),
    whose output goes to their .submitit/ logs, so each job's last line is printed here when its
    status.json appears (polled every `poll_s` seconds)."""

    def __init__(self, echo_jobs: bool = False, poll_s: float = 2.0) -> None:
        self.echo_jobs, self.poll_s = echo_jobs, poll_s
        self._shown, self._stop, self._thread = {}, None, None   # _shown: folder -> its status.json's mtime

    def __getstate__(self) -> dict:
        """submitit pickles the launcher with Hydra's callbacks for each job: without the watcher."""
        return {**self.__dict__, "_shown": {}, "_stop": None, "_thread": None}

    def _endings(self, sweep_dir: Path) -> dict:
        return {f: (f / STATUS_FILE).stat().st_mtime_ns for f in job_folders(sweep_dir) if (f / STATUS_FILE).exists()}

    def _echo_new(self, sweep_dir: Path) -> None:
        for folder, mtime in self._endings(sweep_dir).items():
            if self._shown.get(folder) != mtime:
                try:
                    line = job_ending(folder)["line"]
                except (OSError, ValueError):   # being replaced (atomic_write makes this rare)
                    continue
                self._shown[folder] = mtime
                print(line, flush=True)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        one_sweep_folder(config)
        if not self.echo_jobs:
            return
        import threading

        sweep_dir = Path(str(config.hydra.sweep.dir))
        self._shown = self._endings(sweep_dir)   # a re-run sweep (skip_finished): endings already there are not news
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.wait(self.poll_s):
                self._echo_new(sweep_dir)

        self._thread = threading.Thread(target=watch, name="echo-job-endings", daemon=True)
        self._thread.start()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._echo_new(sweep_dir)
        folders = job_folders(sweep_dir)
        counts = dict.fromkeys(STATUSES, 0)
        for folder in folders:
            status = job_ending(folder)["status"]
            counts[status if status in counts else "failed"] += 1
        counts["failed"] += max(0, len(sweep_jobs(config)) - len(folders))   # launched, never started
        rehearsals = bool(folders) and all(bool(OmegaConf.select(OmegaConf.load(f / ".hydra" / "config.yaml"),
                                                                 "rehearse", default=False)) for f in folders)
        print(sweep_line(counts, sweep_dir, rehearsals), flush=True)
        if counts["failed"]:
            sys.exit(1)
