"""One claims row: the paper's claim and its place, the files it reads, and the function that measures it.

The verdict words are the page's vocabulary (results/CLAIMS.md's header): a claim of the paper takes
reproduced / not reproduced / inconclusive / not run here; a row beyond the paper states its hypothesis in the
paper column and takes better / worse / inconclusive / not run here, after the prefix "beyond the paper: "."""
from dataclasses import dataclass
from typing import Callable

PAPER_WORDS = ("reproduced", "not reproduced", "inconclusive", "not run here")
HYPOTHESIS_WORDS = ("better", "worse", "inconclusive", "not run here")
BEYOND = "beyond the paper"
# a row whose numbers come from an aggregate table, or from nothing, says so in its cell
NOT_RECOMPUTABLE = "numbers not recomputable: no per-run files committed"


@dataclass(frozen=True)
class Measured:
    """What a row's function returns: the `ours` cell (numbers with their spread), the verdict's clauses
    (each `[scope: ]word[ (why)]`), the front page's one number."""
    ours: str
    clauses: tuple
    headline: str
    recomputed: bool = True   # False: the numbers are typed here once (the row's function says why in `ours`)
    aggregates: tuple = ()    # the protocol tables without per-seed runs it read (set by pages.measure_all)


@dataclass(frozen=True)
class Claim:
    id: str
    claim: str            # the quote with its place (§ as numbered in the paper's PDF)
    paper: str            # the paper's number, or for a row beyond the paper its hypothesis
    front: str            # the front page's name of the claim
    regime: str
    links: tuple          # the row's last cell: its command and the committed files it rests on
    measure: Callable[[], Measured]   # reads the committed tables (experiments/claims/measures.py)
    beyond: bool = False

    @property
    def families(self) -> list:
        """The results/<family>/ folders the row rests on: their READMEs carry its verdict."""
        return sorted({p.split("/")[1] for p in self.links if p.startswith("results/") and p.count("/") >= 2})

    def verdict(self, m: Measured) -> str:
        words = HYPOTHESIS_WORDS if self.beyond else PAPER_WORDS
        for clause in m.clauses:
            body = clause.split(": ", 1)[1] if ": " in clause.split(" (")[0] else clause
            if not any(body.startswith(w) for w in words):
                raise ValueError(f"row {self.id}: clause {clause!r} does not start with one of {words}")
        text = "; ".join(m.clauses)
        return f"{BEYOND}: {text}" if self.beyond else text
