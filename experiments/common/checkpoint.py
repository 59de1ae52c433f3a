"""One training-state checkpoint for every family: what a job needs to continue exactly where it
stopped (a requeued or preempted job ends bit-identical to one that ran through).

    state = TrainingState(model=model, ema=ema, optimizer=opt, scheduler=sched, generators={"data": gen})
    start, extra = state.resume(run)            # (0, {}) on a fresh start
    ...
    state.save(run, step, returns=returns)      # atomically, through the Run (metrics cut back on resume)

Saved with it: the run's clock (training, evaluation and wall time so far), restored on resume.

Saved: the state_dict of each object given (model, EMA, optimizer, scheduler: anything with
state_dict / load_state_dict), the step, every global random-number state (python, numpy, torch CPU
and, when CUDA is up, every CUDA device), the named generators of the job (torch.Generator or
numpy.random.Generator), and any extra values.
"""
from __future__ import annotations

import logging
import random
from typing import Optional

import numpy as np
import torch

from . import interrupt

FORMAT = 2

log = logging.getLogger("experiments")   # the job's run.log and console (Hydra's logging)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _generator_state(g):
    return g.get_state() if isinstance(g, torch.Generator) else g.bit_generator.state


def _set_generator_state(g, state) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    else:
        g.bit_generator.state = state


class TrainingState:
    """The objects a job's checkpoint holds (any of them may be None)."""

    def __init__(self, model=None, ema=None, optimizer=None, scheduler=None, generators: Optional[dict] = None):
        self.objects = {k: v for k, v in (("model", model), ("ema", ema), ("optimizer", optimizer),
                                          ("scheduler", scheduler)) if v is not None}
        self.generators = dict(generators or {})

    def state_dict(self, step: int, **extra) -> dict:
        return {"format": FORMAT, "step": int(step), "rng": rng_state(),
                "generators": {k: _generator_state(g) for k, g in self.generators.items()},
                **{k: o.state_dict() for k, o in self.objects.items()}, "extra": extra}

    def load_state_dict(self, state: dict) -> tuple:
        """Restore everything; (step, extra)."""
        if state.get("format") != FORMAT:
            raise ValueError("checkpoint.pt was written by an older version of the suite (no training-state "
                             f"format {FORMAT}); delete it to restart the job from step 0")
        missing = sorted(set(self.objects) - set(state)) + sorted(set(self.generators) - set(state["generators"]))
        if missing:
            raise ValueError(f"checkpoint.pt has no state for {missing}: it was written by another task or config")
        for k, o in self.objects.items():
            o.load_state_dict(state[k])
        for k, g in self.generators.items():
            _set_generator_state(g, state["generators"][k])
        set_rng_state(state["rng"])
        return state["step"], state["extra"]

    def save(self, run, step: int, **extra) -> None:
        """Save; after a stop signal (experiments/common/interrupt.py) the job then ends, JobInterrupted."""
        run.save_checkpoint({**self.state_dict(step, **extra), "clock": run.clock.state_dict()})
        interrupt.saved(step)

    def resume(self, run) -> tuple:
        """(step, extra) of the run's last checkpoint, everything restored (the run's clock too);
        (0, {}) when there is none. Says which, and from here on a signal asks for a checkpoint."""
        state = run.load_checkpoint()
        if state is None:
            interrupt.arm()
            if getattr(run, "cfg", None) is not None and run.cfg.get("resume"):
                log.info("resume=true: %s does not exist (the earlier attempt stopped before its first checkpoint): "
                         "starting from step 0", run.checkpoint_path)
            return 0, {}
        step, extra = self.load_state_dict(state)
        if "clock" in state:  # a checkpoint of an earlier version has none: its times start again
            run.clock.load_state_dict(state["clock"])
        interrupt.arm(step)
        log.info("resuming from step %s", step)
        return step, extra
