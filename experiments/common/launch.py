"""The suite's entry point: one Hydra job = one task x optimizer x seed."""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from .run import Run, seed_everything


def apply_debug(cfg: DictConfig) -> None:
    """`debug=default` shrinks the task with the `debug:` block its own config defines."""
    if cfg.get("debug_run") and cfg.task.get("debug"):
        with open_dict(cfg):
            cfg.task = OmegaConf.merge(cfg.task, cfg.task.debug)


def run_job(cfg: DictConfig, out_dir: Path) -> dict:
    """Run the task named by `cfg.task.entry`; summary.json is written only if it returns."""
    apply_debug(cfg)
    seed_everything(int(cfg.seed))
    task = hydra.utils.get_method(cfg.task.entry)
    run = Run(cfg, out_dir)
    failed = True
    try:
        result = run.finish(task(cfg, run))
        failed = False
        return result
    finally:
        run.close(failed)
