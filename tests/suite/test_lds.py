"""Proposition "LDS" and the appendix "Dynamical Systems Theory" (experiments/theory/lds.py, construction.py, lds_task.py)."""
import csv
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.theory import construction, lds, lds_task
from experiments.theory import report as theory_report


def _random_system(seed=0, n=3, m=2):
    rng = np.random.default_rng(seed)
    A, B, Sw, K_demo = lds.random_stable_lds(n, m, 0.85, 0.1, rng)
    K, _ = lds.perturbed_policy(A, B, K_demo, 0.3, rng)
    return A, B, Sw, K_demo, K, rng


def test_state_covariance_is_the_papers_sum():
    A, B, Sw, _, K, _ = _random_system()
    X = A + B @ K
    t = 7
    direct = sum(np.linalg.matrix_power(X, s) @ Sw @ np.linalg.matrix_power(X, s).T for s in range(t))
    np.testing.assert_allclose(lds.state_covariance(A, B, K, Sw, t), direct, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lds.state_covariance(A, B, K, Sw, 1), Sw)  # s_1 = w_0 since s_0 = 0
    G = lds.state_covariances(A, B, K, Sw, t)
    np.testing.assert_allclose(lds.average_state_covariance(A, B, K, Sw, t), G[1:].mean(0))


def test_closed_form_gamma_matches_monte_carlo():
    A, B, Sw, _, K, rng = _random_system()
    T, n = 12, 20000
    states = lds.monte_carlo_rollouts(A, B, K, Sw, T, n, rng)
    assert states.shape == (n, T + 1, 3) and np.all(states[:, 0] == 0)
    for t in (1, 5, T):
        G = lds.state_covariance(A, B, K, Sw, t)
        C = states[:, t].T @ states[:, t] / n
        sd = np.sqrt((np.outer(np.diag(G), np.diag(G)) + G ** 2) / n)  # sampling sd of each entry
        assert np.max(np.abs(C - G) / sd) < 5.0
        assert np.abs(states[:, t].mean(0)).max() < 5 * np.sqrt(np.diag(G).max() / n)


def test_losses_and_ttf_match_monte_carlo():
    A, B, Sw, K_demo, K, rng = _random_system(1)
    mc, rows = lds.monte_carlo_check(A, B, Sw, K_demo, K, 15, 20000, rng)
    assert len(rows) == 15
    assert abs(mc["mc_lval_z"]) < 5 and abs(mc["mc_lideal_z"]) < 5
    assert mc["mc_lval_rel_err"] < 0.03 and mc["mc_lideal_rel_err"] < 0.03
    assert mc["mc_ttf_paper_rel_err"] < 0.1 and mc["mc_ttf_w2_rel_err"] < 0.1
    assert mc["mc_gamma_max_abs_z"] < 5


def test_average_covariance_converges_to_stationary():
    """Lemma "ricatti": Gamma_bar_T -> Gamma_inf, which solves the Lyapunov equation."""
    A, B, Sw, _, K, _ = _random_system()
    G_inf = lds.stationary_state_covariance(A, B, K, Sw)
    X = A + B @ K
    np.testing.assert_allclose(G_inf, X @ G_inf @ X.T + Sw, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lds.average_state_covariance(A, B, K, Sw, math.inf), G_inf)
    err = [np.linalg.norm(lds.average_state_covariance(A, B, K, Sw, T) - G_inf) for T in (200, 2000)]
    assert err[1] < err[0] / 5  # O(1/T)


def test_losses_are_weighted_frobenius_norms():
    A, B, Sw, K_demo, K, _ = _random_system()
    G = lds.average_state_covariance(A, B, K_demo, Sw, 20)
    D = K_demo - K
    expected = np.linalg.norm(D @ lds.psd_sqrt(G), "fro") ** 2
    assert lds.validation_loss(K_demo, K, G) == pytest.approx(expected, rel=1e-10)
    assert lds.ideal_loss(K_demo, K_demo, G) == 0.0


