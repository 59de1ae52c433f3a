"""The parts of a training loop every family shares: the step's batches from a resumable data
loader, a clock whose totals survive a resume, and the schedule of logging, evaluation and
checkpoints.

    schedule = Schedule(t.steps, t.log_every, evaluate_at=every(t.steps, t.eval_every))
    state = TrainingState(model=model, optimizer=opt, ...)
    start, extra = state.resume(run)                  # also restores run.clock
    batches = resumable_batches(loader, start)
    for step in range(start + 1, t.steps + 1):
        epoch, (batch,) = next(batches)
        with run.clock.training(device):
            ...                                       # forward, backward, optimizer step
        if schedule.log(step):
            ...
            if schedule.evaluate(step):
                with run.clock.evaluating():
                    ...
        if schedule.checkpoint(step):
            state.save(run, step, ...)
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Iterable, Iterator, Optional

import torch

from . import interrupt


def resumable_batches(loader, start: int, per_step: int = 1) -> Iterator[tuple]:
    """(epoch, [the `per_step` batches of one step]) for every step after `start`, without end.

    The loader's sampler is set to the epoch of step `start` and the batches of the steps already
    taken in it are skipped, so a resumed job sees the batches an unbroken one does. An epoch whose
    last batches do not fill a step drops them (gradient accumulation over `per_step` micro-batches)."""
    per_epoch = len(loader) // per_step
    if per_epoch < 1:
        raise ValueError(f"the data loader has {len(loader)} batches per epoch, fewer than the {per_step} of a step")
    epoch = start // per_epoch
    loader.sampler.set_epoch(epoch)
    batches = itertools.islice(iter(loader), (start % per_epoch) * per_step, None)
    while True:
        group = list(itertools.islice(batches, per_step))
        if len(group) < per_step:
            epoch += 1
            loader.sampler.set_epoch(epoch)
            batches = iter(loader)
            continue
        yield epoch, group


class Clock:
    """A job's training, evaluation and wall time. Its totals go into the training state, so a
    resumed job reports the time of all its parts (the wall time lost between the last checkpoint
    and an interruption is not counted)."""

    def __init__(self) -> None:
        self.train = 0.0
        self.eval = 0.0
        self._wall_before = 0.0
        self._started = time.time()
        self.used = False

    @contextlib.contextmanager
    def training(self, device: Optional[torch.device] = None):
        """Time a training step (on CUDA, up to the end of its kernels)."""
        self.used = True
        tic = time.perf_counter()
        yield
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        self.train += time.perf_counter() - tic

    @contextlib.contextmanager
    def evaluating(self):
        self.used = True
        tic = time.perf_counter()
        yield
        self.eval += time.perf_counter() - tic

    def times(self) -> dict:
        """train_time_s and eval_time_s for summary.json, when the loop timed its steps with the clock."""
        return {"train_time_s": self.train, "eval_time_s": self.eval} if self.used else {}

    def wall(self) -> float:
        return self._wall_before + time.time() - self._started

    def state_dict(self) -> dict:
        return {"train_time": self.train, "eval_time": self.eval, "wall_time": self.wall()}

    def load_state_dict(self, state: dict) -> None:
        self.train, self.eval = float(state["train_time"]), float(state["eval_time"])
        self.used = self.used or self.train > 0 or self.eval > 0
        self._wall_before, self._started = float(state["wall_time"]), time.time()


def every(steps: int, interval: int, key: str = "the evaluation interval") -> set:
    """Every `interval`-th step and the last one; none when `interval` is 0."""
    if interval < 0:
        raise ValueError(f"{key} must be >= 0, got {interval}")
    if not interval:
        return set()
    return set(range(int(interval), int(steps) + 1, int(interval))) | {int(steps)}


class Schedule:
    """When a loop of `steps` steps logs (every `log_every` steps, at each evaluation and at the last
    step), evaluates (the steps in `evaluate_at`) and saves a checkpoint (every `checkpoint_every`
    steps before the last, 0: never; and when interrupt.due() says so)."""

    def __init__(self, steps: int, log_every: int, evaluate_at: Iterable[int] = (), checkpoint_every: int = 0,
                 evaluate_key: str = "the evaluation steps"):
        self.steps, self.log_every = int(steps), int(log_every)
        self.evaluate_at = {int(s) for s in evaluate_at}
        self.checkpoint_every = int(checkpoint_every or 0)
        if self.steps < 1 or self.log_every < 1:
            raise ValueError(f"task.steps and task.log_every must be >= 1, got {steps} and {log_every}")
        outside = sorted(s for s in self.evaluate_at if not 1 <= s <= self.steps)
        if outside:
            raise ValueError(f"{evaluate_key} must lie in [1, task.steps={self.steps}], got {outside}")

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step in self.evaluate_at or step == self.steps

    def evaluate(self, step: int) -> bool:
        return step in self.evaluate_at

    def checkpoint(self, step: int) -> bool:
        """Every `checkpoint_every` steps before the last, and after any step when a signal or the
        wall-time interval asks (experiments/common/interrupt.py)."""
        periodic = bool(self.checkpoint_every) and step % self.checkpoint_every == 0
        return step < self.steps and (periodic or interrupt.due())
