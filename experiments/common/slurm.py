"""launcher=slurm before submission: sbatch's refusal of the jobs' resources in one line, and a warning
when no node of the partition can hold one job."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def node_sizes(partition: str) -> list | None:
    """(CPUs, memory in MB, GPUs) of each node of `partition` from sinfo; None when sinfo cannot tell."""
    if shutil.which("sinfo") is None:
        return None
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-p", str(partition), "-o", "%c %m %G"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = []
    for line in res.stdout.splitlines() if res.returncode == 0 else []:
        cpus, mem, gres = (line.split(None, 2) + ["", "", ""])[:3]
        if not (cpus.isdigit() and mem.rstrip("+").isdigit()):
            continue
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[^:,(\s]+)?:(\d+)", gres))
        sizes.append((int(cpus), int(mem.rstrip("+")), gpus))
    return sizes or None


def oversized_warning(params: dict) -> str | None:
    """The warning for a job larger than every node of its partition (it would be refused or pend
    forever), or None (it fits one, or sinfo cannot tell)."""
    sizes = node_sizes(params.get("partition"))
    if not sizes:
        return None
    tasks = int(params.get("tasks_per_node") or 1)
    want = (int(params.get("cpus_per_task") or 1) * tasks, int(float(params.get("mem_gb") or 0) * 1024),
            int(params.get("gpus_per_node") or 0))
    if any(all(w <= have for w, have in zip(want, node)) for node in sizes):
        return None
    largest = tuple(max(node[i] for node in sizes) for i in range(3))
    show = lambda s: f"{s[0]} CPUs, {s[1] / 1024:.3g} GB, {s[2]} GPUs"
    return (f"Warning: a job asks for {show(want)} per node ({tasks} tasks x slurm.cpus_per_task, slurm.mem_gb, "
            f"slurm.gpus_per_node), more than any node of partition {params.get('partition')} has (at most "
            f"{show(largest)}): sbatch refuses it or it waits forever; ask for less (the test cluster of "
            "scripts/slurm_cluster.sh: launcher=slurm_local)")


def submission_script(params: dict, folder: Path) -> str:
    """The sbatch script submitit writes for one job with the launcher's `params` (Hydra's submitit
    launcher's mapping of them), its command replaced by `true`."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    init_keys = {"submitit_folder", "max_num_timeout"}
    executor = submitit.AutoExecutor(cluster="slurm", folder=folder)
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()
                                  if k not in init_keys and not k.startswith("_")})
    return executor._executor._make_submission_file_text("true", "test")


def sbatch_refusal(params: dict, folder: Path) -> str | None:
    """sbatch's own message when it refuses the sweep's jobs (`sbatch --test-only`: nothing is
    submitted), or None when it would take them."""
    script = Path(folder) / "test_only.sh"
    script.write_text(submission_script(params, Path(folder)))
    try:
        res = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"sbatch --test-only did not run: {e}"
    if res.returncode == 0:
        return None
    lines = [line.strip() for line in res.stderr.splitlines() if line.strip()]
    message = "; ".join(dict.fromkeys(line for line in lines if "error" in line.lower()) or lines[-1:])
    if "conf" in message and not os.environ.get("SLURM_CONF"):
        message += (" (SLURM_CONF is not set: the test cluster of scripts/slurm_cluster.sh needs "
                    "export SLURM_CONF=<its dir>/slurm.conf, which its `start` prints)")
    return message or f"sbatch --test-only exited {res.returncode}"


class CheckSlurmRequest(Callback):
    """launcher=slurm: before anything is submitted, a warning when a job asks for more than any node of
    the partition has (sinfo), and sbatch's own refusal of the request in one line (sbatch --test-only)
    instead of submitit's traceback. SystemExit: Hydra turns a callback's exceptions into warnings."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        params = OmegaConf.to_container(config.hydra.launcher, resolve=True)
        warning = oversized_warning(params)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="dopr-sbatch-") as folder:
            message = sbatch_refusal(params, Path(folder))
        if message:
            print(f"Error: sbatch refuses the sweep's jobs: {message}; nothing was submitted", file=sys.stderr)
            sys.exit(2)
