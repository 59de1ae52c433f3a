"""Studies that span families (each ``python -m experiments.studies.<name>`` from the checkout's root):
bf16_drift and bf16_outcome (bf16 autocast: results/numerics/), damping_free_* (issue 48's damping-free AP
rules: results/damping_free/). A study of one family lives in that family (experiments/sit/damping_probe.py)."""
