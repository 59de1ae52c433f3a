"""The suite's entry point: one Hydra job = one task x optimizer x seed."""
from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from . import interrupt
from .optim import optim_name
from .provenance import atomic_write
from .run import Run, command_line_overrides, seed_everything


def apply_debug(cfg: DictConfig, out_dir: Path, overrides: list | None = None) -> None:
    """`debug=default` shrinks the task with the `debug:` block its own config defines, except the
    task keys set on the command line (`debug=default task.eval_episodes=0` evaluates nothing;
    ``overrides``: the job's command-line overrides, by default Hydra's). The job's
    .hydra/config.yaml (written by Hydra before the job starts) is rewritten with the values that run."""
    if not (cfg.debug_run and "debug" in cfg.task):
        return
    overrides = command_line_overrides() if overrides is None else overrides
    explicit = {o.split("=", 1)[0].lstrip("+~").removeprefix("task.") for o in overrides
                if o.lstrip("+~").startswith("task.") and "=" in o}
    debug = OmegaConf.masked_copy(cfg.task.debug, [k for k in cfg.task.debug if k not in explicit])
    with open_dict(cfg):
        cfg.task = OmegaConf.merge(cfg.task, debug)
    saved = Path(out_dir) / ".hydra" / "config.yaml"
    if saved.exists():
        atomic_write(saved, lambda p: OmegaConf.save(cfg, p))


class RequireSlurmPartition(Callback):
    """launcher=slurm: stop before anything is submitted when slurm.partition is unset. Without this
    the launcher fails with "Missing mandatory value: hydra.launcher.partition", naming the wrong key.
    SystemExit, not an exception: Hydra turns a callback's exceptions into warnings and goes on."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if "slurm" in config and OmegaConf.is_missing(config.slurm, "partition"):
            sys.exit("Missing mandatory value: slurm.partition. launcher=slurm needs the cluster's partition: "
                     "pass slurm.partition=<name> or set it in conf/local/default.yaml "
                     "(see conf/local.example.yaml)")


def init_distributed(cfg: DictConfig) -> None:
    """launcher=slurm_multigpu: one process per GPU; rank and world from submitit's environment."""
    if not cfg.distributed:
        return
    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def finished_summary(cfg: DictConfig, out_dir: Path):
    """With `skip_finished=true`, the summary of a job that already finished in `out_dir` (a re-run
    sweep with the same hydra.sweep.dir skips its finished jobs); None when it must run. A finished
    job with other overrides in that directory is refused, not skipped."""
    path = Path(out_dir) / "summary.json"
    if not (cfg.skip_finished and path.exists()):
        return None
    import json

    from .checks import ConfigError

    summary = json.loads(path.read_text())
    if _job_identity(summary["overrides"]) != _job_identity(command_line_overrides()):
        raise ConfigError(f"skip_finished: {path} is a job with overrides {summary['overrides']}, not "
                          f"{command_line_overrides()}; re-run a sweep with the same command and hydra.sweep.dir")
    status = job_status(cfg, summary)
    line = (f"skip_finished: {out_dir} finished already{' (diverged)' if status == 'diverged' else ''}: "
            f"{headline_metrics(cfg, summary)}")
    write_status(out_dir, status, line)   # this sweep's ending of the job (echoed under submitit)
    print(line, flush=True)
    return summary


log = logging.getLogger("experiments")

#: how a job ended (status.json, the last line): it ran to its end; it ran to its end or stopped with
#: a loss or headline metric that is not finite; it raised
STATUSES = ("finished", "diverged", "failed")


def submitted() -> bool:
    """Whether this process is a job that submitit launched (launcher=local_parallel, slurm): its sweep
    waits for the job's result, so a job that fails returns (status.json says how) and never exits."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def job_name(cfg: DictConfig) -> str:
    return f"{cfg.task.name}/{cfg.task.get('folder_optim', optim_name(cfg.optim))} seed {cfg.seed}"


def headline(cfg: DictConfig) -> list:
    """The summary keys a job's last line shows: the task config's `headline:` (a nested key: a.b),
    or a rehearsal's own (experiments/common/rehearsal.py writes those keys for every task)."""
    if cfg.get("rehearse"):
        from .rehearsal import HEADLINE

        return list(HEADLINE)
    return list(OmegaConf.select(cfg, "task.headline", default=None) or [])


