"""The worked example's committed table (results/feature_learning/worked_example.md) is what the library computes,
and the claims row reads its verdict from it."""
import math

from experiments.claims.measures import WORKED_EXAMPLE, worked_example
from experiments.claims.tables import md_rows
from experiments.theory.worked_example import table

# one float64 step with a solve by Sigma_s (cond about 35): each value within 1e-12 on any BLAS
TOL = 1e-12


def test_the_committed_table_is_what_the_library_computes():
    committed = {r["step"]: r for r in md_rows(WORKED_EXAMPLE, "step")}
    for fresh in table():
        row = committed[fresh["step"]]
        for key, value in fresh.items():
            if key != "step":
                assert math.isclose(float(row[key]), value, abs_tol=TOL), (fresh["step"], key)


def test_gd_raises_the_distance_to_one_and_one_ap_step_reaches_g_star():
    rows = {r["step"]: r for r in table()}
    assert math.isclose(rows["gd"]["dist_before"], math.sqrt(3) / 2, rel_tol=1e-15)
    assert math.isclose(rows["gd"]["dist_after"], 1.0, rel_tol=TOL)
    assert rows["ap"]["dist_after"] < TOL
    assert math.isclose(rows["ap"]["g_after_0"], 1.0, abs_tol=TOL)


def test_the_row_is_recomputed_and_reproduced():
    m = worked_example()
    assert m.recomputed and m.clauses == ("reproduced",)
    assert "√3/2" in m.ours
