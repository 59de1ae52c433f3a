"""The DoPr experiment suite: `python run.py task=<task> optim=<optim>`, `-m` for sweeps.

    python run.py task=feature_learning +tuned/feature_learning_protocol=dopr_sgd
    python run.py -m task=feature_learning '+tuned/feature_learning_protocol=sgd,adamw,dopr_sgd' seed=1,2,3
    python -m experiments.common.protocol protocol feature_learning launcher=slurm slurm.partition=gpu   # a tuning protocol's stage
    python run.py task=feature_learning +tuned/feature_learning_protocol=dopr_sgd resume=true   # continue its latest unfinished run

(in the environment `make` created: `source .venv/bin/activate` first, or `.venv/bin/python run.py ...`)
"""
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.common.checks import (ConfigError, check_job, discard_fresh_folder, refuse_base_task,
                                       refuse_multirun_that_prints, refuse_renamed_at_gp_preset,
                                       refuse_sweep_without_multirun, refuse_unwritable_output, suggest_key)
from experiments.common.launch import run_job, submitted, write_status
from experiments.common.resume import with_resume


#: what refuse() returns for a refused job that submitit launched
REFUSED = object()


def refuse(check, *args, folder=None):
    """Run a configuration check (or the job); a ConfigError, or a missing input file (a dataset, the
    demonstrations, a model), ends the command with the message alone (exit 2). A job `folder` that
    Hydra made for the refused command goes with it. A job that submitit launched does not exit (its
    sweep would wait for a result that never comes): it returns REFUSED, its status.json says failed."""
    try:
        return check(*args)
    except KeyboardInterrupt:   # Ctrl-C: the job logged its one line; no traceback
        if os.environ.get("DOPR_TRACEBACK"):
            raise
        sys.exit(130)
    except (ConfigError, FileNotFoundError) as e:
        if os.environ.get("DOPR_TRACEBACK"):
            raise
        if folder is not None and isinstance(e, ConfigError) and check is not run_job and not submitted():
            discard_fresh_folder(folder)
        print(f"Error: {e}", file=sys.stderr)
        if submitted():
            if folder is not None:
                write_status(folder, "failed", f"{folder}: failed: {type(e).__name__}: {e}")
            return REFUSED
        sys.exit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    if refuse(check_job, cfg, list(hc.overrides.task), set(hc.runtime.choices), hc.runtime.choices.get("task", ""),
              folder=out) is REFUSED:
        return None
    # a sweep's failed job is logged and recorded, and the sweep goes on; it ends with its counts
    # (experiments/common/callbacks.py, SummarizeSweep) and exits 1
    return refuse(run_job, cfg, out, hc.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    refuse(refuse_sweep_without_multirun, sys.argv[1:])
    refuse(refuse_multirun_that_prints, sys.argv[1:])
    sys.argv = [sys.argv[0], *with_resume(sys.argv[1:], Path.cwd())]   # outputs/ and multirun/ are the cwd's
    refuse(refuse_unwritable_output, sys.argv[1:], Path.cwd())
    refuse(refuse_base_task, sys.argv[1:], Path(__file__).resolve().parent / "conf")
    refuse(refuse_renamed_at_gp_preset, sys.argv[1:])
    refuse(suggest_key, sys.argv[1:], Path(__file__).resolve().parent / "conf")
    main()