def _lookup(summary: dict, key: str):
    for part in key.split("."):
        if not isinstance(summary, dict) or part not in summary:
            return None
        summary = summary[part]
    return summary


def _finite(v) -> bool:
    return not (isinstance(v, float) and not math.isfinite(v))


def job_status(cfg: DictConfig, summary: dict) -> str:
    """"diverged" when the summary flags it (`diverged_at`; a rehearsal: `finite` false) or a headline
    metric is NaN or infinite; else "finished"."""
    values = [_lookup(summary, k) for k in headline(cfg)]
    flagged = summary.get("diverged_at") is not None or (bool(cfg.get("rehearse")) and summary.get("finite") is False)
    return "diverged" if flagged or not all(map(_finite, values)) else "finished"


def headline_metrics(cfg: DictConfig, summary: dict) -> str:
    """"val_loss 0.01234, subspace_distance 0.5" (a missing or null key: n/a)."""
    def show(v) -> str:
        if isinstance(v, bool) or v is None:
            return "n/a" if v is None else str(v).lower()
        return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)

    shown = [f"{k} {show(_lookup(summary, k))}" for k in headline(cfg)]
    return ", ".join(shown) or "no headline metric (the task config names none: headline: [...])"


def finished_line(cfg: DictConfig, summary: dict, out_dir) -> str:
    """The job's last line: what ran, its status (finished or diverged), its headline metrics and the
    folder it wrote."""
    wall = summary.get("wall_time_s")
    took = f" in {wall:.0f} s" if isinstance(wall, (int, float)) else ""
    return f"{job_name(cfg)}: {job_status(cfg, summary)}{took}: {headline_metrics(cfg, summary)}; wrote {out_dir}"


def failed_line(cfg: DictConfig, error: BaseException, out_dir) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{job_name(cfg)}: failed: {type(error).__name__}: {first}; wrote {out_dir} (traceback in status.json)"


