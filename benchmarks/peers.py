"""The step cost of DoPr's published peers (SOAP, Shampoo, PSGD-Kron) against AdamW, timed as
``benchmarks.bench`` times DoPr: one benchmark task, a fresh seeded copy of its model per row, round-robin.

Rows: AdamW (the reference), DoPr-AdamW at precond_every=1 (in the same time window, so the two are
compared directly), and each peer through its published package with the package's documented defaults
(``PEERS``: SOAP with precondition_frequency=10). A peer whose package is absent, or that raises when
it is built or stepped, is a row that says so; the other rows go on.

    t   as benchmarks.bench's t: the median of the timed steps (forward, backward, step, zero_grad); a peer
        that refreshes its preconditioner on one step in f (SOAP) is amortised as DoPr's k>1 rows are,
        ((f-1) median(other steps) + median(refresh steps)) / f.
    R   t / t_AdamW.

Round-robin: every round steps AdamW and then each row that is not yet done (benchmarks.bench.Row.done);
AdamW steps until all are, so its steps span every row's time window, and a done row sits out instead of
stepping on for a slower one. Under a time allowance (``bench_peers(seconds=...)``, the GPU check's), a
row also stops at its share of it, so one slow peer (a Shampoo step may take seconds) cannot starve the rest.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import torch

from benchmarks.bench import WARMUP, Row, make_task, soap_refreshed

#: the pyproject extra that installs the peers' packages (and `make gpu-deps` carries to a GPU machine)
EXTRA = "peers"


@dataclass(frozen=True)
class Peer:
    """A published optimizer: ``module.cls(params, **kwargs)`` from the distribution ``dist``. ``every``:
    the key of the built optimizer's defaults that holds its refresh period (None: it refreshes every
    step); ``refreshed(opt)``: whether the step just taken refreshed the preconditioner; ``needs``: the
    (module, distribution, why) it runs badly without, though its package does not declare them."""

    label: str
    dist: str
    module: str
    cls: str
    kwargs: dict = field(default_factory=dict)
    every: str | None = None
    refreshed: Callable | None = None
    needs: tuple = ()

    def check(self) -> None:
        """Raise PeerMissing, one line, when the package or one it needs is not installed here."""
        for module, dist, why in [(self.module, self.dist, ""), *self.needs]:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                raise PeerMissing(f"{dist} is not installed{why} (pyproject's `{EXTRA}` extra; `make gpu-deps` "
                                  f"carries it to a GPU machine)")

    def build(self, params):
        return getattr(importlib.import_module(self.module), self.cls)(params, **self.kwargs)

    def period(self, opt) -> int:
        return int(opt.defaults[self.every]) if self.every else 1

    def describe(self) -> str:
        """``pytorch-optimizer 4.1.0, pytorch_optimizer.SOAP(precondition_frequency=10)``."""
        try:
            version = metadata.version(self.dist)
        except metadata.PackageNotFoundError:   # importable without its .dist-info
            version = "(version unknown)"
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.dist} {version}, `{self.module}.{self.cls}({args})`"

    def defaults(self) -> str:
        """The keyword defaults of the class's signature, with ``kwargs`` over them: what ran."""
        sig = inspect.signature(getattr(importlib.import_module(self.module), self.cls))
        values = {n: p.default for n, p in sig.parameters.items()
                  if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
        return ", ".join(f"{k}={v!r}" for k, v in {**values, **self.kwargs}.items())


class PeerMissing(Exception):
    """The peer's package is not installed here."""


#: Shampoo recomputes every inverse root (an SVD per dimension of every parameter) on every step at its
#: default preconditioning_compute_steps=1; PSGD-Kron's default schedule updates its preconditioner with
#: probability 1 for the first 500 steps (then decaying to 0.03), so every step timed here updates it.
#: Kron applies its preconditioner by one 5-operand torch.einsum, which torch contracts left to right unless
#: opt_einsum is installed: through the outer product of the gradient with itself, (m n)^2 numbers for an
#: m x n weight (31.7 GB for a 348 x 256 Linear).
PEERS = [
    Peer("soap f=10", "pytorch-optimizer", "pytorch_optimizer", "SOAP", {"precondition_frequency": 10},
         every="precondition_frequency", refreshed=soap_refreshed),
    Peer("shampoo", "pytorch-optimizer", "pytorch_optimizer", "Shampoo"),
    Peer("psgd_kron", "pytorch-optimizer", "pytorch_optimizer", "Kron",
         needs=(("opt_einsum", "opt-einsum", ", which Kron's einsum needs to contract in a sane order"),)),
]


class PeerRow(Row):
    """A peer on its own seeded copy of the task's model, timed by benchmarks.bench.Row's step; a peer
    with a refresh period f files its steps as refresh or other steps, as a DoPr row with k = f does.
    Its first WARMUP steps are untimed steps of the round-robin (not of the constructor), so that the
    caller's time allowance covers them too: a Shampoo step may take seconds."""

    def __init__(self, task, peer: Peer, device):
        self.peer, self.label, self.cuda = peer, peer.label, device == "cuda"
        self.mem0 = torch.cuda.memory_allocated() if self.cuda else 0
        self.model, self.x, self.y, self.loss_fn = make_task(task, device)
        self.forward = self.model
        self.opt = peer.build(self.model.parameters())
        self.k = peer.period(self.opt)
        self.refresh, self.other, self.spent, self.transient, self.resident, self.warm = [], [], 0.0, 0, 0, 0

    def step(self, record=True):
        record, self.warm = record and self.warm >= WARMUP, self.warm + 1
        every, self.k = self.k, 1   # Row.step files a k=1 step as a refresh (it asks DoPr's counters otherwise)
        try:
            super().step(record)
        finally:
            self.k = every
        if self.cuda and self.warm == WARMUP:   # model, batch and optimizer state, resident between steps
            self.resident = torch.cuda.memory_allocated() - self.mem0
        if record and self.k > 1 and not self.peer.refreshed(self.opt):
            self.other.append(self.refresh.pop())


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def bench_peers(task, device, repeats, budget, dopr_options=None, peers=None, seconds=None) -> list:
    """The rows of one task: [{label, package, status ("ok", "missing: ...", "failed ...", "out of time ..."),
    and for a row that ran n, t, R, state, peak (CUDA)}], AdamW first, then DoPr-AdamW k=1, then each peer
    in order. ``seconds``: the time the call may take (None: unbounded). What is left of it once the rows
    are built is shared out among the rows, a done row's unused part going to the others: a row stops
    stepping when it has had its share (a Shampoo step may take seconds: a slow peer cannot starve the
    others), and a row stopped with too few timed steps says so instead of a number."""
    start, peers = time.monotonic(), PEERS if peers is None else peers
    gp = Row(task, "adamw", 0, device)
    rows, out = [gp, Row(task, "adamw", 1, device, options=dopr_options)], {}
    out[gp.label] = {"package": "torch.optim.AdamW (dopr.build)"}
    out[rows[1].label] = {"package": "dopr (this checkout), DoPr over torch.optim.AdamW"}
    for peer in peers:
        out[peer.label] = {"package": peer.dist}
        try:
            peer.check()
            out[peer.label].update(package=peer.describe(), defaults=peer.defaults())
            rows.append(PeerRow(task, peer, device))
        except PeerMissing as e:
            out[peer.label]["status"] = f"missing: {e}"
        except Exception as e:  # noqa: BLE001  (a peer that fails here is its row's status; the others run)
            out[peer.label]["status"] = f"failed when built: {one_line(e)}"
    left = None if seconds is None else max(seconds - (time.monotonic() - start), 0.0)
    used = dict.fromkeys(rows, 0.0)

    def stepping(r):
        """AdamW steps while any other row does (and until it is done); another row until it is done or has
        used its share: what is left of `seconds` after AdamW's steps and the done rows', over the others."""
        if r.done(repeats, budget):
            return False
        if r is gp or left is None:
            return True
        others = [q for q in rows if q is not gp]
        done = [q for q in others if q.done(repeats, budget)]
        return used[r] < (left - used[gp] - sum(used[q] for q in done)) / (len(others) - len(done))

    while any(stepping(r) for r in rows if r is not gp) or stepping(gp):
        for r in [r for r in rows if r is gp or stepping(r)]:
            t0 = time.monotonic()
            try:
                r.step()
            except Exception as e:  # noqa: BLE001
                if not isinstance(r, PeerRow):
                    raise
                out[r.label]["status"] = f"failed in its step {r.warm}: {one_line(e)}"
                rows.remove(r)
                if device == "cuda":
                    torch.cuda.empty_cache()
            used[r] += time.monotonic() - t0
    t_gp = gp.result()["t"]
    for r in rows:
        getattr(r.opt, "close", lambda: None)()
        if not r.refresh or (r.k > 1 and not r.other):   # stopped at its share before a step of each kind
            timed = len(r.refresh) + len(r.other)
            out[r.label]["status"] = (f"out of time: {getattr(r, 'warm', WARMUP + timed)} steps, {timed} timed"
                                      + (", none that refreshes" if r.k > 1 and not r.refresh else "")
                                      + f", in {used[r]:.1f} s (its share of the {seconds:g} s ran out)")
            continue
        res = r.result()
        out[r.label].update(status="ok", n=res["n"], t=res["t"], R=res["t"] / t_gp, state=res["state"],
                            peak=res.get("peak"))
    print(f"[peers] {task}: " + ", ".join(f"{k} R {v['R']:.2f}" if "R" in v else f"{k} {v['status']}"
                                          for k, v in out.items()), file=sys.stderr, flush=True)
    return [{"label": label, **row} for label, row in out.items()]


def table(rows, cuda) -> str:
    cols = ["run", "package, class", "n", "t_step (ms)", "R vs AdamW", "opt state (MB)"] + ["peak CUDA (MB)"] * cuda
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["label"], f"{r['package']}: {r['status']}"] + [""] * (len(cols) - 2)
        else:
            cells = [r["label"], r["package"], r["n"], f"{1e3 * r['t']:.1f}", f"{r['R']:.2f}", f"{r['state']:.2f}"]
            cells += [f"{r['peak']:.0f}"] if cuda else []
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
