"""Hydra callbacks of the submitit launchers (conf/launcher/)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class RemoveSubmititTemplateFolder(Callback):
    """submitit creates its folder template literally (`.submitit/%j`) beside the per-job folders it
    fills; the sweep ends without that empty folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        template = Path(str(config.hydra.launcher.submitit_folder))
        if "%j" in template.name and template.is_dir() and not any(template.iterdir()):
            template.rmdir()


def sweep_jobs(config: DictConfig) -> list:
    """The override lists of the sweep's jobs, as Hydra's basic sweeper makes them (its params first,
    then the command line's)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    overrides = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


class CheckJobsBeforeLaunch(Callback):
    """Submitit launchers (local_parallel, slurm, slurm_multigpu): every job's config checks run here,
    before anything is submitted, with the one-line messages a local job gives (a job's own check
    runs in its process: on SLURM after the queue). `runs_here`: the jobs run on this machine, so their
    device is checked too (not for SLURM: a login node has no GPU). `needs`: a command the launcher
    calls (sbatch). SystemExit: Hydra turns a callback's exceptions into warnings and goes on."""

    def __init__(self, runs_here: bool = True, needs: str | None = None) -> None:
        self.runs_here, self.needs = runs_here, needs

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from hydra import compose

        from .checks import ConfigError, check_job

        if self.needs and shutil.which(self.needs) is None:
            _refuse(f"launcher={config.hydra.runtime.choices.get('launcher')} submits with {self.needs}, which is not "
                    "on this machine's PATH: run the sweep on the cluster's login node, or use launcher=local_parallel here")
        jobs = sweep_jobs(config)
        for i, job in enumerate(jobs):
            cfg = compose(config_name=config.hydra.job.config_name, overrides=job, return_hydra_config=True)
            choices = cfg.hydra.runtime.choices
            try:
                check_job(cfg, job, set(choices), choices.get("task", ""), here=self.runs_here)
            except ConfigError as e:
                if os.environ.get("DOPR_TRACEBACK"):
                    raise
                which = f" (job {i} of {len(jobs)}: {' '.join(job)})" if len(jobs) > 1 else ""
                _refuse(f"{e}{which}; nothing was submitted")


def _refuse(message: str) -> None:
    """The message alone, exit status 2, as run.py's own refusals."""
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(2)
