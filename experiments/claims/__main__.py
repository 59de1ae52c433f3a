"""python -m experiments.claims [--check]: write every claims row, verdict and headline number into
results/CLAIMS.md, README.md and the family READMEs from the committed tables (experiments/claims/rows.yaml,
measures.py); --check writes nothing and exits 1 naming the first line the committed text differs in."""
import argparse
import sys

from experiments.claims.pages import ROOT, first_difference, measure_all, pages, unrecomputed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="compare with the committed pages; write nothing")
    args = p.parse_args(argv)
    measured = measure_all()
    try:
        written = pages(measured)
    except ValueError as e:   # a page without its markers
        print(f"the committed claims differ from what the rows write: {e}", file=sys.stderr)
        return 1
    if args.check:
        for page, text in written.items():
            why = first_difference(page, (ROOT / page).read_text(encoding="utf-8"), text)
            if why:
                print(f"the committed claims differ from what the rows write (run python -m experiments.claims):\n"
                      f"{why}", file=sys.stderr)
                return 1
        print(f"{len(written)} pages agree with the rows")
        return 0
    for page, text in written.items():
        (ROOT / page).write_text(text, encoding="utf-8")
    missing = unrecomputed(measured)
    print(f"wrote {len(written)} pages; " + (f"rows not recomputed from per-run files (typed, or an aggregate table): "
                                             f"{', '.join(missing)}" if missing else "every row recomputes from per-run files"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
