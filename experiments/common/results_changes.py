"""What a regeneration of results/ changed against the commit, in one line (the last step of `make demo`).

    python -m experiments.common.results_changes [--since EPOCH_SECONDS] [FOLDER=results]

Compares each file under FOLDER that differs from git HEAD with HEAD's version. A table (CSV, markdown,
JSON) whose numbers all agree to their last printed digit (never finer than the tables' rounding,
experiments.common.report.SIGNIFICANT_DIGITS), and whose words are the same, changed at rounding
level; one whose stamp alone changed (the line naming the commands and commit) changed its stamp only;
another number or word moved. A figure (PNG) that differs was redrawn. --since: also count the files
written since then (what the run rewrote).
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import subprocess
from decimal import Decimal
from pathlib import Path

from experiments.common.report import SIGNIFICANT_DIGITS

ROOT = Path(__file__).resolve().parents[2]

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?(?![\w.])")
STAMP = re.compile(r"^(?:Runs made by |Made by ).*$", re.M)   # experiments/common/report.py make_stamp's line
TEXT = (".csv", ".md", ".json", ".txt")


def _git(root: Path, *args: str, text: bool = True):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=text, check=True).stdout


def changed_files(root: Path, folder: str) -> list:
    """(status, path) of the files under folder that differ from HEAD: "??" new, " M"/"M " modified."""
    out = _git(root, "status", "--porcelain", "--untracked-files=all", "--", folder)
    return [(line[:2], line[3:]) for line in out.splitlines() if line.strip()]


def _quantum(token: str) -> float:
    """The value of the last printed digit of a number (0.2552 -> 1e-4, 2.627e+04 -> 1), never finer than the
    tables' rounding (9950798.0, rounded to 7 digits: 1)."""
    x = abs(float(token))
    floor = 10.0 ** (math.floor(math.log10(x)) - SIGNIFICANT_DIGITS + 1) if x > 0 and math.isfinite(x) else 0.0
    return max(10.0 ** Decimal(token).as_tuple().exponent, floor)


def _cells(line: str, is_csv: bool):
    """A table row's cells with their character spans: markdown (`| a | b |`), or CSV in a .csv file; None
    for other lines."""
    if line.lstrip().startswith("|"):
        bounds = [i for i, c in enumerate(line) if c == "|"]
        return [(line[a + 1:b].strip(), a + 1, b) for a, b in zip(bounds, bounds[1:])]
    if is_csv and line:
        spans, at = [], 0
        for cell in next(csv.reader([line])):   # each cell's span in the line, quotes included
            end = at + len(cell) + (2 + cell.count('"') if line[at:at + 1] == '"' else 0)
            spans.append((cell.strip(), at, end))
            at = end + 1
        return spans
    return None


def _keys(text: str, is_csv: bool):
    """A function of (line index, character position) to a readable key: in a table (consecutive rows under
    a header row), `row column`, the row named by its first cell (with its second where the first repeats
    in the table); elsewhere `line N`."""
    rows, where = [_cells(line, is_csv) for line in text.split("\n")], {}
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j] is not None:
            j += 1
        if j - i >= 2:   # a header and at least one row
            header = [c for c, _, _ in rows[i]]
            firsts = [rows[k][0][0] for k in range(i + 1, j)]
            for k in range(i + 1, j):
                where[k] = (header, firsts.count(rows[k][0][0]) > 1)
        i = j + 1

    def key(line: int, pos: int) -> str:
        if line in where:
            header, repeats = where[line]
            cells = rows[line]
            for k, (_, a, b) in enumerate(cells):
                if a <= pos <= b and k < len(header):
                    row = cells[0][0] + (f" {cells[1][0]}" if repeats and len(cells) > 1 else "")
                    return f"{row} {header[k]}" if k else header[k]
        return f"line {line + 1}"
    return key


def largest_move(old: str, new: str, is_csv: bool = False):
    """None when new reads as old to the last printed digit of each number, "stamp" when the stamp's line
    alone differs beyond that, "text changed: ..." when words differ, else the largest relative move of a
    number beyond its last printed digit, `key: old -> new` (key: a table's row and column, else the line)."""
    bare_old, bare_new = STAMP.sub("", old), STAMP.sub("", new)
    words_old, words_new = NUMBER.split(bare_old), NUMBER.split(bare_new)
    if words_old != words_new:
        a, b = next((a, b) for a, b in zip(words_old + [""], words_new + [""]) if a != b)
        return f"text changed: {a.strip()[:30]!r} -> {b.strip()[:30]!r}"
    key, worst = _keys(bare_new, is_csv), None
    for i, (line_old, line_new) in enumerate(zip(bare_old.split("\n"), bare_new.split("\n"))):
        for m_old, m_new in zip(NUMBER.finditer(line_old), NUMBER.finditer(line_new)):
            a, b = m_old.group(), m_new.group()
            x, y = float(a), float(b)
            if not abs(x - y) > max(_quantum(a), _quantum(b)) * (1 + 1e-9):
                continue
            scale = max(abs(x), abs(y))
            rel = abs(x - y) / scale if scale > 0 and math.isfinite(scale) else math.inf
            if worst is None or rel > worst[0]:
                worst = (rel, f"{key(i, m_new.start())}: {a} -> {b}")
    if worst is not None:
        return worst[1]
    return "stamp" if STAMP.findall(old) != STAMP.findall(new) else None


def summarize(root: Path, folder: str = "results", since: float | None = None) -> str:
    """The one line: how many files were rewritten (since `since`), which differ from HEAD and how."""
    rounding, stamp, moved, redrawn, new = [], [], [], [], []
    for status, path in changed_files(root, folder):
        if status == "??":
            new.append(path)
        elif not (root / path).exists() or not path.endswith(TEXT):
            (moved if not (root / path).exists() else redrawn).append(path)
        else:
            move = largest_move(_git(root, "show", f"HEAD:{path}"), (root / path).read_text(), path.endswith(".csv"))
            (rounding if move is None else stamp if move == "stamp" else moved).append(
                path if move in (None, "stamp") else f"{path} ({move})")
    head = f"{folder}/"
    if since is not None:
        written = sum(1 for p in (root / folder).rglob("*") if p.is_file() and p.stat().st_mtime >= since)
        head += f" {written} file{'s' if written != 1 else ''} rewritten"
    parts = [f"moved beyond rounding: {', '.join(moved)}" if moved else "nothing moved beyond rounding"]
    if rounding:
        parts.append(f"{len(rounding)} changed at rounding level only ({', '.join(rounding)})")
    if stamp:
        parts.append(f"{len(stamp)} changed in their stamp only ({', '.join(stamp)})")
    if redrawn:
        parts.append(f"figures redrawn: {', '.join(redrawn)}")
    if new:
        parts.append(f"new: {', '.join(new)}")
    if not (moved or rounding or stamp or redrawn or new):
        parts = ["all as committed (git diff empty)"]
    return f"{head}: " + "; ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default="results")
    ap.add_argument("--since", type=float, default=None, help="epoch seconds the run started at")
    args = ap.parse_args(argv)
    print(summarize(ROOT, args.folder, args.since))


if __name__ == "__main__":
    main()
