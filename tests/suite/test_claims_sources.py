"""Issue 74: every verdict and headline number on results/CLAIMS.md, the README's front page and the family
READMEs is written by `python -m experiments.claims` from the committed tables; the check fails when a page
differs from what the rows write."""
import csv
import re
from pathlib import Path

import pytest

from experiments.claims import pages, tables
from experiments.claims.__main__ import main
from experiments.claims.row import Claim, Measured, NOT_RECOMPUTABLE
from experiments.claims.rows import ROWS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured():
    return pages.measure_all()


def test_the_committed_pages_are_what_the_rows_write(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err
    assert f"{len(pages.pages(pages.measure_all()))} pages agree" in capsys.readouterr().out


def test_the_check_names_the_first_line_a_page_differs_in(measured):
    written = pages.pages(measured)[pages.CLAIMS_PAGE]
    edited = written.replace("| inconclusive (three GPs at the ceiling", "| not reproduced (three GPs at the ceiling")
    assert edited != written
    line = next(i for i, l in enumerate(edited.splitlines(), 1) if 'id="halfcheetah"' in l)
    why = pages.first_difference(pages.CLAIMS_PAGE, edited, written)
    assert why.startswith(f"results/CLAIMS.md:{line}, column") and "not reproduced (three GPs" in why
    assert pages.first_difference(pages.CLAIMS_PAGE, written, written) is None


def test_the_check_fails_on_the_pages_before_issue_74(tmp_path, monkeypatch, capsys, measured):
    # the page as it stood at 1809f28: no markers, its bottom table calling grafting "reproduced for Muon and AdamW"
    old = (ROOT / pages.CLAIMS_PAGE).read_text(encoding="utf-8")
    start, stop = old.index(pages.begin("made")), old.index(pages.end("made")) + len(pages.end("made"))
    old = old[:start] + "| Figure \"Moment graft\" | ... | **reproduced for Muon and AdamW (maps on)** (0.081) |" + old[stop:]
    (tmp_path / "results").mkdir()
    (tmp_path / pages.CLAIMS_PAGE).write_text(old, encoding="utf-8")
    monkeypatch.setattr(pages, "ROOT", tmp_path)
    for page in pages.blocks(measured):
        if page != pages.CLAIMS_PAGE:
            (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / page).write_text((ROOT / page).read_text(encoding="utf-8"), encoding="utf-8")
    import experiments.claims.__main__ as cli
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    assert main(["--check"]) == 1
    assert "results/CLAIMS.md: needs one '<!-- claims:begin made -->'" in capsys.readouterr().err


def test_no_verdict_contradicts_its_row_on_another_page(measured):
    # the contradictions issue 74 found: the bottom table's grafting line (0.081), the overhead "not reproduced on a
    # GPU", results/halfcheetah/README.md's "not reproduced", the front page's heading "What reproduced"
    claims = (ROOT / pages.CLAIMS_PAGE).read_text(encoding="utf-8")
    assert "0.081" not in claims and "not reproduced on a GPU" not in claims
    assert "**not reproduced**" not in (ROOT / "results/halfcheetah/README.md").read_text(encoding="utf-8")
    front = (ROOT / pages.FRONT_PAGE).read_text(encoding="utf-8")
    assert "## What reproduced" not in front
    by = {c.id: c for c in ROWS}
    # every clause of every row, negative ones included, is on the front page (reasons in parentheses dropped)
    for c in ROWS:
        line = next(l for l in front.splitlines() if f"(results/CLAIMS.md#{c.id})" in l)
        assert pages.short(c.verdict(measured[c.id])) in line, c.id
    assert "SGD: inconclusive" in front and "analogues, AdamW: not reproduced" in front
    assert by["halfcheetah"].verdict(measured["halfcheetah"]).startswith("inconclusive")


def test_rows_beyond_the_paper_state_a_hypothesis_and_never_say_reproduced(measured):
    beyond = [c for c in ROWS if c.beyond]
    assert {c.id for c in beyond} >= {"peers", "damping", "rank1-diag"}
    for c in beyond:
        assert c.paper.startswith("hypothesis: "), c.id
        v = c.verdict(measured[c.id])
        assert v.startswith("beyond the paper: ") and "reproduced" not in v, (c.id, v)
    row = beyond[0]
    with pytest.raises(ValueError, match="does not start with one of"):
        row.verdict(Measured("x", ("reproduced",), "x"))


def test_the_rows_read_their_numbers_from_the_committed_tables(measured):
    # HalfCheetah: the counts are the table's
    with open(ROOT / "results/halfcheetah/paper_halfcheetah/halfcheetah_dopr_vs_gp.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    inside = sum(c["seed_ranges_overlap"] == "yes" for c in cells)
    assert (inside, len(cells)) == (15, 20)
    assert f"{inside} inside the seed spread" in measured["halfcheetah"].ours
    # the AdamW pair is not at the ceiling: 35% of the expert at 20 trajectories
    assert "AdamW at 35%-94%" in measured["halfcheetah"].ours
    # ttf-feature: 3 of 72 grid points with ≪ a factor 10, 12 with plain <
    assert "3 of 72 grid points order this way with ≪ a factor 10, 12 with plain <" in measured["ttf-feature"].ours
    # inherited: counted over the committed selections, the paper's own Humanoid table beside them
    assert re.search(r"equals its GP's in \d+ of 16 pairs \(the paper's own Humanoid table: 8 of 20",
                     measured["inherited"].ours)
    # grafting: the README's rule applied to AdamW
    assert "AdamW: reproduced (by the rule" in ";".join(measured["grafting"].clauses)


def test_every_row_recomputes_from_per_run_files(measured):
    """Issue 74 item 2: no row rests on an aggregate table alone or on numbers typed in its function; the last one,
    robomimic-train-loss, reads the Lift sweep's robomimic_runs.csv (each seed's loss) since session 8."""
    assert [row for row, m in measured.items() if not m.recomputed or m.aggregates] == []
    assert all(NOT_RECOMPUTABLE not in m.ours for m in measured.values())
    assert measured["humanoid"].recomputed   # the BC grid's per-run tables
    assert pages.sources_block(measured).startswith("Every row's numbers recompute from per-run files")
    assert re.search(r"DoPr-Muon [\d.]+ \[[\d.]+-[\d.]+\] vs Muon [\d.]+ \[", measured["robomimic-train-loss"].ours)


def test_the_front_pages_short_verdict_keeps_every_comparison_word_of_the_row(measured):
    """The front page drops a verdict's parentheses (its reasons) but no outcome: a row's clause that is worse at one
    k and better at the others reads "worse, better" there, not "worse" (issue 74: no clause dropped)."""
    word = re.compile(r"\b(better|worse|inconclusive|not reproduced|reproduced)\b")
    lost = {}
    for row, m in measured.items():
        for clause in m.clauses:
            said, kept = set(word.findall(clause)), set(word.findall(pages.short(clause)))
            if said != kept:
                lost[f"{row}: {clause}"] = sorted(said - kept)
    assert lost == {}


def test_a_row_resting_on_an_aggregate_table_alone_is_not_recomputed_and_names_it(monkeypatch):
    """The first SFT base's protocol table has no per-run file beside it (its runs predate protocol_runs.csv): a row
    reading it is marked not recomputed and names the table, whatever its function says."""
    from experiments.claims import measures

    old = "results/sft_arith/first_base/protocol.csv"
    assert not (ROOT / old).with_name(tables.PER_SEED).exists()
    monkeypatch.setattr(measures, "SFT", old)
    m = pages.measure_all()["sft-8b"]
    assert not m.recomputed and m.aggregates == (old,)
    assert f"[sft-8b](#sft-8b): aggregate tables only: `{old}`" in pages.sources_block({**pages.measure_all(), "sft-8b": m})


def test_every_family_readme_with_a_row_carries_its_block():
    for family in pages.families():
        text = (ROOT / "results" / family / "README.md").read_text(encoding="utf-8")
        assert pages.begin("family") in text, family
        ids = [c.id for c in ROWS if family in c.families]
        assert ids and all(f"(../CLAIMS.md#{i})" in text for i in ids), family


def test_a_claim_rejects_a_word_outside_the_vocabulary():
    c = Claim("x", '§1: "a quoted claim of four words"', "p", "f", "-", ("results/lds/README.md",),
              lambda: Measured("o", ("consistent with the paper",), "h"))
    with pytest.raises(ValueError, match="row x"):
        c.verdict(c.measure())


def test_an_arm_recomputes_from_its_per_seed_runs():
    """Issue 74 item 2: `arm` aggregates a protocol's per-seed runs as protocol.csv does (min, median, max over
    the fixed seeds; a seed beyond them is left out)."""
    runs = [{"arm": "a", "setting": "optim.lr=0.1", "seed": s, "fixed": f, "val_loss": v, "wall_time_s": "3"}
            for s, f, v in (("1", "True", "0.5"), ("2", "True", "0.25"), ("3", "True", "2.0"), ("4", "False", "9"),
                            ("5", "True", "1.0"))]
    got = tables.arm_from_runs(runs + [{**runs[0], "arm": "b"}], "a")
    assert (got["val_loss_min"], got["val_loss_median"], got["val_loss_max"]) == (0.25, 0.75, 2.0)
    assert got["seeds"] == "1 2 3 5" and "wall_time_s_min" not in got
    with pytest.raises(KeyError, match="no run of arm 'c'"):
        tables.arm_from_runs(runs, "c")


def test_every_committed_per_seed_table_agrees_with_its_aggregate():
    """A protocol_runs.csv beside a protocol.csv: each arm's min / median / max recompute to the aggregate row
    (protocol.csv prints 7 significant digits: relative error 5e-7)."""
    found = sorted(ROOT.glob("results/**/" + tables.PER_SEED))
    for per_seed in found:
        aggregate = per_seed.parent / "protocol.csv"
        runs = tables.rows(str(per_seed.relative_to(ROOT)))
        for row in tables.rows(str(aggregate.relative_to(ROOT))):
            mine = tables.arm_from_runs(runs, row["arm"], str(per_seed))
            for key, value in row.items():
                if key.rsplit("_", 1)[-1] in ("min", "median", "max") and value not in ("", None):
                    assert mine[key] == pytest.approx(float(value), rel=1e-6), (per_seed, row["arm"], key)


def test_the_sources_block_names_each_row_that_read_an_aggregate_table(measured):
    block = pages.sources_block(measured)
    for c in ROWS:
        m = measured[c.id]
        assert (f"[{c.id}](#{c.id})" in block) == (not m.recomputed), c.id
        for path in m.aggregates:
            assert f"`{path}`" in block and not (ROOT / path).parent.joinpath(tables.PER_SEED).exists()
