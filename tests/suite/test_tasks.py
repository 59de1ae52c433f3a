"""The task configs carry the per-task facts (entry, report, headline, rehearsal): conf/task/ lists the
tasks a job can run, conf/task_base/ the settings a family shares, and docs/suite.md's table is theirs."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra")

from experiments.common import tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


@pytest.mark.parametrize("task", tasks.task_names())
def test_the_task_config_read_from_its_files_is_what_hydra_composes(task, compose):
    composed = OmegaConf.to_container(compose(f"task={task}").task, resolve=False)
    assert OmegaConf.to_container(tasks.task_config(task), resolve=False) == composed
    assert composed["headline"] and composed["entry"] and composed["report"]   # one place each, per task or family


def test_the_task_group_lists_only_tasks_and_every_base_has_tasks():
    names, bases = tasks.task_names(), tasks.base_names()
    assert {"bc", "robomimic", "sit", "grafting", "mup_mlp", "mup_gpt"} == set(bases)
    assert not set(names) & set(bases) and {"humanoid", "sit_digits", "feature_learning"} <= set(names)
    assert tasks.built_on("bc") == ["halfcheetah", "hopper", "humanoid", "walker2d"]
    assert all(tasks.built_on(b) for b in bases)   # no base that nothing builds on


def test_a_base_is_not_a_task_option(compose):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="Could not find 'task/bc'"):
        compose("task=bc")


def test_the_tasks_with_a_rehearsal_are_those_whose_config_names_one():
    assert {"robomimic_toolhang", "robomimic_transport", "sit_imagenet", "sft_llama32_3b",
            "sft_llama31_8b"} <= set(tasks.with_rehearsal())
    assert "feature_learning" not in tasks.with_rehearsal()


def test_docs_suite_md_holds_the_generated_task_table(tmp_path, capsys):
    assert tasks.main(["--check"]) == 0, "run python -m experiments.common.tasks --write"
    assert "| sit_digits | sit | `experiments.sit.train.run` | `experiments.sit.report.quality` | quality," \
        in tasks.documented_table()
    # a task config changed without the table: --check says so, --write mends it
    conf = tmp_path / "conf"
    for group in ("task", "task_base"):
        (conf / group).mkdir(parents=True)
        for p in (CONF / group).glob("*.yaml"):
            (conf / group / p.name).write_text(p.read_text())
    doc = tmp_path / "suite.md"
    doc.write_text((ROOT / "docs" / "suite.md").read_text())
    (conf / "task" / "lds.yaml").write_text((CONF / "task" / "lds.yaml").read_text().replace(
        "headline: [lval_closed,", "headline: [ttf_w2_T, lval_closed,"))
    assert tasks.main(["--check"], conf=conf, doc=doc) == 1
    assert "differs from the task configs" in capsys.readouterr().err
    assert tasks.main(["--write"], conf=conf, doc=doc) == 0 and tasks.main(["--check"], conf=conf, doc=doc) == 0
    assert "| ttf_w2_T, lval_closed," in doc.read_text() and doc.read_text().endswith(tasks.END + "\n")