def test_ttf_shift_paper_formula_vs_exact_w2():
    S1, S2 = np.diag([1.0, 4.0]), np.diag([9.0, 1.0])  # commuting: the paper's formula is exact
    assert lds.ttf_shift_w2(S1, S2) == pytest.approx(4.0 + 1.0)
    assert lds.gaussian_w2_squared(S1, S2) == pytest.approx(5.0)
    rng = np.random.default_rng(0)
    for _ in range(20):  # non-commuting: the paper's expression is an upper bound on W2^2
        M1, M2 = rng.standard_normal((2, 3, 3))
        S1, S2 = M1 @ M1.T + 0.1 * np.eye(3), M2 @ M2.T + 0.1 * np.eye(3)
        assert lds.ttf_shift_w2(S1, S2) >= lds.gaussian_w2_squared(S1, S2) - 1e-10
    c = construction.lds_construction(0.3, 1.0, 0.2)
    G_d = lds.stationary_state_covariance(c["A"], c["B"], c["K_demo"], c["Sigma_w"])
    G_p = lds.stationary_state_covariance(c["A"], c["B"], c["K_psi"], c["Sigma_w"])
    assert lds.ttf_shift_w2(G_d, G_p) > 1.01 * lds.gaussian_w2_squared(G_d, G_p)


def test_unstable_policy_raises():
    A, B, Sw = np.diag([0.0, 1.0]), np.eye(2), np.eye(2)
    with pytest.raises(ValueError, match=r"not stable: spectral radius rho\(A \+ B K\) = 1 >= 1"):
        lds.stationary_state_covariance(A, B, np.zeros((2, 2)), Sw)
    with pytest.raises(ValueError, match="not stable"):
        lds.average_state_covariance(A, B, np.diag([0.0, -2.5]), Sw, math.inf)
    with pytest.raises(ValueError):
        construction.stationary_covariance_theta_closed_form(0.5, 0.0)


def test_construction_matrices():
    a, e, th = 0.2, 0.7, 0.3
    c = construction.lds_construction(a, e, th, mu=3.0)
    np.testing.assert_allclose(c["K_demo"], [[0, 0], [0, -a]])
    np.testing.assert_allclose(c["F_star"] @ c["G_star"], c["K_demo"])
    # K_theta = K_demo + alpha [[0,0],[-cos, 1 - sin]] (the paper prints "-"; quadratic losses are unaffected)
    np.testing.assert_allclose(c["K_theta"], c["K_demo"] + a * np.array([[0, 0], [-math.cos(th), 1 - math.sin(th)]]))
    np.testing.assert_allclose(c["K_psi"], c["K_demo"] - e * np.array([[0, 1], [0, 0]]))
    # Lemma err_comp
    D = c["K_theta"] - c["K_demo"]
    s, co = math.sin(th), math.cos(th)
    np.testing.assert_allclose(D.T @ D, a ** 2 * np.array([[co ** 2, -co * (1 - s)], [-co * (1 - s), (1 - s) ** 2]]))
    D = c["K_psi"] - c["K_demo"]
    np.testing.assert_allclose(D.T @ D, [[0, 0], [0, e ** 2]])
    # Proposition TTF_feature_learning: dist(G_theta, G_*) = cos(theta) > dist(G_psi, G_*) = 0
    assert construction.subspace_distance(c["G_theta"], c["G_star"]) == pytest.approx(co)
    assert construction.subspace_distance(c["G_psi"], c["G_star"]) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("a,e,th", [(0.01, 0.1, 1e-4), (0.1, 1.0, 1e-3), (0.5, 0.01, 0.3), (1.5, 2.0, 0.7)])
