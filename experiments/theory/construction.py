"""The appendix "Dynamical Systems Theory" 2 x 2 construction, analysed in the T -> infinity limit.

Appendix construction (2 x 2): A = diag(0, 1), B = I, Sigma_w = I, K_demo = -alpha e2 e2^T,
K_theta = F_theta G_theta = mu e2 (-alpha/mu)[cos theta, sin theta], K_psi = K_demo - eps e1 e2^T,
analysed in the T -> infinity limit where Gamma_bar_T -> Gamma_inf (Lemma "ricatti").

Discrepancies with the paper found while checking it numerically (the code implements the correct
mathematics; tests pin each point):

1. Proposition "Ktheta Kpsi bound" states its regime as "eps << alpha and sin theta << eps^2/alpha^2".
   In that regime the first inequality is reversed: L_val(K_theta) ~ alpha/2 while
   L_val(K_psi) = eps^2/(alpha(2-alpha)) ~ eps^2/(2 alpha), so L_val(K_psi) << L_val(K_theta) and
   K_psi beats K_theta on BOTH losses. The ratios are
       L_val(K_psi)/L_val(K_theta) ~ eps^2/alpha^2,  L_ideal(K_theta)/L_ideal(K_psi) ~ alpha^2/(eps^2 sin theta),
   so the chain L_val(K_theta) << L_val(K_psi) ~ L_ideal(K_psi) << L_ideal(K_theta) holds for
   alpha << eps and sin theta << alpha^2/eps^2 (the paper's conditions with alpha and eps swapped).
   Likewise the final proposition ("sin theta << eps^2/alpha^3 and eps << alpha") needs
   alpha << eps and sin theta << alpha^3/eps^2 (from inf_F L_ideal >= alpha^2/(4 sin theta)).
2. F_psi = [alpha, 1]^T (as printed) gives F_psi G_psi = K_demo - alpha^2 e1 e2^T, i.e. eps = alpha^2,
   which cannot satisfy alpha << eps. The stated K_psi = K_demo - eps e1 e2^T needs
   F_psi = [eps/alpha, 1]^T; we use that (G_psi = G_* = -alpha e2^T as in the paper).
3. Sign: F_theta G_theta = K_demo + alpha [[0,0],[-cos theta, 1 - sin theta]] (the paper prints "-");
   harmless, the losses are quadratic in K - K_demo (Lemma "err_comp" is correct).
4. Lemma for Gamma_inf(K_demo): A + B K_demo = diag(0, 1 - alpha) has eigenvalues 0 and 1 - alpha
   (not "0.5, 1 - alpha"); the result diag(1, 1/(1-(1-alpha)^2)) is correct. A + B K_theta is LOWER
   triangular (the proof says upper); stability holds for 0 < alpha sin theta < 2.
5. Lemma "scaling_limit": the "~" hides a constant 1/2: as alpha, theta -> 0,
   L_val(K_theta)/alpha -> 1/2, L_ideal(K_theta) sin(theta)/alpha -> 1/2, L_{val,ideal}(K_psi) alpha/eps^2 -> 1/2.
   L_val(K_psi) = L_ideal(K_psi) = eps^2/(alpha(2-alpha)) exactly.
6. TTF shift: ||S1^{1/2} - S2^{1/2}||_F^2 is the squared W2 distance between N(0,S1) and N(0,S2) only
   when S1 and S2 commute; in general it is an UPPER bound on
   W2^2 = tr S1 + tr S2 - 2 tr((S1^{1/2} S2 S1^{1/2})^{1/2}) (since tr(S1^{1/2}S2^{1/2}) <= the nuclear norm
   of S1^{1/2}S2^{1/2}). It is also W2 squared, not W2. (The proof also plugs Gamma_bar_t where the
   statement has Gamma_t; the marginal of s_t has covariance Gamma_t, which we use.) In the construction
   Gamma_inf(K_demo) and Gamma_inf(K_theta) are diagonal (the two agree), Gamma_inf(K_psi) is not.
7. Lemma "infF_lb": the closed form J(r, h) = N/(h tau^2 (1-r)(2+2r-h)) of the proof is correct
   (checked against the Lyapunov solution), and the bound inf_F L_ideal(F G_theta) >= alpha^2/(4 sin theta)
   (even >= alpha^2/(2 tan theta)) holds numerically on our grid. Typo: "h := -alpha v_2 sin theta theta".
"""
from __future__ import annotations

import math
import warnings

import numpy as np
from scipy.linalg import LinAlgWarning
from scipy.optimize import minimize

from .lds import gaussian_w2_squared, ideal_loss, stationary_state_covariance, ttf_shift_w2, validation_loss



