"""A rehearsal of a paper-scale job on a laptop: `python run.py -m sweep=<paper sweep> rehearse=true`.

Each job builds its real model at its real size (a family may cut the depth of a model that does not
fit this machine, and says so), feeds it one synthetic batch of the real shapes again and again for
`task.rehearsal.steps` steps with the job's optimizer (DoPr with its health report on the first and
last steps), and writes in summary.json instead of a training run's metrics: whether the loss is
finite and falls on the repeated batch, the coverage and the AP health, the step time here (the median
of the steps between the first and the last, which neither allocate nor report), the bytes of
parameters, optimizer state and DoPr's own state, and the peak memory (on CPU the process's peak RSS,
on CUDA the peak of memory allocated by tensors: `peak_rss_MB` or `peak_cuda_alloc_MB`). A mistake that would waste a
cluster run (a shape, a config value, a layer DoPr cannot handle, a loss that does not move) shows in
minutes.

    python -m experiments.common.rehearsal multirun/rehearsal/* --out results/rehearsal.md   # the table
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import open_dict

import dopr
from dopr.health import WEAK_SHARE_WARNING

from .optim import optim_identity

COLUMNS = ["sweep", "task", "optimizer", "model", "batch", "params_M", "loss_first", "loss_last", "falls",
           "preconditioned", "weak_layers", "worst_weak_share", "step_s", "param_MB", "opt_state_MB",
           "dopr_state_MB", "peak_rss_MB", "verdict"]
#: what a rehearsal's last line shows, for every task (a loss that is not finite makes it "diverged")
HEADLINE = ("loss_first", "loss_last", "step_s", "verdict")
#: the peak-memory column by device: what each measures differs (peak_memory_mb)
MEMORY_COLUMNS = {"cpu": "peak_rss_MB", "cuda": "peak_cuda_alloc_MB"}


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in nested dicts / lists / tuples (a state dict); benchmarks/ reads it too."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def reset_peak_memory(device) -> bool:
    """Start this job's peak-memory count afresh (a local sweep runs its jobs in one process): CUDA's
    allocator peak, or Linux's peak RSS (VmHWM, reset by writing 5 to /proc/self/clear_refs). False
    where the peak cannot be reset: the count then includes the process's earlier jobs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:   # Linux: the peak RSS since the last reset, in kB
        status = Path("/proc/self/status").read_text()
        return int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:"))) / 2**10
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10   # the process's peak


def device_label(device) -> str:
    """"cpu", or "cuda (<GPU name>)": the rehearsal table's title names where its rows ran."""
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else device.type


def rehearse(cfg, run, model: torch.nn.Module, loss_fn, model_name: str, batch: int, clip=None) -> dict:
    """`task.rehearsal.steps` optimizer steps of `model` on `loss_fn()` (the same synthetic batch each
    time); the summary.json fields of the rehearsal (see the module docstring)."""
    steps = int(cfg.task.rehearsal.steps)
    if steps < 3:
        raise ValueError(f"task.rehearsal.steps must be >= 3 (the first step allocates, the last reports the AP's "
                         f"health, the ones between are timed), got {steps}")
    # health reports (one eigh per layer) on the first and last steps, unless the task says the eigh at its
    # widths costs too much here (task.rehearsal.health=false: the table then says "not measured")
    health = bool(cfg.task.rehearsal.get("health", True))
    if optim_identity(cfg.optim)[1] and health:
        with open_dict(cfg):
            cfg.ap.health_every = steps - 1
    fresh = reset_peak_memory(run.device)   # the model is built: the peak counts from its weights on
    opt = run.build_optimizer(model)
    losses, times, shares = [], [], {}   # shares: each layer's largest weak share over the steps
    for _ in range(steps):
        tic = time.perf_counter()
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
        losses.append(float(loss.detach()))
        for k, h in (opt.stats().get("health", {}) if isinstance(opt, dopr.DoPr) else {}).items():
            if h.get("weak_share") is not None:
                shares[k] = max(shares.get(k, 0.0), h["weak_share"])
        run.log({"train_loss": losses[-1], "step_s": times[-1]}, len(losses))
    state = opt.state_dict()
    out = {"rehearsal": True, "model": model_name, "batch": int(batch),
           "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
           "trainable_M": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
           "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
           "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
           "falls": losses[-1] < losses[0],
           "step_s": statistics.median(times[1:-1]),   # the first allocates, the last reports the health
           "param_MB": tensor_bytes(dict(model.state_dict())) / 2**20,
           "opt_state_MB": tensor_bytes(state) / 2**20,
           "dopr_state_MB": tensor_bytes(state.get("dopr", {})) / 2**20}
    if isinstance(opt, dopr.DoPr):
        cov = opt.coverage()
        weak = sorted((k for k, v in shares.items() if v > WEAK_SHARE_WARNING), key=shares.get, reverse=True)
        out.update(preconditioned=f"{sum(e.status == 'preconditioned' for e in cov)}/{len(cov)}",
                   weak_layers=len(weak) if health else "not measured", weak_layer_names=weak,
                   worst_weak_share=max(shares.values(), default=None),
                   worst_weak_layer=max(shares, key=shares.get) if shares else None)
    out["device"] = device_label(run.device)
    out[MEMORY_COLUMNS.get(run.device.type, "peak_rss_MB")] = peak_memory_mb(run.device)
    out["peak_since"] = "this job's steps" if fresh else "the process's start (earlier jobs included)"
    problems = ([] if out["finite"] else ["loss not finite"]) + ([] if out["falls"] else ["loss does not fall"])
    if isinstance(out.get("weak_layers"), int) and out["weak_layers"]:
        names = ", ".join(out["weak_layer_names"][:3]) + (", ..." if out["weak_layers"] > 3 else "")
        problems.append(f"{out['weak_layers']} layer(s) in the weak-direction regime ({names})")
    out["verdict"] = "ok" if not problems else "; ".join(problems)
    if isinstance(opt, dopr.DoPr) and not health:
        out["verdict"] += " (AP health not measured: task.rehearsal.health=false)"
    return out


