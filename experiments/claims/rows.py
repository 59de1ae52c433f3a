"""The claims rows, in the page's order (rows.yaml): each the paper's quoted claim and its place, the paper's
number (for a row beyond the paper: the hypothesis it tests), the front page's name, the regime, the command and
files, and the function in `measures` named by the row's id that computes its numbers and verdict.
`python -m experiments.claims` writes them."""
from pathlib import Path

import yaml

from experiments.claims import measures
from experiments.claims.row import Claim


def read_rows(path: Path = Path(__file__).with_name("rows.yaml")) -> tuple:
    rows = yaml.safe_load(path.read_text(encoding="utf-8"))
    return tuple(Claim(**{**r, "links": tuple(r["links"])}, measure=getattr(measures, r["id"].replace("-", "_")))
                 for r in rows)


ROWS = read_rows()
