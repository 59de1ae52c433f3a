"""Stopping a job without losing its work.

A signal (SLURM's pre-timeout or preemption signal USR2 through submitit, SIGTERM, SIGUSR1, Ctrl-C) or
the wall-time interval `checkpoint_minutes` makes the training loop save its checkpoint at the end of
the step it is in, besides the step interval (``Schedule.checkpoint``, and the loops that decide their
own checkpoints, ask :func:`due`). After a signal's checkpoint the job ends: :class:`JobInterrupted`
from ``TrainingState.save``, one line from ``run_job``, then submitit's own handler (:func:`hand_over`:
it requeues the job) or exit status 128 + the signal; the requeued job, or ``resume=true``, continues from that
step bit-identically.

A job is *armed* once its loop has restored or started its training state (``TrainingState.resume``).
The first signal of an armed job is acknowledged at once on stderr, saying when the job will stop (a
signal during the last step, or its evaluation, lets the job finish instead: ``run_job`` says so).
Before arming, and in a task that never checkpoints, a signal acts as it would without the suite
(Ctrl-C raises KeyboardInterrupt at once), as does a second Ctrl-C while the first waits for the end
of its step; ``run_job`` then names the last checkpoint, if there is one (:func:`lost_work`). Under
torch.distributed the ranks agree on every decision (one all-reduce of a flag per check), since a
checkpoint may be a collective.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


class JobInterrupted(Exception):
    """A signal stopped the job after the checkpoint of `step`."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} after the checkpoint of step {step}")
        self.signum, self.step = signum, step


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.armed = False
        self.requested: Optional[int] = None
        self.every_s = 0.0
        self.last = time.monotonic()
        self.previous: dict = {}
        self.checkpoint_step: Optional[int] = None   # the step of the checkpoint saved or resumed from last


_state = _State()


def install(checkpoint_minutes: float = 0.0) -> None:
    """Take over the signals for a job (main thread only; elsewhere a no-op) and start its wall clock."""
    global _state
    _state = _State()
    _state.every_s = 60.0 * float(checkpoint_minutes or 0.0)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        _state.previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _handler)
    _state.installed = True


def uninstall() -> None:
    """Give the signals back to whoever had them before :func:`install`."""
    if _state.installed:
        for sig, prev in _state.previous.items():
            signal.signal(sig, prev)
        _state.installed = False
    _state.armed = False


def arm(step: Optional[int] = None) -> None:
    """The loop has its training state (restored from the checkpoint of `step`; None: a fresh start):
    from now on a signal asks for a checkpoint."""
    _state.armed = True
    _state.last = time.monotonic()
    if step is not None:
        _state.checkpoint_step = int(step)


def requested() -> Optional[int]:
    return _state.requested


def _handler(signum, frame) -> None:
    if _state.armed and not (signum == signal.SIGINT and _state.requested == signal.SIGINT):
        if _state.requested is None:
            _acknowledge(signum)
        _state.requested = signum   # the loop checkpoints at the end of this step, then stops
        return
    forward(signum, frame)


def _acknowledge(signum: int) -> None:
    """One line on stderr, at once (os.write: safe inside a signal handler, which may interrupt a print)."""
    again = "; Ctrl-C again stops it at once, losing the steps since the last checkpoint" \
        if signum == signal.SIGINT else ""
    os.write(2, (f"\n{signal.Signals(signum).name} received: the job stops at the end of the step in progress "
                 f"(after its evaluation, if one is running) once it has saved its checkpoint; during the last "
                 f"step it finishes instead{again}\n").encode())


def finished_anyway() -> str:
    """What the job says when a signal asked it to stop during its last step, which it finished."""
    return (f"{signal.Signals(_state.requested).name} came during the last step (or its evaluation): the job "
            "finished instead of stopping")


def lost_work(checkpoint) -> str:
    """What an interruption without a new checkpoint leaves: the last `checkpoint` (a path; its step when
    this attempt saved or resumed from it), or nothing."""
    if not os.path.exists(checkpoint):
        return "nothing to resume from this attempt"
    step = "" if _state.checkpoint_step is None else f" (step {_state.checkpoint_step})"
    return (f"the last checkpoint is {checkpoint}{step}: resume=true (or a requeue) continues from there, "
            "the steps after it are lost")


def forward(signum: int, frame=None) -> None:
    """What the signal would have done without the suite: the previous handler (submitit's requeue,
    Python's KeyboardInterrupt), or the default action."""
    prev = _state.previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def hand_over(signum: int) -> None:
    """After the checkpoint: a handler someone else installed for the signal (submitit's, which requeues
    the job) gets it; Python's and the default actions are the caller's exit."""
    prev = _state.previous.get(signum)
    if callable(prev) and prev is not signal.default_int_handler:
        prev(signum, None)


def _agreed(flag: bool) -> bool:
    """`flag` on any rank (one all-reduce under torch.distributed)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def due() -> bool:
    """Whether the loop should checkpoint at the end of this step: a signal asked, or the wall-time
    interval passed since the last checkpoint."""
    flag = _state.requested is not None or (_state.every_s > 0 and time.monotonic() - _state.last >= _state.every_s)
    return _agreed(flag) if _state.armed else flag


def saved(step: int) -> None:
    """A checkpoint of `step` was written: the wall clock restarts; after a signal, the job stops."""
    _state.last = time.monotonic()
    _state.checkpoint_step = int(step)
    if _agreed(_state.requested is not None) and _state.armed:
        raise JobInterrupted(_state.requested or signal.SIGTERM, step)
