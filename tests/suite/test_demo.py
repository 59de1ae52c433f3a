"""`make demo`, the README's first command, and the mission command: CI (.ci/run) runs every command line of
the demo and the mission command in fast mode (`make demo-check`), so a broken main job cannot land again
(issue 72 items 1-2: the demo crashed on a fresh clone and nothing ran its command lines)."""
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lines(*make_args, tmp):
    """The python command lines `make -n` prints (continuations joined, comments dropped), the temporary
    folder named TMP."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    out = subprocess.run(["make", "-n", *make_args], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.replace("\\\n", " ")
    made = [p for p in tmp.iterdir()]   # demo-check's own mktemp -d under TMPDIR
    for p in made:
        out = out.replace(str(p), "TMP")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in out.splitlines() if "/python " in line]


def test_ci_runs_every_command_line_of_make_demo_and_the_mission_command_in_fast_mode(tmp_path):
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.strip().startswith("#")]
    assert "make demo-check" in ci
    check = _lines("demo-check", tmp=tmp_path)
    python_demo = _lines("demo", "DEMO=TMP/demo", "DEMO_OUT=TMP/results", tmp=tmp_path)
    # every line of the demo runs in the check, in order, with debug=default added to each run.py line
    # (Counter: a token set, since the flag goes before a line's trailing comment)
    assert len(check) == len(python_demo) + 1
    for mine, theirs in zip(check, python_demo):
        extra = ["debug=default"] if " run.py " in theirs else []
        assert Counter(mine.split()) == Counter(theirs.split() + extra), (mine, theirs)
    assert all("--replace-results" not in line and " results" not in line.split("--out")[-1] for line in check)
    # the last line is the mission command the README's first paragraph gives, in fast mode
    readme = (ROOT / "README.md").read_text()
    mission = "python run.py task=humanoid optim=dopr_adamw -m"
    assert mission in readme
    assert Counter(check[-1].split()) == Counter(
        [".venv/bin/python", *mission.split()[1:], "debug=default", "hydra.sweep.dir=TMP/mission"])


def test_the_demo_writes_the_tables_its_results_readme_names():
    # issue 72 item 3: with the sweep preset gone, the report wrote results/feature_learning/feature_learning.*
    # (an earlier table) instead of feature_learning_protocol/, which results/feature_learning/README.md names
    line = next(line for line in _lines("demo", tmp=Path("/tmp")) if "feature_learning_protocol=glob" in line)
    assert "sweep_name=feature_learning_protocol" in line.split()
    readme = (ROOT / "results" / "feature_learning" / "README.md").read_text()
    assert "`feature_learning_protocol/feature_learning.png` (`make demo`" in readme


def test_each_demo_runs_its_jobs_afresh():
    # a job resumes from its folder's checkpoint: a second `make demo` into the same folder re-reported the first
    # one's runs (made by older code) instead of running them
    out = subprocess.run(["make", "-n", "demo", "DEMO=TMP/demo"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    first = next(line for line in out.splitlines() if "TMP/demo" in line)
    assert first.startswith("rm -rf TMP/demo && mkdir -p TMP/demo")
