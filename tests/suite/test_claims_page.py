"""results/CLAIMS.md (issue 65): every row names its claim (quoted, with its place in the paper), a verdict
from the vocabulary the page's header defines, the results it rests on (paths that exist), and stays
short enough to read; the README's front page uses the same verdict words."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLAIMS = ROOT / "results" / "CLAIMS.md"
# the issue's bound, "at most about 600 characters", on the row as a reader sees it: the anchor tag
# <a id="..."></a> is markup the rendered page does not show, so it is not counted
MAX_ROW_CHARS = 600
ANCHOR = re.compile(r'<a id="([a-z0-9-]+)"></a>')
PLACE = re.compile(r"§[1-6A-D](\.\d+)*")   # the paper's sections: 1-6 in the main text, appendices A-D
QUOTE = re.compile(r'"([^"]+)"')
PATH = re.compile(r"`([^`\s=]+/[^`\s=]*)`")


def _vocabulary(text: str) -> tuple:
    """The header's list `- **word**: meaning`; an item marked `(prefix)` is a prefix, not a verdict."""
    header = text[:text.index("\n| claim (paper)")]
    items = re.findall(r"^- \*\*([^*]+)\*\*( \(prefix\))?:", header, flags=re.M)
    return [w for w, p in items if not p], [w for w, p in items if p]


def _rows(text: str) -> list:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| claim (paper)")) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line)
    return rows


def _cells(row: str) -> list:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def _clauses(verdict: str) -> list:
    """The verdict split at '; ' outside parentheses."""
    out, depth, cur = [], 0, ""
    for i, ch in enumerate(verdict):
        depth += (ch == "(") - (ch == ")")
        if ch == ";" and depth == 0 and verdict[i + 1:i + 2] == " ":
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def verdict_problem(verdict: str, words: list, prefixes: list):
    """None if each clause is `[prefix: ][scope: ]<word> ...` with a word of the vocabulary, else why not."""
    for clause in _clauses(verdict.replace("**", "")):
        for p in prefixes:
            if clause.startswith(p + ": "):
                clause = clause[len(p) + 2:]
        if not any(clause.startswith(w) for w in words) and ": " in clause:
            scope, clause = clause.split(": ", 1)
            if len(scope) > 30 or any(w in scope for w in words):
                return f"scope {scope!r} is not a short label"
        if not any(clause.startswith(w) for w in words):
            return f"clause {clause!r} does not start with a verdict word {words}"
    return None


def row_problems(row: str, words: list, prefixes: list) -> list:
    cells = _cells(row)
    if len(cells) != 6:
        return [f"{len(cells)} cells, not 6"]
    claim, verdict, files = cells[0], cells[3], cells[5]
    problems = []
    if not PLACE.search(claim):
        problems.append("the claim names no place in the paper (§...)")
    if not any(len(q.split()) >= 4 for q in QUOTE.findall(claim)):
        problems.append("the claim quotes no passage of the paper (4 words or more in double quotes)")
    why = verdict_problem(verdict, words, prefixes)
    if why:
        problems.append(why)
    paths = PATH.findall(files)
    if not paths:
        problems.append("no link to its results (a path in backticks)")
    problems += [f"links {p}, which does not exist" for p in paths if not (ROOT / p.rstrip("/")).exists()]
    if len(ANCHOR.sub("", row)) > MAX_ROW_CHARS:
        problems.append(f"{len(ANCHOR.sub('', row))} characters, over {MAX_ROW_CHARS}")
    return problems


def test_the_header_defines_the_verdict_vocabulary():
    words, prefixes = _vocabulary(CLAIMS.read_text(encoding="utf-8"))
    assert {"reproduced", "not reproduced", "inconclusive", "not run here"} <= set(words), words
    assert prefixes == ["beyond the paper"], prefixes


def test_every_claims_row_quotes_its_claim_has_a_verdict_word_links_its_results_and_is_short():
    text = CLAIMS.read_text(encoding="utf-8")
    words, prefixes = _vocabulary(text)
    assert words, "the page's header defines no verdict vocabulary (- **word**: meaning)"
    rows = _rows(text)
    assert len(rows) >= 20
    bad = {ANCHOR.search(r).group(1) if ANCHOR.search(r) else r[:40]: p
           for r in rows if (p := row_problems(r, words, prefixes))}
    assert not bad, bad


def test_the_front_page_uses_the_same_verdict_words():
    words, prefixes = _vocabulary(CLAIMS.read_text(encoding="utf-8"))
    lines = [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
             if line.startswith("| ") and "results/CLAIMS.md#" in line]
    bad = {line[:40]: why for line in lines if (why := verdict_problem(_cells(line)[1], words, prefixes))}
    assert not bad, bad


def test_the_checks_catch_what_issue_65_found():
    words, prefixes = ["reproduced", "not reproduced", "inconclusive", "not run here"], ["beyond the paper"]
    assert verdict_problem("consistent for Muon; DoPr-AdamW lower (Lift)", words, prefixes)
    assert verdict_problem("no single default: a careful negative", words, prefixes)
    assert verdict_problem("**distance half reproduced** at 1000 steps", words, prefixes)
    assert verdict_problem("not run here (GPUs); Lift: inconclusive (AdamW; 3 seeds)", words, prefixes) is None
    assert verdict_problem("beyond the paper: inconclusive on quality", words, prefixes) is None
    good = ('| <a id="x"></a>§5.1: "DoPr always improves terminal reward" | p | 19 of 20 | reproduced | - '
            '| `results/humanoid/README.md` |')
    assert row_problems(good, words, prefixes) == []
    assert row_problems(good.replace("§5.1", "Figure"), words, prefixes)
    assert row_problems(good.replace('"DoPr always improves terminal reward"', '"humanoid_il"'), words, prefixes)
    assert row_problems(good.replace("results/humanoid/README.md", "results/nowhere/"), words, prefixes)
    assert row_problems(good.replace("19 of 20", "x" * MAX_ROW_CHARS), words, prefixes)