# ============================================================ appendix construction (2 x 2)
def _e(i: int) -> np.ndarray:
    return np.eye(2)[:, i - 1]


def lds_construction(alpha: float, epsilon: float, theta: float, mu: float = 1.0) -> dict:
    """(A, B, Sigma_w, K_demo, K_theta, K_psi) and their factors, as in appdx:construct LDS Lideal Lval example.

    F_psi = [eps/alpha, 1]^T so that K_psi = K_demo - eps e1 e2^T as the paper states (its printed
    F_psi = [alpha, 1]^T would force eps = alpha^2; see the module docstring)."""
    e1, e2 = _e(1), _e(2)
    A = np.diag([0.0, 1.0])
    F_star, G_star = e2[:, None], -alpha * e2[None, :]
    F_theta = mu * e2[:, None]
    G_theta = -alpha / mu * np.array([[math.cos(theta), math.sin(theta)]])
    F_psi = np.array([[epsilon / alpha], [1.0]])
    G_psi = G_star.copy()
    return {"A": A, "B": np.eye(2), "Sigma_w": np.eye(2),
            "K_demo": F_star @ G_star, "F_star": F_star, "G_star": G_star,
            "K_theta": F_theta @ G_theta, "F_theta": F_theta, "G_theta": G_theta,
            "K_psi": F_psi @ G_psi, "F_psi": F_psi, "G_psi": G_psi}


def stationary_covariance_demo_closed_form(alpha: float) -> np.ndarray:
    """Gamma_inf(K_demo) = diag(1, 1/(1-(1-alpha)^2)); needs 0 < alpha < 2."""
    if not 0 < alpha < 2:
        raise ValueError(f"K_demo is unstable unless 0 < alpha < 2 (alpha = {alpha})")
    return np.diag([1.0, 1.0 / (1.0 - (1.0 - alpha) ** 2)])


def stationary_covariance_theta_closed_form(alpha: float, theta: float) -> np.ndarray:
    """Lemma "ricatti_theta": Gamma_inf(K_theta) = diag(1, (1+alpha^2 cos^2)/(alpha sin (2 - alpha sin)))."""
    a_s = alpha * math.sin(theta)
    if not 0 < a_s < 2:
        raise ValueError(f"K_theta is unstable unless 0 < alpha sin(theta) < 2 (got {a_s})")
    return np.diag([1.0, (1.0 + alpha ** 2 * math.cos(theta) ** 2) / (a_s * (2.0 - a_s))])


def stationary_covariance_psi_closed_form(alpha: float, epsilon: float) -> np.ndarray:
    """Lemma "Gamma_psi": [[1 + eps^2/(a(2-a)), -eps(1-a)/(a(2-a))], [., 1/(a(2-a))]]."""
    if not 0 < alpha < 2:
        raise ValueError(f"K_psi is unstable unless 0 < alpha < 2 (alpha = {alpha})")
    g = 1.0 / (alpha * (2.0 - alpha))
    off = -epsilon * (1.0 - alpha) * g
    return np.array([[1.0 + epsilon ** 2 * g, off], [off, g]])


def construction_losses_closed_form(alpha: float, epsilon: float, theta: float) -> dict:
    """T = inf losses from the proof of Lemma "scaling_limit" (and its K_psi analogue)."""
    s, c = math.sin(theta), math.cos(theta)
    g_psi = epsilon ** 2 / (alpha * (2.0 - alpha))
    return {"lval_theta": alpha ** 2 * c ** 2 + alpha ** 2 * (1 - s) ** 2 / (1 - (1 - alpha) ** 2),
            "lideal_theta": alpha ** 2 * c ** 2 + alpha ** 2 * (1 - s) ** 2 * (1 + alpha ** 2 * c ** 2)
            / (alpha * s * (2 - alpha * s)),
            "lval_psi": g_psi, "lideal_psi": g_psi}


def scaling_limits(alpha: float, epsilon: float, theta: float) -> dict:
    """Leading orders of Lemma "scaling_limit": L_val(K_theta) ~ alpha, L_ideal(K_theta) ~ alpha/sin theta,
    L_val(K_psi), L_ideal(K_psi) ~ eps^2/alpha. The exact/leading ratios tend to 1/2 as alpha, theta -> 0."""
    return {"lval_theta": alpha, "lideal_theta": alpha / math.sin(theta),
            "lval_psi": epsilon ** 2 / alpha, "lideal_psi": epsilon ** 2 / alpha}


