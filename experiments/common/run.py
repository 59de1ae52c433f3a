"""One job of the suite: its output directory, metrics.jsonl, W&B run, checkpoint and summary.json.

Every job writes into its own Hydra output directory:
  .hydra/config.yaml   the resolved config (Hydra)
  metrics.jsonl        one JSON object per logged step, always
  checkpoint.pt        the latest training state (written atomically), for requeue and resume
  summary.json         final metrics, wall time, git revision (the commit the job started at; every
                       commit it ran at when a resume came at another), package versions; written last,
                       atomically, and only when the job finished (never for a failed run)
  status.json          how the job ended (finished / diverged / failed) and its last line; written by
                       experiments/common/launch.py, read by the sweep's summary (callbacks.py)
  wandb/               the W&B run directory when logger=wandb (offline without an API key)
  wandb_run_id         the job's W&B run id: a resumed or requeued job continues that run
"""
from __future__ import annotations

import json
import os
import pickle
import random
import statistics
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import dopr

from . import wandb_run
from .distributed import is_main, world
from .loop import Clock
from .optim import gp_arguments, optim_identity, optim_name
from .provenance import atomic_write, git_revision, package_versions


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_optimizer(model: torch.nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """dopr.build from the `optim` group (the GP and its arguments) and, when it says `ap: true`, the
    `ap` group (the AP's options)."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    gp, ap = optim_identity(optim)
    kwargs = gp_arguments(optim)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return dopr.build(model, gp, ap=OmegaConf.to_container(cfg.ap, resolve=True) if ap else None, **kwargs)


def numpy_array_globals() -> list:
    """What unpickling a numpy array needs, for the legacy global random state (``np.random.get_state()``,
    whose MT19937 key is a uint32 array) that every checkpoint holds: numpy's array constructor (under
    numpy 1's and numpy 2's module name, so a file from either loads), the array and dtype classes.
    Constructing an array runs no code from the file."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    names = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")
    return [*((_reconstruct, name) for name in names), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path, map_location=None, allowed=()) -> Any:
    """torch.load that never runs code from the file: ``weights_only=True`` (tensors, numbers, strings
    and containers) plus the `allowed` globals. A file holding anything else (a pickled callable, an
    object of another class) is refused with a ValueError naming the file and what it holds."""
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            try:  # the offending globals, read from the pickle without running it
                names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:
                names = []
            found = f" ({', '.join(names)})" if names else ""
            raise ValueError(f"refusing to load {path}: it contains objects that are not plain tensors or "
                             f"containers{found}; only files this suite writes are loaded (nothing in them "
                             "is run)") from e


class Run:
    """The job's handle for logging, checkpointing and finishing."""

    def __init__(self, cfg: DictConfig, out_dir: Path) -> None:
        self.cfg = cfg
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.device = pick_device(cfg.device)
        self.clock = Clock()   # training, evaluation and wall time; kept across a resume by the checkpoint
        # under torch.distributed only rank 0 writes files and talks to W&B
        self.is_main = is_main()
        # the code this attempt runs, read now: a commit made while a long job trains is not its code
        self.git_revisions = [git_revision()]
        # a fresh start (no checkpoint) drops the rows of an earlier attempt cut off before its first
        # checkpoint, or of a finished run re-run in its folder; a resume cuts them back to its checkpoint
        fresh = not self.checkpoint_path.exists()
        self._metrics = open(self.dir / "metrics.jsonl" if self.is_main else os.devnull, "w" if fresh else "a")
        self._wandb = (wandb_run.start(cfg, self.dir, resuming=not fresh)
                       if cfg.logger.name == "wandb" and self.is_main else None)
        self.summary_path = self.dir / "summary.json"
        self.optimizers: list = []
        if self.is_main and self.summary_path.exists():  # a re-run in the same directory starts unfinished
            self.summary_path.unlink()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The `optim` (and `ap`) config's optimizer over `model`; its AP settings, conventions and, for
        DoPr, its counters go into summary.json, and the run closes it (removes DoPr's hooks) at the end."""
        opt = build_optimizer(model, self.cfg)
        self.optimizers.append(opt)
        return opt

    # ---------------------------------------------------------------------------- logging
    def progress(self, total: int, initial: int = 0, desc: Optional[str] = None):
        """A tqdm bar over training steps (rank 0 only; at most ~1 refresh a second in log files)."""
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc or f"{self.cfg.task.name}/{optim_name(self.cfg.optim)}",
                    disable=not self.is_main, mininterval=1.0, dynamic_ncols=True)

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=int(step))

    # ------------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pt"

    def save_checkpoint(self, state: dict) -> None:
        """Atomically save the training state together with how many metric rows it has logged."""
        if not self.is_main:
            return
        self._metrics.flush()
        rows = sum(1 for _ in open(self.dir / "metrics.jsonl"))
        atomic_write(self.checkpoint_path, lambda p: torch.save(
            {"state": state, "metric_rows": rows, "git_revisions": self.git_revisions}, p))

    def load_checkpoint(self) -> Optional[dict]:
        """The last saved state (None on a fresh start); metrics.jsonl is cut back to that point, so a
        requeued job that resumes logs every step exactly once."""
        if not self.checkpoint_path.exists():
            return None
        ckpt = load_plain(self.checkpoint_path, map_location=self.device, allowed=numpy_array_globals())
        earlier = list(ckpt.get("git_revisions", []))  # the commits of the attempts before this one
        if earlier:
            self.git_revisions = earlier + [r for r in self.git_revisions if r != earlier[-1]]
        if not self.is_main:
            return ckpt["state"]
        self._metrics.close()
        path = self.dir / "metrics.jsonl"
        rows = path.read_text().splitlines(keepends=True)[: ckpt["metric_rows"]]
        path.write_text("".join(rows))
        self._metrics = open(path, "a")
        print(f"resumed from {self.checkpoint_path} ({ckpt['metric_rows']} metric rows)", flush=True)
        return ckpt["state"]

    # ----------------------------------------------------------------------------- finish
    def finish(self, summary: dict) -> dict:
        out = {
            "task": self.cfg.task.name, "optim": optim_name(self.cfg.optim), "seed": int(self.cfg.seed),
            **(ap_record(self.cfg) if self.optimizers else {}), **{k: _plain(v) for k, v in summary.items()},
            **self.clock.times(), "wall_time_s": self.clock.wall(), "git_revision": self.git_revisions[0],
            **({"git_revisions": self.git_revisions} if len(self.git_revisions) > 1 else {}),
            "world_size": world()[1],
            "packages": package_versions(), "overrides": command_line_overrides(),
            **optimizer_record(self.cfg, self.optimizers),
        }
        if not self.is_main:
            return out
        atomic_write(self.summary_path, lambda p: p.write_text(json.dumps(out, indent=2)))
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in out.items() if isinstance(v, (int, float, str))})
        return out

    def close(self, failed: bool) -> None:
        for opt in self.optimizers:
            if hasattr(opt, "close"):
                opt.close()
        self.optimizers = []
        self._metrics.close()
        if self._wandb is not None:
            wandb_run.finish(self._wandb, self.dir, failed)
            self._wandb = None