def test_closed_form_stationary_covariances(a, e, th):
    c = construction.lds_construction(a, e, th)
    num = lambda K: lds.stationary_state_covariance(c["A"], c["B"], K, c["Sigma_w"])
    np.testing.assert_allclose(construction.stationary_covariance_demo_closed_form(a), num(c["K_demo"]), rtol=1e-8)
    np.testing.assert_allclose(construction.stationary_covariance_theta_closed_form(a, th), num(c["K_theta"]), rtol=1e-7,
                               atol=1e-12)
    np.testing.assert_allclose(construction.stationary_covariance_psi_closed_form(a, e), num(c["K_psi"]), rtol=1e-8)
    cf = construction.construction_losses_closed_form(a, e, th)
    G_d = num(c["K_demo"])
    assert lds.validation_loss(c["K_demo"], c["K_theta"], G_d) == pytest.approx(cf["lval_theta"], rel=1e-8)
    assert lds.ideal_loss(c["K_demo"], c["K_theta"], num(c["K_theta"])) == pytest.approx(cf["lideal_theta"], rel=1e-7)
    assert lds.validation_loss(c["K_demo"], c["K_psi"], G_d) == pytest.approx(cf["lval_psi"], rel=1e-8)
    assert lds.ideal_loss(c["K_demo"], c["K_psi"], num(c["K_psi"])) == pytest.approx(cf["lideal_psi"], rel=1e-8)


def test_scaling_limit():
    """Lemma scaling_limit, with the constant the "~" hides: every exact/leading ratio -> 1/2."""
    for a, th in ((1e-3, 1e-3), (1e-4, 1e-4)):
        row = construction.construction_row(a, 0.05, th, 10.0, {"value": 1.0, "r": 0.0, "h": 0.1})
        for k in ("scaling_lval_theta", "scaling_lideal_theta", "scaling_lval_psi", "scaling_lideal_psi"):
            assert row[k] == pytest.approx(0.5, rel=0.01 if a == 1e-3 else 1e-3), k


def test_mismatch_in_corrected_regime_and_not_in_printed_one():
    """Proposition Ktheta_Kpsi_bound. Where alpha << eps and sin(theta) << alpha^2/eps^2:
    L_val(K_theta) << L_val(K_psi) = L_ideal(K_psi) << L_ideal(K_theta). Under the printed conditions
    (eps << alpha, sin(theta) << eps^2/alpha^2) K_psi wins on both losses (documented discrepancy)."""
    inf_f = construction.inf_last_layer_ideal_loss(0.1, 1e-4, grid=80)
    r = construction.construction_row(0.1, 1.0, 1e-4, 10.0, inf_f)
    assert r["corrected_regime"] == 1 and r["paper_regime"] == 0
    assert r["lval_psi"] > 50 * r["lval_theta"]
    assert r["lideal_theta"] > 50 * r["lideal_psi"]
    assert r["lval_psi"] == pytest.approx(r["lideal_psi"], rel=1e-10)
    # and the feature-learning version (final proposition): even the best last layer stays bad
    assert r["corrected_feature_regime"] == 1 and r["inf_f_lideal"] > 10 * r["lideal_psi"]
    p = construction.construction_row(0.1, 0.01, 1e-4, 10.0, inf_f)
    assert p["paper_regime"] == 1 and p["corrected_regime"] == 0
    assert p["lval_psi"] < p["lval_theta"] / 50 and p["ordering_holds"] == 0


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")  # far-from-optimal F: huge Gamma, still accurate
@pytest.mark.parametrize("a,th", [(0.01, 1e-4), (0.1, 1e-2), (0.5, 0.3), (1.0, 0.35)])
def test_inf_over_last_layer(a, th):
    """Lemma infF_lb: inf_F L_ideal(F G_theta) >= alpha^2/(4 sin theta) (theta < pi/8), <= L_ideal(K_theta);
    the proof's closed form J(r, h) agrees with the Lyapunov solution."""
    res = construction.inf_last_layer_ideal_loss(a, th, grid=80)
    c = construction.lds_construction(a, 0.0, th)
    li_theta = construction.construction_losses_closed_form(a, 0.0, th)["lideal_theta"]
    assert res["value"] >= construction.infF_lower_bound(a, th)
    assert res["value"] >= a ** 2 / (2 * math.tan(th))  # the proof's intermediate bound
    assert res["value"] <= li_theta * (1 + 1e-9)
    assert res["value"] <= res["grid_min"] * (1 + 1e-12)
    np.testing.assert_allclose(res["F"] @ c["G_theta"], res["K"], atol=1e-12)
    K = res["F"] @ c["G_theta"]
    G = lds.stationary_state_covariance(c["A"], c["B"], K, c["Sigma_w"])
    assert lds.ideal_loss(c["K_demo"], K, G) == pytest.approx(res["value"], rel=1e-9)
    assert construction.last_layer_objective_closed_form(a, th, res["r"], res["h"]) == pytest.approx(res["value"], rel=1e-8)
    rng = np.random.default_rng(0)  # random stable last layers never beat the infimum
    for r, h in zip(rng.uniform(-0.95, 0.95, 200), rng.uniform(0.01, 0.95, 200)):
        h = h * 2 * (1 + r)  # inside the Schur-stable region of the proof
        Kv = construction.last_layer_policy(a, th, r, h)
        Gv = lds.stationary_state_covariance(c["A"], c["B"], Kv, c["Sigma_w"])
        val = lds.ideal_loss(c["K_demo"], Kv, Gv)
        assert val >= res["value"] * (1 - 1e-9)
        assert construction.last_layer_objective_closed_form(a, th, r, h) == pytest.approx(val, rel=1e-6)