def subspace_distance(G, G_star) -> float:
    """dist(G, G_*) = ||P_G P_perp||_op, P_G onto rowsp(G), P_perp onto rowsp(G_*)^perp (eq. subspace dist)."""
    proj = lambda M: M.T @ np.linalg.pinv(M.T)
    P = proj(np.asarray(G, float))
    P_perp = np.eye(P.shape[0]) - proj(np.asarray(G_star, float))
    return float(np.linalg.norm(P @ P_perp, 2))


# ---------------------------------------------------- Lemma "infF_lb": inf over the last layer F
def last_layer_policy(alpha: float, theta: float, r, h):
    """K = F G_theta in the proof's coordinates: K = -v w^T, w = -alpha [cos, sin]^T,
    r = alpha v_1 cos(theta), h = -alpha v_2 sin(theta) (a bijection v <-> (r, h); broadcasts)."""
    c, s = math.cos(theta), math.sin(theta)
    r, h = np.asarray(r, float), np.asarray(h, float)
    v1, v2 = r / (alpha * c), -h / (alpha * s)
    K = np.zeros(r.shape + (2, 2))
    K[..., 0, 0], K[..., 0, 1] = alpha * v1 * c, alpha * v1 * s
    K[..., 1, 0], K[..., 1, 1] = alpha * v2 * c, alpha * v2 * s
    return K


def last_layer_objective_closed_form(alpha: float, theta: float, r, h):
    """The proof's J(r, h) = N(r,h,tau,alpha) / (h tau^2 (1-r)(2+2r-h)) = L_ideal(F G_theta), T = inf."""
    t2 = math.tan(theta) ** 2
    a = alpha
    N = (a ** 2 * (1 + r) * h ** 2 + a ** 2 * t2 * (1 - r) ** 2 * (1 + r) + 2 * (1 - a) * h ** 3
         + t2 * (2 * a ** 2 * h * r - 2 * a * h ** 2 * r + 2 * a * h * r ** 2 - 2 * a * h + h ** 2 * (1 + r)
                 + 2 * h * r ** 2) + t2 ** 2 * r ** 2 * (1 + r))
    return N / (h * t2 * (1 - r) * (2 + 2 * r - h))


def infF_lower_bound(alpha: float, theta: float) -> float:
    """Lemma "infF_lb": inf_F L_ideal(F G_theta) >= alpha^2/(4 sin theta) for theta in (0, pi/8)."""
    return alpha ** 2 / (4.0 * math.sin(theta))


def _batched_ideal_loss(alpha, K):
    """L_ideal (T = inf) for a batch of policies K (..., 2, 2) of the construction, via the vectorised
    Lyapunov equation (I - X kron X) vec(Gamma) = vec(I); independent of scipy's solver."""
    X = np.diag([0.0, 1.0]) + K
    N = X.reshape(-1, 2, 2)
    kron = np.einsum("nij,nkl->nikjl", N, N).reshape(-1, 4, 4)
    G = np.linalg.solve(np.eye(4) - kron, np.broadcast_to(np.eye(2).reshape(4), (len(N), 4))[..., None])
    G = G.reshape(-1, 2, 2)
    D = K.reshape(-1, 2, 2) - np.diag([0.0, -alpha])
    return np.einsum("nij,njk,nik->n", D, G, D).reshape(K.shape[:-2])


def _rh_from_z(z0, z1):
    """Unconstrained (z0, z1) -> the stability region -1 < r < 1, 0 < h < 2(1+r) of the proof."""
    r = np.tanh(z0)
    return r, 2.0 * (1.0 + r) / (1.0 + np.exp(-np.asarray(z1, float)))


