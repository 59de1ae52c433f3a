"""The README's front page: its links open, each claims row of results/CLAIMS.md has its line there, and
it stays short."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
