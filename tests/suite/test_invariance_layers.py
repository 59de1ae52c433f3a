"""The appendix corollaries "Convolutional Affine invariance" and "Attention projection AP invariance":
DoPr-SGD trajectories on x and on the transformed input agree to float64 rounding, SGD's do not
(the feedforward case is tests/lib/test_paper_theory.py)."""
import pytest

from experiments.theory.invariance_layers import CASES, relative_gap, rounding_bound, trajectories

pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # run again under other CPU kernels (Makefile: test-kernels)


@pytest.mark.parametrize("case", list(CASES))
def test_dopr_sgd_is_invariant_to_the_corollarys_transform_and_sgd_is_not(case):
    bound = rounding_bound(case)   # steps x d x eps x cond(Sigma): a few 1e-9 to 1e-7 here
    a, b = trajectories(case, "dopr_sgd")
    assert a.isfinite().all() and a[-1] < 0.7 * a[0]   # it trains
    assert relative_gap(a, b) < bound
    s, t = trajectories(case, "sgd")
    assert relative_gap(s, t) > 1e3 * bound


@pytest.mark.parametrize("case", ["conv", "attention"])
def test_without_homogeneous_coordinates_the_shift_breaks_the_invariance(case):
    """The check can fail: with the bias outside Sigma (homogeneous=False) the update is invariant to
    Q but not to the shift d, and the gap is far above rounding."""
    a, b = trajectories(case, "dopr_sgd", homogeneous=False)
    assert relative_gap(a, b) > 10 * rounding_bound(case)