def inf_last_layer_ideal_loss(alpha: float, theta: float, grid: int = 160) -> dict:
    """inf over last layers F (with A + B F G_theta stable) of L_ideal(F G_theta), T = inf.

    Every F in R^{2x1} is some v in R^2, i.e. some (r, h) in the Schur-stable region. Dense grid in
    (atanh r, logit(h/(2(1+r)))) with a batched Lyapunov solve, then Nelder-Mead from the 2 best grid
    points (2x2 Lyapunov solved as a 4x4 linear system); the value at the minimiser is recomputed with
    scipy's solve_discrete_lyapunov. Returns value, minimiser (r, h), K and F (mu = 1)."""
    z0 = np.linspace(-4.0, 4.0, grid)
    z1 = np.linspace(-40.0, 6.0, grid)
    Z0, Z1 = np.meshgrid(z0, z1, indexing="ij")
    R, H = _rh_from_z(Z0, Z1)
    with np.errstate(all="ignore"):
        J = _batched_ideal_loss(alpha, last_layer_policy(alpha, theta, R, H))
    J = np.where(np.isfinite(J) & (J > 0), J, np.inf)
    cons = lds_construction(alpha, 0.0, theta)

    def objective(z):
        r, h = _rh_from_z(z[0], z[1])
        with np.errstate(all="ignore"):
            val = float(_batched_ideal_loss(alpha, last_layer_policy(alpha, theta, r, h)))
        return val if np.isfinite(val) and val > 0 else np.inf

    best = (np.inf, None)
    for idx in np.argsort(J, axis=None)[:2]:
        i, j = np.unravel_index(idx, J.shape)
        res = minimize(objective, [Z0[i, j], Z1[i, j]], method="Nelder-Mead",
                       options={"xatol": 1e-9, "fatol": 1e-13, "maxiter": 2000, "maxfev": 4000})
        if res.fun < best[0]:
            best = (float(res.fun), res.x)
    r, h = _rh_from_z(*best[1])
    K = last_layer_policy(alpha, theta, float(r), float(h))
    # the reported value is recomputed with scipy's Lyapunov solver (stationary_state_covariance)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LinAlgWarning)
        value = ideal_loss(cons["K_demo"], K, stationary_state_covariance(cons["A"], cons["B"], K, cons["Sigma_w"]))
    F = K @ np.linalg.pinv(cons["G_theta"])  # K = F G_theta exactly (K's rows lie in rowsp(G_theta))
    return {"value": value, "r": float(r), "h": float(h), "K": K, "F": F, "grid_min": float(J.min())}


# ----------------------------------------------------------------------- the construction table
def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def construction_row(alpha: float, epsilon: float, theta: float, margin: float, inf_f: dict) -> dict:
    c = lds_construction(alpha, epsilon, theta)
    A, B, Sw, Kd, Kt, Kp = (c[k] for k in ("A", "B", "Sigma_w", "K_demo", "K_theta", "K_psi"))
    G_demo = stationary_state_covariance(A, B, Kd, Sw)
    G_theta = stationary_state_covariance(A, B, Kt, Sw)
    G_psi = stationary_state_covariance(A, B, Kp, Sw)
    lv_t, lv_p = validation_loss(Kd, Kt, G_demo), validation_loss(Kd, Kp, G_demo)
    li_t, li_p = ideal_loss(Kd, Kt, G_theta), ideal_loss(Kd, Kp, G_psi)
    cf = construction_losses_closed_form(alpha, epsilon, theta)
    lead = scaling_limits(alpha, epsilon, theta)
    s = math.sin(theta)
    ll = lambda a, b: margin * a <= b  # "a << b" read as a factor `margin`
    row = {
        "alpha": alpha, "epsilon": epsilon, "theta": theta, "sin_theta": s,
        "lval_theta": lv_t, "lval_psi": lv_p, "lideal_theta": li_t, "lideal_psi": li_p,
        "lval_ratio_psi_over_theta": lv_p / lv_t, "lideal_ratio_theta_over_psi": li_t / li_p,
        "ordering_margin": min(lv_p / lv_t, li_t / li_p),
        "inf_f_lideal": inf_f["value"], "inf_f_r": inf_f["r"], "inf_f_h": inf_f["h"],
        "inf_f_paper_bound": infF_lower_bound(alpha, theta), "inf_f_bound_2tan": alpha ** 2 / (2 * math.tan(theta)),
        "inf_f_over_bound": inf_f["value"] / infF_lower_bound(alpha, theta),
        "inf_f_over_lideal_theta": inf_f["value"] / li_t, "inf_f_over_lideal_psi": inf_f["value"] / li_p,
        "feature_ordering_margin": min(lv_p / lv_t, inf_f["value"] / li_p),
        "inf_f_closed_form_rel_err": abs(last_layer_objective_closed_form(alpha, theta, inf_f["r"], inf_f["h"])
                                         - inf_f["value"]) / inf_f["value"],
        "dist_G_theta": subspace_distance(c["G_theta"], c["G_star"]),
        "dist_G_psi": subspace_distance(c["G_psi"], c["G_star"]),
        "gamma_demo_closed_form_rel_err": _rel(stationary_covariance_demo_closed_form(alpha), G_demo),
        "gamma_theta_closed_form_rel_err": _rel(stationary_covariance_theta_closed_form(alpha, theta), G_theta),
        "gamma_psi_closed_form_rel_err": _rel(stationary_covariance_psi_closed_form(alpha, epsilon), G_psi),
        "loss_closed_form_rel_err": max(abs(cf[k] - v) / v for k, v in
                                        (("lval_theta", lv_t), ("lval_psi", lv_p), ("lideal_theta", li_t),
                                         ("lideal_psi", li_p))),
        "scaling_lval_theta": lv_t / lead["lval_theta"], "scaling_lideal_theta": li_t / lead["lideal_theta"],
        "scaling_lval_psi": lv_p / lead["lval_psi"], "scaling_lideal_psi": li_p / lead["lideal_psi"],
        "ttf_theta_paper": ttf_shift_w2(G_demo, G_theta), "ttf_theta_w2": gaussian_w2_squared(G_demo, G_theta),
        "ttf_psi_paper": ttf_shift_w2(G_demo, G_psi), "ttf_psi_w2": gaussian_w2_squared(G_demo, G_psi),
        # regimes: as printed in the paper, and corrected (module docstring, point 1)
        "paper_regime": int(ll(epsilon, alpha) and ll(s, epsilon ** 2 / alpha ** 2)),
        "corrected_regime": int(ll(alpha, epsilon) and ll(s, alpha ** 2 / epsilon ** 2)),
        "paper_feature_regime": int(ll(epsilon, alpha) and ll(s, epsilon ** 2 / alpha ** 3)),
        "corrected_feature_regime": int(ll(alpha, epsilon) and ll(s, alpha ** 3 / epsilon ** 2)),
        "ordering_holds": int(lv_t < lv_p and li_p < li_t),
        "feature_ordering_holds": int(lv_t < lv_p and li_p < inf_f["value"]),
        "scaling_lemma_applies": int(theta < math.pi / 4), "infF_lemma_applies": int(theta < math.pi / 8),
    }
    row["closed_form_rel_err"] = max(row["gamma_demo_closed_form_rel_err"], row["gamma_theta_closed_form_rel_err"],
                                     row["gamma_psi_closed_form_rel_err"], row["loss_closed_form_rel_err"])
    return row


