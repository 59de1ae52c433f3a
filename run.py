"""The DoPr experiment suite: `python run.py task=<task> optim=<optim>`, `-m` for sweeps.

    python run.py task=feature_learning optim=dopr_sgd
    python run.py -m task=feature_learning optim=sgd,adamw,dopr_sgd seed=0,1,2
    python run.py -m sweep=feature_learning launcher=slurm slurm.partition=gpu
"""
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.common.launch import run_job


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    return run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
