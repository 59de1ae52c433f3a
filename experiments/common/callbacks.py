"""Hydra callbacks of the submitit launchers (conf/launcher/)."""
from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class RemoveSubmititTemplateFolder(Callback):
    """submitit creates its folder template literally (`.submitit/%j`) beside the per-job folders it
    fills; the sweep ends without that empty folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        template = Path(str(config.hydra.launcher.submitit_folder))
        if "%j" in template.name and template.is_dir() and not any(template.iterdir()):
            template.rmdir()
