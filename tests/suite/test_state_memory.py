"""benchmarks/state_memory.py: what DoPr's state holds with and without the statistics EMA (Limitations'
"~d_in^2/2 additional parameters of optimizer state per layer")."""
import math

import pytest

from benchmarks.state_memory import measure

EXACT = 1e-15   # the table's counts are integers divided by 1e6 (M floats) or 2^20 (MB): one rounding each


@pytest.mark.slow
def test_the_statistics_ema_is_the_upper_triangle_of_each_sigma_and_nothing_without_it():
    row = measure("bc_mlp")   # 348 -> 256 -> 256 -> 256 -> 17, every Linear with a bias: d = 349, 257, 257, 257
    dims = [349, 257, 257, 257]
    assert row["preconditioned_layers"] == row["ema_buffers"] == 4 and row["largest_d"] == 349
    assert row["dopr_state_MB_no_ema"] == 0
    assert math.isclose(row["ema_floats_M"] * 1e6, sum(d * (d + 1) // 2 for d in dims), rel_tol=EXACT)
    assert math.isclose(row["formula_d2_over_2_M"] * 1e6, sum(d * d / 2 for d in dims), rel_tol=EXACT)
    assert math.isclose(row["dopr_state_MB_ema"] * 2**20, 4 * row["ema_floats_M"] * 1e6, rel_tol=EXACT)   # float32