def run_rehearsal(cfg, run) -> dict:
    """The job of `rehearse=true`: the task's `rehearse:` function instead of its training."""
    import hydra

    return hydra.utils.get_method(cfg.task.rehearse)(cfg, run)


def row(s: dict, sweep: str) -> dict:
    """The table's row of one rehearsal summary, with its device and its peak in the column of that
    device's measure (summaries written before the device was recorded ran on CPU)."""
    device = s.get("device") or ("cuda" if MEMORY_COLUMNS["cuda"] in s else "cpu")
    memory = MEMORY_COLUMNS.get(device.split()[0], "peak_rss_MB")
    out = {"sweep": sweep, "task": s["task"], "optimizer": s["optim"], "device": device,
           **{k: s.get(k, "") for k in COLUMNS[3:] if k != "peak_rss_MB"}, memory: s.get(memory, "")}
    if s.get("peak_since") != "this job's steps" and memory in s:   # counted from the process's start
        out[memory] = f"{s[memory]:.4g}*"
    return out


def table(sweeps: list) -> list:
    """One row per rehearsal summary under `sweeps` (see row)."""
    rows = []
    for sweep in sweeps:
        for path in sorted(Path(sweep).rglob("summary.json")):
            s = json.loads(path.read_text())
            if s.get("rehearsal"):
                rows.append(row(s, Path(sweep).name))
    return rows


def columns_and_title(rows: list) -> tuple:
    """The table's columns (the device's only where several ran; each peak-memory measure that occurs)
    and its title."""
    devices = sorted({r["device"] for r in rows})
    memory = [c for c in MEMORY_COLUMNS.values() if any(c in r for r in rows)]
    columns = [c for c in COLUMNS if c != "peak_rss_MB"][:-1] + memory + ["verdict"]
    if len(devices) > 1:
        columns.insert(3, "device")
    where = " and ".join(d.upper() if d == "cpu" else "CUDA" + d[4:] for d in devices)
    return columns, memory, f"Rehearsals of the paper sweeps: the real models at their real sizes on synthetic batches, {where}"


def stamp_note(memory: list) -> str:
    return (". The AP health is measured on the rehearsal batch: a few samples give a low-rank Sigma, so "
            "the weak layers flagged here bound those of the real batch from above; the peak memory ("
            + "; ".join({"peak_rss_MB": "peak_rss_MB: the process's peak RSS on CPU",
                         "peak_cuda_alloc_MB": "peak_cuda_alloc_MB: the peak of CUDA memory allocated by tensors, "
                                               "torch.cuda.max_memory_allocated"}[c] for c in memory)
            + ") counts from the built model (the synthetic batch, the optimizer and the steps); *: from the "
            "process's start, the earlier jobs of a local sweep included")


def report(records: list, out_dir, stamp: str) -> list:
    """`python -m experiments.report <rehearsal sweep>`: a rehearsal has no training curve, so not the
    task's figures but this table (rehearsal.{md,csv} in out_dir), as `python -m
    experiments.common.rehearsal` writes it. Returns its rows."""
    from .report import write_table

    rows = [row(r["summary"], r["dir"].parent.name) for r in records]
    columns, memory, title = columns_and_title(rows)
    write_table(rows, columns, Path(out_dir) / "rehearsal", stamp.rstrip(".") + stamp_note(memory), title)
    return rows


def main(argv=None) -> None:
    from .provenance import git_revision
    from .report import write_table

    p = argparse.ArgumentParser(description="the rehearsals of paper sweeps (rehearse=true) as one table")
    p.add_argument("sweeps", nargs="+")
    p.add_argument("--out", required=True, help="the table's path without suffix, or ending in .md")
    args = p.parse_args(argv)
    rows = table(args.sweeps)
    if not rows:
        sys.exit(f"no rehearsal summaries under {args.sweeps}: run `python run.py -m sweep=<paper sweep> rehearse=true`")
    columns, memory, title = columns_and_title(rows)
    stamp = (f"`python -m experiments.common.rehearsal {' '.join(args.sweeps)} --out {args.out}`, commit "
             f"{git_revision()}, torch {torch.__version__}")
    write_table(rows, columns, Path(args.out).with_suffix(""), stamp + stamp_note(memory), title)


if __name__ == "__main__":
    main()
