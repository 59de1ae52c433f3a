"""The paper's theory on the suite's worked problem (experiments/theory/contraction.py): the AP's contraction
rate over many steps. Affine invariance and the worked example's one step: tests/lib/test_paper_theory.py."""
import pytest

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


@pytest.mark.slow
def test_ap_contracts_the_subspace_distance_at_the_propositions_rate_over_many_steps():
    """Prop. "SGD and AP feature learning" iterated: with F known, every AP step multiplies G P_perp by
    (I - eta F^T F), so each ratio r_t = ||G_(t+1) P_perp|| / ||G_t P_perp|| is at most 1 - eta lambda_min(F^T F),
    follows the identity's ratios to rounding and tends to that rate, whatever cond(Sigma_s); GD's does not."""
    from experiments.theory.contraction import distances, exact_distances, problem, rate, ratio_tolerance, run_length

    eta, lam, cond = 0.5, 0.2, 1e4
    prob = problem(lam, cond)
    steps = run_length(prob, eta)
    d, exact = distances(prob, eta, ap=True, steps=steps), exact_distances(prob, eta, steps)
    r, r_exact, tol = d[1:] / d[:-1], exact[1:] / exact[:-1], ratio_tolerance(d, cond)
    assert steps > 50 and d[-1] < 1e-5 * d[0]
    assert (r <= rate(eta, lam) + tol).all()
    assert ((r - r_exact).abs() <= tol).all()
    assert r[0] < rate(eta, lam) - 0.01 and abs(r[-1] - rate(eta, lam)) <= tol[-1] + abs(r_exact[-1] - rate(eta, lam))
    assert abs(r_exact[-1] - rate(eta, lam)) < 1e-9   # the transient has died out: the last ratio is the rate
    gd = distances(prob, eta, ap=False, steps=steps)
    assert (gd[1:] / gd[:-1] > rate(eta, lam) + 0.05).all() and gd[-1] > 1e4 * d[-1]
