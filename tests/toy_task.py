"""A task that lives outside the suite (tests/suite/test_jobs.py adds its config through hydra.searchpath):
proof that a new task needs no edit in experiments/common. Its job returns `task.value` as `toy_metric`,
or raises when `task.outcome=fail` (`missing`: as a job whose input file is missing)."""


def run(cfg, run) -> dict:
    if cfg.task.outcome == "fail":
        raise RuntimeError("the toy task was told to fail")
    if cfg.task.outcome == "missing":
        raise FileNotFoundError("the toy task's input file is missing")
    run.log({"toy_metric": float(cfg.task.value)}, 1)
    return {"toy_metric": float(cfg.task.value), "toy_label": "ok"}


CONFIG = """name: toy
entry: toy_task.run
report: experiments.theory.report.feature_learning
headline: [toy_metric, toy_label]
value: 1.0
outcome: ok
threads: 1
"""


def write_config(folder):
    """A config search path with task/toy.yaml; pass hydra.searchpath=[file://<folder>]."""
    from pathlib import Path

    (Path(folder) / "task").mkdir(parents=True, exist_ok=True)
    (Path(folder) / "task" / "toy.yaml").write_text(CONFIG)
    return Path(folder)
