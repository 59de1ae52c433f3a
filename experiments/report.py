"""`python -m experiments.report <sweep dirs> [--out results]`: the report driver of
experiments/common/report.py (see there)."""
from experiments.common.report import main

if __name__ == "__main__":
    main()