CONSTRUCTION_COLUMNS = list(construction_row(0.1, 1.0, 1e-3, 10.0, {"value": 1.0, "r": 0.0, "h": 1e-4}))


def construction_table(alphas, epsilons, thetas, margin: float = 10.0, grid: int = 160) -> list:
    rows = []
    for a in alphas:
        for th in thetas:
            inf_f = inf_last_layer_ideal_loss(a, th, grid)  # independent of epsilon
            for e in epsilons:
                rows.append(construction_row(a, e, th, margin, inf_f))
    return sorted(rows, key=lambda r: (r["alpha"], r["epsilon"], r["theta"]))


def construction_summary(rows: list) -> dict:
    def pick(key, cond=lambda r: True):
        return [r[key] for r in rows if cond(r)]

    paper = lambda r: r["paper_regime"] == 1
    corr = lambda r: r["corrected_regime"] == 1
    corr_f = lambda r: r["corrected_feature_regime"] == 1
    in_lemma = lambda r: r["infF_lemma_applies"] == 1
    frac = lambda xs: float(np.mean(xs)) if xs else float("nan")
    mn = lambda xs: float(min(xs)) if xs else float("nan")
    mx = lambda xs: float(max(xs)) if xs else float("nan")
    small = min(rows, key=lambda r: (r["alpha"], r["theta"], r["epsilon"]))
    return {
        "construction_points": len(rows),
        "construction_max_closed_form_rel_err": mx(pick("closed_form_rel_err")),
        "construction_min_lideal_ratio": mn(pick("lideal_ratio_theta_over_psi")),
        "construction_max_lideal_ratio": mx(pick("lideal_ratio_theta_over_psi")),
        "paper_regime_points": len(pick("alpha", paper)),
        "paper_regime_frac_ordering_holds": frac(pick("ordering_holds", paper)),
        "paper_regime_max_ordering_margin": mx(pick("ordering_margin", paper)),
        "corrected_regime_points": len(pick("alpha", corr)),
        "corrected_regime_frac_ordering_holds": frac(pick("ordering_holds", corr)),
        "corrected_regime_min_ordering_margin": mn(pick("ordering_margin", corr)),
        "corrected_feature_regime_points": len(pick("alpha", corr_f)),
        "corrected_feature_regime_min_margin": mn(pick("feature_ordering_margin", corr_f)),
        "inf_f_min_over_paper_bound": mn(pick("inf_f_over_bound", in_lemma)),
        "inf_f_max_over_lideal_theta": mx(pick("inf_f_over_lideal_theta")),
        "inf_f_max_closed_form_rel_err": mx(pick("inf_f_closed_form_rel_err")),
        "scaling_alpha": small["alpha"], "scaling_theta": small["theta"],
        "scaling_lval_theta": small["scaling_lval_theta"], "scaling_lideal_theta": small["scaling_lideal_theta"],
        "scaling_lval_psi": small["scaling_lval_psi"],
    }
