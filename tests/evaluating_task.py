"""A task whose last step runs a long evaluation, as BC's does (tests/suite/test_interrupt.py signals a job
during it): `task.steps` steps of a linear model, a checkpoint every `task.checkpoint_every` steps, and
at the last step an evaluation that writes `evaluating` into the job folder and then takes
`task.eval_s` seconds."""
import time
from pathlib import Path

import torch

from experiments.common.checkpoint import TrainingState
from experiments.common.loop import Schedule


def run(cfg, run) -> dict:
    t = cfg.task
    schedule = Schedule(t.steps, 1, evaluate_at=[t.steps], checkpoint_every=t.checkpoint_every)
    model = torch.nn.Linear(2, 1)
    opt = run.build_optimizer(model)
    state = TrainingState(model=model, optimizer=opt)
    start, _ = state.resume(run)
    for step in range(start + 1, t.steps + 1):
        loss = model(torch.ones(4, 2)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if schedule.evaluate(step):
            (Path(run.dir) / "evaluating").write_text(str(step))
            end = time.monotonic() + float(t.eval_s)
            while time.monotonic() < end:
                time.sleep(0.02)
        run.log({"loss": loss.item()}, step)
        if schedule.checkpoint(step):
            state.save(run, step)
    return {"loss": loss.item()}


CONFIG = """name: evaluating
entry: evaluating_task.run
headline: [loss]
steps: 4
checkpoint_every: 2
eval_s: 2
threads: 1
"""


def write_config(folder):
    """A config search path with task/evaluating.yaml; pass hydra.searchpath=[file://<folder>]."""
    (Path(folder) / "task").mkdir(parents=True, exist_ok=True)
    (Path(folder) / "task" / "evaluating.yaml").write_text(CONFIG)
    return Path(folder)
