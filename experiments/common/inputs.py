"""The input files a job reads (datasets, demonstrations, weights), checked before a sweep is submitted:
a missing one refuses the sweep in one line on the submitting host, not after the queue on a node.
Each family's own check (the one its loader calls) is named here by the task's entry."""
from __future__ import annotations

import importlib

from omegaconf import DictConfig, OmegaConf

#: task entry -> the function that raises FileNotFoundError, with the loader's message, for a missing input
CHECKS = {
    "experiments.appendix.grafting.run": "experiments.appendix.data.check_inputs",
    "experiments.appendix.mup.run": "experiments.appendix.data.check_inputs",
    "experiments.appendix.gpt.run": "experiments.appendix.gpt.check_inputs",
    "experiments.bc.train.run": "experiments.bc.train.check_inputs",
    "experiments.robomimic.train.run": "experiments.robomimic.data.check_inputs",
    "experiments.sit.train.run": "experiments.sit.train.check_inputs",
}


def check_inputs(cfg: DictConfig) -> None:
    """FileNotFoundError when the job's task misses an input file (a rehearsal reads none). A family
    whose code does not import here (its extra is not installed on this host) is left to the job."""
    if OmegaConf.select(cfg, "rehearse", default=False):
        return
    name = CHECKS.get(str(OmegaConf.select(cfg, "task.entry", default="")))
    if name is None:
        return
    module, function = name.rsplit(".", 1)
    try:
        check = getattr(importlib.import_module(module), function)
    except ImportError:
        return
    check(cfg.task)
