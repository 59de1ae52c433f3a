"""The input files a job reads (datasets, demonstrations, weights), checked before a sweep is submitted:
a missing one refuses the sweep in one line on the submitting host, not after the queue on a node.
Each family declares its own check (the one its loader calls) in its task config, `task.check_inputs`,
as it names its `entry` and `report`; this module names no family."""
from __future__ import annotations

import importlib

from omegaconf import DictConfig, OmegaConf


def check_inputs(cfg: DictConfig) -> None:
    """FileNotFoundError when the job's task misses an input file (a rehearsal reads none). A task that
    declares no check reads no input file; a family whose code does not import here (its extra is not
    installed on this host) is left to the job."""
    if OmegaConf.select(cfg, "rehearse", default=False):
        return
    name = OmegaConf.select(cfg, "task.check_inputs", default=None)
    if not name:
        return
    module, function = str(name).rsplit(".", 1)
    try:
        check = getattr(importlib.import_module(module), function)
    except ImportError:
        return
    check(cfg.task)
