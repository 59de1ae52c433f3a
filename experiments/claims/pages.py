"""Writing the rows into the pages: each generated block sits between `<!-- claims:begin NAME -->` and
`<!-- claims:end NAME -->`; the text around the markers is hand-written and left alone.

Blocks: results/CLAIMS.md `rows` (the claims table), `sources` (the rows whose numbers do not all recompute from
per-run files) and `made` (how each experiment is made, its rows' verdicts),
README.md `front` (one line per row), results/<family>/README.md `family` (the verdicts of the rows resting on it)."""
import re
from dataclasses import replace
from pathlib import Path

from experiments.claims.made import EXPERIMENTS
from experiments.claims.row import Claim
from experiments.claims.rows import ROWS
from experiments.claims.tables import SOURCES

ROOT = Path(__file__).resolve().parents[2]
CLAIMS_PAGE = "results/CLAIMS.md"
FRONT_PAGE = "README.md"
# results/bench/ is the benchmarks' folder, written by its own tools (benchmarks/): its README defers to the rows
NO_FAMILY_BLOCK = ("bench",)
COMMAND = "python -m experiments.claims"


def begin(name: str) -> str:
    return f"<!-- claims:begin {name} -->"


def end(name: str) -> str:
    return f"<!-- claims:end {name} -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _links(claim: Claim) -> str:
    return ", ".join(f"`{p}`" for p in claim.links)


def short(verdict: str) -> str:
    """The verdict with its reasons (the parentheses) dropped: every clause and scope stays."""
    while True:
        shorter = re.sub(r" \([^()]*\)", "", verdict)
        if shorter == verdict:
            return verdict
        verdict = shorter


def _table(header: tuple, rows: list) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(cells) + " |" for cells in rows])


def rows_block(measured: dict) -> str:
    return _table(("claim (paper)", "paper", "ours (spread)", "verdict", "regime", "command / files"),
                  [(f'<a id="{c.id}"></a>{c.claim}', c.paper, _cell(measured[c.id].ours), c.verdict(measured[c.id]),
                    c.regime, _links(c)) for c in ROWS])


def front_block(measured: dict) -> str:
    return _table(("paper", "verdict", "one number", "row"),
                  [(c.front, short(c.verdict(measured[c.id])), _cell(measured[c.id].headline),
                    f"[{c.id}]({CLAIMS_PAGE}#{c.id})") for c in ROWS])


def made_block(measured: dict) -> str:
    by = {c.id: c for c in ROWS}
    verdicts = lambda e: "; ".join(f"[{i}](#{i}): {short(by[i].verdict(measured[i]))}" for i in e.rows) or "-"
    return _table(("paper", "command", "compute", "state", "rows: verdict"),
                  [(e.paper, e.command, e.compute, e.state, verdicts(e)) for e in EXPERIMENTS])


def family_block(family: str, measured: dict) -> str:
    lines = [f"Verdicts of the `results/CLAIMS.md` rows that rest on this folder (written by `{COMMAND}` from the "
             "committed tables; the reasons and regimes are in the row):"]
    for c in ROWS:
        if family in c.families:
            m = measured[c.id]
            lines.append(f"- [{c.id}](../CLAIMS.md#{c.id}): **{c.verdict(m)}**; {m.headline}")
    return "\n".join(lines)


def families() -> list:
    return sorted({f for c in ROWS for f in c.families} - set(NO_FAMILY_BLOCK))


def measure_all() -> dict:
    """{row id: Measured}; a row that read a protocol's aggregate table (no per-seed runs beside it) is marked
    not recomputed, whatever its function said."""
    out = {}
    for c in ROWS:
        SOURCES.clear()
        m = c.measure()
        aggregates = tuple(sorted(p for p, kind in SOURCES.items() if kind == "aggregate"))
        out[c.id] = replace(m, aggregates=aggregates, recomputed=m.recomputed and not aggregates)
    return out


def sources_block(measured: dict) -> str:
    """The rows whose numbers do not all recompute from per-run files, and why."""
    lines = ["Rows whose numbers do not all recompute from per-run files committed here (written by "
             f"`{COMMAND}`; every other row's numbers do):"]
    for c in ROWS:
        m = measured[c.id]
        if not m.recomputed:
            why = (f"aggregate tables only: {', '.join(f'`{p}`' for p in m.aggregates)}" if m.aggregates else
                   "typed once in its function (experiments/claims/measures.py says why)")
            lines.append(f"- [{c.id}](#{c.id}): {why}")
    if len(lines) == 1:
        return f"Every row's numbers recompute from per-run files committed here (written by `{COMMAND}`)."
    return "\n".join(lines)


def blocks(measured: dict) -> dict:
    """{page: {block name: text}} for every generated block."""
    out = {CLAIMS_PAGE: {"rows": rows_block(measured), "made": made_block(measured),
                         "sources": sources_block(measured)},
           FRONT_PAGE: {"front": front_block(measured)}}
    for f in families():
        out[f"results/{f}/README.md"] = {"family": family_block(f, measured)}
    return out


def fill(text: str, name: str, block: str, page: str) -> str:
    b, e = begin(name), end(name)
    if text.count(b) != 1 or text.count(e) != 1 or text.index(b) > text.index(e):
        raise ValueError(f"{page}: needs one '{b}' before one '{e}'")
    return text[:text.index(b) + len(b)] + "\n" + block + "\n" + text[text.index(e):]


def pages(measured: dict) -> dict:
    """{page: its full text with every block written}."""
    out = {}
    for page, named in blocks(measured).items():
        text = (ROOT / page).read_text(encoding="utf-8")
        for name, block in named.items():
            text = fill(text, name, block, page)
        out[page] = text
    return out


def first_difference(page: str, committed: str, written: str):
    """None when equal, else the first differing line: 'page:line: committed ... / written ...'."""
    if committed == written:
        return None
    a, b = committed.splitlines(), written.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            col = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            at = max(0, col - 40)
            return (f"{page}:{i + 1}, column {col + 1}: committed {x[at:at + 120]!r}\n"
                    f"  written by {COMMAND}: {y[at:at + 120]!r}")
    i = min(len(a), len(b))
    return f"{page}:{i + 1}: the committed page has {len(a)} lines, {COMMAND} writes {len(b)}"


def unrecomputed(measured: dict) -> list:
    return [c.id for c in ROWS if not measured[c.id].recomputed]
