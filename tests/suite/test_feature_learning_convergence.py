"""The convergence rule of the feature-learning runs (experiments/theory/feature_learning.py)."""
import math

from experiments.theory.feature_learning import converged, tail_change


def test_tail_change_values():
    steps = list(range(0, 1001, 100))
    # window: steps >= 900, i.e. the values at 900 and 1000
    assert math.isclose(tail_change(steps, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0.22, 0.2], 1000), 0.1)
    # an oscillation counts as much as a decrease: (53 - 1.2) / 1.2
    assert math.isclose(tail_change([8000, 9000, 10000], [5.0, 1.2, 53.0], 10000, frac=0.2), (53 - 1.2) / 1.2)
    assert math.isnan(tail_change([0, 1000], [5.0, 1.0], 1000))  # one point in the window
    assert tail_change([900, 1000], [1.0, float("nan")], 1000) == math.inf


def test_converged_needs_a_flat_tail_and_the_floor():
    floor = 0.16
    steps = [800, 900, 950, 1000]
    assert converged(steps, [0.5, 0.20, 0.195, 0.19], 1000, floor)          # 5% over the tail, 1.2x the floor
    assert not converged(steps, [0.5, 0.30, 0.25, 0.19], 1000, floor)       # still falling: 58%
    assert not converged(steps, [40.0, 30.5, 30.2, 30.0], 1000, floor)      # flat, but 190x the floor
    assert converged(steps, [40.0, 30.5, 30.2, 30.0], 1000, floor, floor_factor=200.0)
    assert not converged(steps, [1.0, 0.2, float("nan"), 0.2], 1000, floor)
