"""bf16 autocast drift: DoPr-AdamW's parameters drift about 11x further from their float32 run than
AdamW's after 10 steps of a small convnet (the protocol and its decomposition: experiments/studies/bf16_drift.py,
results/numerics/bf16_drift.md). DoPr computes nothing in bf16; the excess is the AP amplifying, by
1 / lambda, the part of the bf16-rounded gradient outside the span of the layer's activations.

The band of the ratio, [7, 16] around the measured 11.5 (torch 2.13 CPU):
* other CPU kernels barely move it: 11.45-11.51 under ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE,
  avx2, 1 and 2 threads; a CPU whose bf16 GEMMs round differently draws other rounding errors, whose
  effect the other seeds of the report's section 6 bound: 8.4-11.5 over six (net, data) seeds;
* it fails on the precision regressions measured there: Sigma's z^T z formed in bf16 gives 22.3,
  Sigma's sums rounded to bf16 2.9 (its Cholesky fails and is retried at 10x the damping), and on
  a change of the mechanism: G without its out-of-span part, damping 1e-2 or the eigh solver give 1.1-1.2.
"""

import pytest
import torch

from experiments.studies import bf16_drift as bd

# numerics: run again under other CPU kernels (Makefile: test-kernels); slow: 2-3 s of setup
pytestmark = [pytest.mark.numerics, pytest.mark.slow]

BAND = (7.0, 16.0)


INSPAN = bd.Variant("autocast", "inspan")


@pytest.fixture(scope="module")
def runs():
    """The final parameters of each run: 2-3 s on one thread (tiny ops: a second thread only waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches = bd.make_batches()
        return {(name, v): bd.run(name, v, batches=batches)["params"][-1]
                for name, v in [(n, v) for n in ("adamw", "dopr_adamw") for v in (bd.FP32, bd.BF16)]
                + [("dopr_adamw", INSPAN)]}
    finally:
        torch.set_num_threads(threads)


def test_dopr_drifts_about_11x_adamw_under_bf16(runs):
    adamw = bd.rel(runs["adamw", bd.BF16], runs["adamw", bd.FP32])
    ours = bd.rel(runs["dopr_adamw", bd.BF16], runs["dopr_adamw", bd.FP32])
    assert 2e-3 < adamw < 1e-2, adamw          # about bf16's unit roundoff 2^-8
    assert BAND[0] < ours / adamw < BAND[1], (ours, adamw, ours / adamw)


def test_the_excess_is_g_outside_the_span_of_the_activations(runs):
    """Removing G's component outside span{z} (which the exact gradient does not have) brings DoPr's
    drift down to AdamW's: the AP amplifies that component, nothing else."""
    adamw = bd.rel(runs["adamw", bd.BF16], runs["adamw", bd.FP32])
    ratio = bd.rel(runs["dopr_adamw", INSPAN], runs["dopr_adamw", bd.FP32]) / adamw
    assert 0.5 < ratio < 2.0, ratio
