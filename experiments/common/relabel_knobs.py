"""Rewrite the lines that name DoPr's knobs in committed selection.md / protocol.md files from their
selection.json and protocol.csv, with the report code (`tuning.describe_knobs`, `tuning.verdicts`), running
nothing. Issue 74: the knobs were a hand-kept list that left out the damping rule, so sample-count runs were
named "DoPr's damping 0.0 (trace)"; the list is now every field of DoPrOptions, read from each winner's resolved
config the selection kept.

    python -m experiments.common.relabel_knobs results/damping_free/sample_count/humanoid ...   # these folders
    python -m experiments.common.relabel_knobs --all                # every results/**/selection.json
A folder's protocol.md verdict lines are rewritten only where the verdict the table gives is the committed one
apart from the knobs (else the folder is named and left as it is)."""
from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from experiments.common import tuning

ROOT = Path(__file__).resolve().parents[2]


def _table_rows(path: Path) -> list:
    """protocol.csv's rows as `tuning.report` made them: numbers as floats, an empty cell absent."""
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v in ("", None):
                    continue
                try:
                    row[k] = v if k in ("arm", "setting", "seeds", "missing") else float(v)
                except ValueError:
                    row[k] = v
            out.append(row)
    return out


def _knob_sentence(line: str) -> str:
    """The last sentence of a verdict line: the knobs (`DoPr's ... held fixed, not tuned.`)."""
    return line[line.rindex(" DoPr's "):] if " DoPr's " in line else ""


def relabel(folder: Path) -> list:
    """Rewrite folder/selection.md and folder/protocol.md in place; the lines changed, as 'file: line'."""
    selection = json.loads((folder / "selection.json").read_text(encoding="utf-8"))
    changed = []
    md = folder / "selection.md"
    lines = md.read_text(encoding="utf-8").split("\n")
    for _, dopr in selection["pairs"]:
        new = f"{dopr}: {tuning.describe_knobs(selection['arms'][dopr])}."
        for i, line in enumerate(lines):
            if re.match(rf"{re.escape(dopr)}: DoPr's .*\.$", line) and line != new:
                lines[i] = new
                changed.append(f"{md.relative_to(ROOT)}: {new}")
    md.write_text("\n".join(lines), encoding="utf-8")
    protocol, table = folder / "protocol.md", folder / "protocol.csv"
    if protocol.exists() and table.exists():
        lines = protocol.read_text(encoding="utf-8").split("\n")
        for new in tuning.verdicts(_table_rows(table), selection):
            head = new[:new.index(":")]
            for i, line in enumerate(lines):
                if not line.startswith(head) or line == new or not _knob_sentence(line):
                    continue
                if line[:len(line) - len(_knob_sentence(line))] != new[:len(new) - len(_knob_sentence(new))]:
                    changed.append(f"{protocol.relative_to(ROOT)}: left as it is (the table's verdict differs "
                                   f"beyond the knobs: {new!r})")
                    continue
                lines[i] = new
                changed.append(f"{protocol.relative_to(ROOT)}: {new}")
        protocol.write_text("\n".join(lines), encoding="utf-8")
    return changed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", help="folders holding selection.json")
    p.add_argument("--all", action="store_true", help="every results/**/selection.json")
    args = p.parse_args(argv)
    folders = [Path(f).resolve() for f in args.folders]
    if args.all:
        folders += sorted(s.parent for s in (ROOT / "results").rglob("selection.json"))
    if not folders:
        p.error("name the folders, or pass --all")
    for folder in folders:
        for line in relabel(folder):
            print(line)


if __name__ == "__main__":
    main()