class _FakeRun:
    def __init__(self, d):
        self.dir, self.rows = d, []

    def log(self, metrics, step):
        self.rows.append({"step": step, **metrics})


def _task_cfg():
    cfg = OmegaConf.load(__import__("pathlib").Path(__file__).parents[2] / "conf/task/lds.yaml")
    return OmegaConf.merge(cfg, cfg.debug)


@pytest.mark.slow
def test_run_and_report_end_to_end(tmp_path):
    cfg = OmegaConf.create({"seed": 0, "task": _task_cfg()})
    job = tmp_path / "job"
    job.mkdir()
    fake = _FakeRun(job)
    out = lds_task.run(cfg, fake)
    assert len(fake.rows) == cfg.task.horizon
    assert all(isinstance(v, (int, float)) for v in out.values())
    assert out["mc_gamma_max_abs_z"] < 5 and abs(out["mc_lval_z"]) < 5 and abs(out["mc_lideal_z"]) < 5
    assert out["construction_max_closed_form_rel_err"] < 1e-8
    assert out["corrected_regime_frac_ordering_holds"] == 1.0 and out["corrected_regime_points"] >= 1
    assert out["paper_regime_frac_ordering_holds"] == 0.0
    assert out["inf_f_min_over_paper_bound"] >= 1.0 and out["inf_f_max_over_lideal_theta"] <= 1.0 + 1e-9
    rows = list(csv.DictReader(open(job / "construction.csv")))
    assert len(rows) == len(cfg.task.alphas) * len(cfg.task.epsilons) * len(cfg.task.thetas)
    assert set(theory_report.TABLE_COLUMNS) <= set(rows[0])

    rec = {"summary": {**out, "task": "lds", "optim": "sgd", "seed": 0}, "config": cfg, "metrics": fake.rows,
           "dir": job}
    res = tmp_path / "results"
    res.mkdir()
    theory_report.lds([rec], res, "stamp")
    for f in ("construction.csv", "construction.md", "monte_carlo.csv", "monte_carlo.md", "lds_construction.png"):
        assert (res / f).stat().st_size > 0, f
    first = {f: (res / f).read_bytes() for f in ("construction.csv", "construction.md", "monte_carlo.md")}
    theory_report.report_tables([rec], res, "stamp")  # deterministic (the figure is skipped: matplotlib is slow here)
    assert all((res / f).read_bytes() == b for f, b in first.items())
