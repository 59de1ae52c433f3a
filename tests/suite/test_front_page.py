"""The README's front page: its links open, each claims row of results/CLAIMS.md has its line there, and
it stays short."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)")


def _links(md: Path) -> list:
    return LINK.findall(md.read_text(encoding="utf-8"))


def test_every_link_of_the_front_page_opens_a_file_and_its_anchor():
    links = _links(ROOT / "README.md")
    assert links, "the front page links nothing"
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README.md links {path}, which does not exist"
        if anchor:
            assert f'id="{anchor}"' in target.read_text(encoding="utf-8"), f"{path} has no anchor {anchor}"


def test_every_claims_row_has_an_anchor_and_a_line_on_the_front_page():
    lines = (ROOT / "results" / "CLAIMS.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| claim (paper)")) + 2   # past |---|
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line)
    ids = [re.match(r'\| <a id="([a-z0-9-]+)"></a>', row) for row in rows]
    assert len(rows) >= 10 and all(ids), "a claims row has no <a id=...> anchor for the front page to link"
    linked = {anchor for path, anchor in _links(ROOT / "README.md") if path == "results/CLAIMS.md"}
    assert {m.group(1) for m in ids} == linked


def test_the_front_page_is_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| ") and "results/CLAIMS.md#" in line]
    assert all(len(line) < 300 for line in table), "a front-page claims line is over 300 characters"
    assert len(readme.splitlines()) < 160


def _run_commands(text: str) -> list:
    """The `python run.py ...` command lines of a text, comments and spacing dropped."""
    lines = (line.strip().split("  #")[0].split() for line in text.splitlines())
    return [" ".join(words) for words in lines if words[:2] == ["python", "run.py"]]


def test_readme_docs_and_run_py_show_one_set_of_tuned_examples_in_the_environment_make_creates():
    # issue 63: the README's commands failed with "No module named 'hydra'" (nothing activated .venv),
    # its "paper preset" was an ablation, and run.py and docs/suite.md showed an untuned sweep that diverges
    import ast
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    suite = (ROOT / "docs" / "suite.md").read_text(encoding="utf-8")
    run_py = ast.get_docstring(ast.parse((ROOT / "run.py").read_text(encoding="utf-8")))
    for text in (readme, suite):
        first = text.index("\npython run.py")   # the first command line
        assert "source .venv/bin/activate" in text[text.rindex("```bash", 0, first):first]
    assert ".venv/bin/python" in run_py and "source .venv/bin/activate" in run_py
    examples = _run_commands(run_py)
    assert examples and set(examples) <= set(_run_commands(readme))
    assert {c for c in examples if "launcher=" not in c} <= set(_run_commands(suite))   # its launchers: their section
    for command in examples:
        words = shlex.split(command)
        assert any(w.startswith("+tuned/") or w.startswith("sweep=") for w in words), command
        for w in words:
            if w.startswith("sweep="):
                preset = (ROOT / "conf" / "sweep" / f"{w.split('=', 1)[1]}.yaml").read_text(encoding="utf-8")
                assert "ablation" not in preset.splitlines()[1], f"{w} is an ablation, not a paper preset"
    # the paper's protocol: its preset conf/protocol/<task>.yaml, not an ablation sweep
    protocols = [l.split("  #")[0].split() for l in readme.splitlines() if l.startswith("python -m experiments.common.protocol ")]
    assert protocols and all((ROOT / "conf" / "protocol" / f"{words[4]}.yaml").is_file() for words in protocols)
