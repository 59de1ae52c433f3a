"""Plumbing shared by every experiment family: the run (directories, metrics, W&B, summary,
checkpoints), seeding, device choice, and the optimizer built from the `optim` config."""
from . import resolvers  # noqa: F401  (registers the config resolvers)
from .run import Run, build_optimizer, pick_device, seed_everything

__all__ = ["Run", "build_optimizer", "pick_device", "seed_everything"]