#: the counters of DoPr.stats() that summary.json carries: the library's list
DOPR_COUNTERS = dopr.DoPr.COUNTERS


def ap_record(cfg: DictConfig) -> dict:
    """The AP settings of a dopr_* run (damping None for a GP alone), for the reports' grouping."""
    if not optim_identity(cfg.optim)[1]:
        return {"damping": None}
    return {"damping": float(cfg.ap.damping), "grad_ema": float(cfg.ap.grad_ema),
            "precond_ema": float(cfg.ap.precond_ema), "warmup_steps": int(cfg.ap.warmup_steps)}


def optimizer_record(cfg: DictConfig, optimizers: list) -> dict:
    """What summary.json says of the optimizer: the conventions that change its update (the AP's
    damping form, Muon's step scale and which layers it gets), DoPr's options in full (`dopr_options`, as
    the library reports them) and its counters (summed over the job's DoPr optimizers), so an effective
    damping other than the table's shows (Cholesky retries)."""
    conventions = {k: cfg.optim[k] for k in ("adjust_lr_fn", "input_layer") if k in cfg.optim}
    if optim_identity(cfg.optim)[1]:
        conventions["damping_mode"] = cfg.ap.damping_mode
    out = {"conventions": conventions}
    # every option as the library holds it (DoPrOptions.describe: the damping rule included; issue 74)
    options = [o.options.describe() for o in optimizers if isinstance(o, dopr.DoPr)]
    if options:
        out["dopr_options"] = options[0] if all(o == options[0] for o in options) else options
    stats = [o.stats() for o in optimizers if isinstance(o, dopr.DoPr)]
    if stats:
        out["dopr"] = {k: sum(int(s[k]) for s in stats) for k in DOPR_COUNTERS}
        health = health_record([r for s in stats for r in s.get("health", {}).values()])
        if health:
            out["dopr_health"] = health
    return out


def health_record(reports: list) -> dict:
    """The last health report of every group (ap.health_every > 0), in a few numbers: how many groups, the
    median and largest share of M in weak directions, and, under ap.weak_share_bound, the median and
    largest factor on lambda and how many groups it raised ({} without reports)."""
    if not reports:
        return {}
    out = {"groups": len(reports)}
    shares = [r["weak_share"] for r in reports if r.get("weak_share") is not None]
    if shares:
        out.update(weak_share_median=statistics.median(shares), weak_share_max=max(shares))
    scales = [r["damping_scale"] for r in reports if "damping_scale" in r]
    if scales:
        out.update(damping_scale_median=statistics.median(scales), damping_scale_max=max(scales),
                   damping_raised_groups=sum(f > 1.0 for f in scales))
    return out


def command_line_overrides() -> list:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # not running under Hydra (tests calling a task directly)
        return []


def _plain(v: Any):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v
