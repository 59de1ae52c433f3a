"""Where the time of a training step goes, from torch.profiler over a few steps: wall time against the
device's busy time (launch-bound steps), kernels, host syncs and the top kernels.

    from dopr.profiling import profile_steps, table
    p = profile_steps(lambda: (loss_fn(model(x), y).backward(), opt.step(), opt.zero_grad()), steps=3, device="cuda")
    print(table([("dopr_adamw", p)]))
"""
from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

#: runtime calls that block the host until the device has caught up (cudaMemcpy without Async is synchronous)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpy")
#: DoPr's step names its phases (record_function spans: ``dopr.factor 3 x (385, 385)``, ``dopr.apply ...``)
PHASE_PREFIX = "dopr."
#: device-side events that are copies or fills, not kernels
_NOT_KERNELS = ("Memcpy", "Memset", "memcpy", "memset")


def device_events(events) -> list:
    """The device's kernels, copies and fills among profiler events, not ``record_function`` spans (which would
    count other kernels' time twice: flagged ``is_user_annotation``, or with a host-side twin of the same name)."""
    host = {e.key for e in events if e.device_type == DeviceType.CPU}
    return [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
            and not getattr(e, "is_user_annotation", False) and e.key not in host]


def profile_steps(step, steps: int = 3, device="cuda", top: int = 5) -> dict:
    """Profile ``steps`` calls of ``step()`` (warmed up first). Per step: ``wall_ms``, ``busy_ms`` (the device's
    kernel, copy and fill times; None on CPU), ``kernels`` (None on CPU), ``syncs`` ({runtime call: count}, the
    measurement's own left out), ``top`` ([(name, ms, share of busy time)] of the longest kernels; CPU: ops by
    self time) and ``phases`` ([(DoPr's phase span, ms)], longest first)."""
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    if cuda:
        on_device = device_events(events)
        busy = sum(e.self_device_time_total for e in on_device) / 1e3
        kernels = sum(e.count for e in on_device if not any(s in e.key for s in _NOT_KERNELS))
        ranked = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)
        timed = [(e.key, e.self_device_time_total / 1e3) for e in ranked[:top]]
        syncs = {e.key: e.count for e in events if e.key in SYNCS}
        syncs["cudaDeviceSynchronize"] = syncs.get("cudaDeviceSynchronize", 1) - 1   # the measurement's own
        syncs = {k: v / steps for k, v in syncs.items() if v}
    else:
        busy = kernels = None
        syncs = {}
        ranked = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                        reverse=True)
        timed = [(e.key, e.self_cpu_time_total / 1e3) for e in ranked[:top]]
    total = busy if cuda else wall * 1e3
    spans = [e for e in events if e.key.startswith(PHASE_PREFIX) and
             (e.device_type == DeviceType.CUDA if cuda else e.device_type == DeviceType.CPU)]
    phases = sorted(((e.key, (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / steps) for e in spans),
                    key=lambda kv: kv[1], reverse=True)
    return {"steps": steps, "device": "cuda" if cuda else "cpu", "wall_ms": wall * 1e3 / steps, "phases": phases,
            "busy_ms": None if busy is None else busy / steps,
            "kernels": None if kernels is None else kernels / steps, "syncs": syncs,
            "top": [(name, ms / steps, ms / total if total else 0.0) for name, ms in timed]}


def _short(name: str, width: int = 48) -> str:
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[: width - 3] + "..."


def table(rows) -> str:
    """Markdown: one line per (label, profile_steps result)."""
    cuda = any(p["device"] == "cuda" for _, p in rows)
    what = "top kernels (ms/step, share of busy)" if cuda else "top ops by self CPU time (ms/step, share of wall)"
    out = [f"| row | steps | wall ms/step | GPU busy ms/step | busy / wall | kernels/step | host syncs/step | {what} |",
           "|---|---|---|---|---|---|---|---|"]
    for label, p in rows:
        busy = p["busy_ms"]
        cells = [label, str(p["steps"]), f"{p['wall_ms']:.1f}", "-" if busy is None else f"{busy:.1f}",
                 "-" if busy is None else f"{busy / p['wall_ms']:.2f}",
                 "-" if p["kernels"] is None else f"{p['kernels']:.0f}",
                 ("-" if p["device"] != "cuda" else
                  ", ".join(f"{k} {v:g}" for k, v in p["syncs"].items()) or "0"),
                 "; ".join(f"`{_short(n)}` {ms:.2f} ({share:.0%})" for n, ms, share in p["top"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def phases_line(label: str, p: dict, top: int = 6) -> str:
    """One markdown bullet: a profiled row's DoPr phases, longest first (``-`` when it has none)."""
    items = "; ".join(f"`{name.removeprefix(PHASE_PREFIX)}` {ms:.2f}" for name, ms in p.get("phases", [])[:top])
    return f"- {label}: {items or '-'}"