def log_to_files(line: str) -> None:
    """Log an error `line` into the job's log files (run.log) alone, not on the console, where run.py
    prints the refusal's message itself; without a log file (no Hydra logging), as any error."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        log.error("%s", line)
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (line,), None)
    for h in files:
        if record.levelno >= h.level:
            h.handle(record)


STATUS_FILE = "status.json"


def write_status(out_dir: Path, status: str, line: str, **extra) -> None:
    """status.json: how the job ended and its last line (the sweep's summary and the launchers that
    run jobs elsewhere read it; experiments/common/callbacks.py)."""
    import json

    path = Path(out_dir) / STATUS_FILE
    atomic_write(path, lambda p: p.write_text(json.dumps({"status": status, "line": line, **extra}, indent=1)))


#: overrides that change how a job runs, not what it computes: a sweep resumed on another launcher
#: (or with W&B on) skips the jobs that finished
EXECUTION_KEYS = ("launcher", "logger", "skip_finished", "resume")


def _job_identity(overrides: list) -> list:
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in EXECUTION_KEYS]


def flushing_denormals() -> bool:
    """Whether this process flushes subnormal floats to zero now (torch has no getter)."""
    import torch

    return (torch.tensor([torch.finfo(torch.float32).tiny]) / 2).item() == 0.0


def _numpy_limits_before_flushing() -> None:
    """numpy measures each float type's limits the first time they are asked for and keeps them: asked
    after subnormals are flushed (MuJoCo, scipy and gymnasium ask), it finds the smallest subnormal zero
    and warns "The value of the smallest subnormal ... is zero" at every job. Measured here, before
    flushing, the limits are the true ones and nothing warns."""
    try:
        import numpy as np
    except ImportError:
        return
    for dtype in (np.float16, np.float32, np.float64, np.longdouble):
        np.finfo(dtype)


def set_cpu_numerics(cfg: DictConfig) -> None:
    """The job's CPU threads (`task.threads`; 0: torch's default, one per core) and subnormal floats
    (`flush_denormal`): both are process-wide, so each job of a sweep sets its own."""
    import torch

    threads = int(OmegaConf.select(cfg, "task.threads", default=0) or 0)
    if threads:
        torch.set_num_threads(threads)
    flush = bool(OmegaConf.select(cfg, "flush_denormal", default=False))
    if flush:
        _numpy_limits_before_flushing()
    if not torch.set_flush_denormal(flush) and flush:
        log.warning("flush_denormal=true: this CPU cannot flush subnormal floats; they stay (slow, same results)")


def run_job(cfg: DictConfig, out_dir: Path, keep_going: bool = False) -> dict | None:
    """Run the task named by `cfg.task.entry`; summary.json is written only if it returns, status.json
    (finished, diverged or failed, and the last line) however it ends but by a signal. `keep_going`
    (a sweep's job): a failure is logged and recorded, not raised, so the sweep goes on and ends with
    its counts (the sweep then exits 1); None is returned for it."""
    done = finished_summary(cfg, out_dir)
    if done is not None:
        return done
    apply_debug(cfg, out_dir)
    init_distributed(cfg)
    flushed_before = flushing_denormals()
    set_cpu_numerics(cfg)
    seed_everything(int(cfg.seed))
    task = hydra.utils.get_method("experiments.common.rehearsal.run_rehearsal" if cfg.get("rehearse")
                                  else cfg.task.entry)
    run = Run(cfg, out_dir)
    if run.is_main:
        (Path(out_dir) / STATUS_FILE).unlink(missing_ok=True)   # an earlier attempt's ending is not this one's
    failed = True
    log.info("%s: started, writing to %s", job_name(cfg), out_dir)
    interrupt.install(float(cfg.get("checkpoint_minutes", 0) or 0))
    try:
        result = run.finish(task(cfg, run))
        failed = False
        if interrupt.requested() is not None:   # acknowledged, but it came during the last step
            log.info("%s: %s", job_name(cfg), interrupt.finished_anyway())
        line = finished_line(cfg, result, out_dir)
        if run.is_main:
            write_status(out_dir, job_status(cfg, result), line)
        log.info("%s", line)
        return result
    except interrupt.JobInterrupted as e:   # a signal: the loop saved its checkpoint, then stopped
        log.info("%s: %s: checkpoint %s; it continues from there when requeued or run again with resume=true",
                 job_name(cfg), e, run.checkpoint_path)
        interrupt.hand_over(e.signum)   # submitit's handler requeues the job (and exits); otherwise it ends here
        raise SystemExit(128 + e.signum) from None
    except Exception as e:                 # the job's log says that it failed and why
        import traceback

        from .checks import ConfigError

        line = failed_line(cfg, e, out_dir)
        if run.is_main:
            write_status(out_dir, "failed", line, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        # run.py's refusals (missing input) stop a sweep run here; a submitted job returns its failure
        refused = isinstance(e, (ConfigError, FileNotFoundError)) and not submitted()
        (log_to_files if refused else log.error)(line)   # a refusal: run.py prints its message, once
        if keep_going and not refused and not os.environ.get("DOPR_TRACEBACK"):
            return None
        raise
    except KeyboardInterrupt:              # Ctrl-C before the loop had its training state (or a second one)
        log.info("%s: interrupted (Ctrl-C) before a checkpoint could be saved; %s", job_name(cfg),
                 interrupt.lost_work(run.checkpoint_path))
        raise                              # run.py ends with that line alone (exit 130)
    finally:
        interrupt.uninstall()
        run.close(failed)
        del run, task
        import torch

        torch.set_flush_denormal(flushed_before)   # the caller's setting again (a job in a notebook or a test)
        if cfg.distributed:
            from .distributed import shutdown

            shutdown(failed)
