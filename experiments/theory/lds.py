"""Linear dynamical systems: test-time-feedback (TTF) shift, validation vs idealized loss.

Reproduces Proposition "LDS" (prop:LDS TTF) and the appendix "Dynamical Systems Theory"
(appdx:dynamical systems theory) of the paper.

System: s_{t+1} = A s_t + B a_t + w_t, w_t ~ N(0, Sigma_w), s_0 = 0, policies a_t = K s_t.

Proposition "LDS":
    Gamma_t(K)     = sum_{s=0}^{t-1} (A+BK)^s Sigma_w (A+BK)^{sT}        (covariance of s_t)
    Gamma_bar_T(K) = (1/T) sum_{t=1}^T Gamma_t(K)
    L_val(K)   = ||(K_demo - K) Gamma_bar_T(K_demo)^{1/2}||_F^2   (states from the demonstrator)
    L_ideal(K) = ||(K_demo - K) Gamma_bar_T(K)^{1/2}||_F^2        (states from the learner) = -R_test
    D_t(K)     = ||Gamma_t(K_demo)^{1/2} - Gamma_t(K)^{1/2}||_F^2   (TTF shift, "Wasserstein-2")

The appendix's 2 x 2 construction is experiments/theory/construction.py, with the discrepancies with
the paper found while checking it numerically (item 6 there concerns the TTF shift below); the Hydra
task that runs both is experiments/theory/lds_task.py.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.linalg import solve_discrete_lyapunov


# ============================================================================ Proposition "LDS"
def closed_loop(A, B, K) -> np.ndarray:
    return np.asarray(A, float) + np.asarray(B, float) @ np.asarray(K, float)


def spectral_radius(M) -> float:
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(M, float)))))


def state_covariances(A, B, K, Sigma_w, T: int) -> np.ndarray:
    """Stack [Gamma_0, ..., Gamma_T] (shape (T+1, n, n)); Gamma_0 = 0 because s_0 = 0.

    Uses the recursion Gamma_{t+1} = (A+BK) Gamma_t (A+BK)^T + Sigma_w, which unrolls to
    Gamma_t = sum_{s<t} (A+BK)^s Sigma_w (A+BK)^{sT} (Proposition "LDS")."""
    X = closed_loop(A, B, K)
    Sw = np.asarray(Sigma_w, float)
    out = np.zeros((int(T) + 1,) + Sw.shape)
    for t in range(int(T)):
        out[t + 1] = X @ out[t] @ X.T + Sw
    return out


def state_covariance(A, B, K, Sigma_w, t: int) -> np.ndarray:
    """Gamma_t(K) = sum_{s=0}^{t-1} (A+BK)^s Sigma_w (A+BK)^{sT}: the covariance of s_t (s_0 = 0)."""
    return state_covariances(A, B, K, Sigma_w, t)[-1]


def average_state_covariance(A, B, K, Sigma_w, T) -> np.ndarray:
    """Gamma_bar_T(K) = (1/T) sum_{t=1}^T Gamma_t(K); T = inf gives the limit Gamma_inf(K) (Lemma "ricatti")."""
    if math.isinf(T):
        return stationary_state_covariance(A, B, K, Sigma_w)
    if int(T) < 1:
        raise ValueError(f"horizon T must be >= 1, got {T}")
    return state_covariances(A, B, K, Sigma_w, int(T))[1:].mean(axis=0)


def stationary_state_covariance(A, B, K, Sigma_w) -> np.ndarray:
    """Gamma_inf(K): the unique solution of Gamma = (A+BK) Gamma (A+BK)^T + Sigma_w (Lemma "ricatti";
    a discrete Lyapunov equation, which the paper calls a Riccati equation). Requires rho(A+BK) < 1."""
    X = closed_loop(A, B, K)
    rho = spectral_radius(X)
    if not rho < 1.0:
        raise ValueError(f"closed loop A + B K is not stable: spectral radius rho(A + B K) = {rho:.6g} >= 1, "
                         "so the stationary state covariance Gamma_inf(K) does not exist (Lemma 'ricatti')")
    G = solve_discrete_lyapunov(X, np.asarray(Sigma_w, float))
    return 0.5 * (G + G.T)


def psd_sqrt(S) -> np.ndarray:
    """Symmetric PSD square root (eigenvalues clipped at 0 against round-off)."""
    S = 0.5 * (np.asarray(S, float) + np.asarray(S, float).T)
    w, V = np.linalg.eigh(S)
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T


def _weighted_error(K_demo, K, Gamma) -> float:
    # ||Delta Gamma^{1/2}||_F^2 = tr(Delta Gamma Delta^T) for PSD Gamma (no square root needed)
    D = np.asarray(K_demo, float) - np.asarray(K, float)
    return float(np.trace(D @ np.asarray(Gamma, float) @ D.T))


def validation_loss(K_demo, K, Gamma_bar_demo) -> float:
    """L_val(K) = ||(K_demo - K) Gamma_bar_T(K_demo)^{1/2}||_F^2 (states drawn from the demonstrator)."""
    return _weighted_error(K_demo, K, Gamma_bar_demo)


def ideal_loss(K_demo, K, Gamma_bar_K) -> float:
    """L_ideal(K) = -R_test(K) = ||(K_demo - K) Gamma_bar_T(K)^{1/2}||_F^2 (states from the learner itself)."""
    return _weighted_error(K_demo, K, Gamma_bar_K)


def ttf_shift_w2(Gamma_demo_t, Gamma_theta_t) -> float:
    """The paper's TTF shift ||Gamma_demo^{1/2} - Gamma_theta^{1/2}||_F^2 (Proposition "LDS").

    Equal to the squared Wasserstein-2 distance between N(0, Gamma_demo) and N(0, Gamma_theta) only when
    the two covariances commute; in general it is an upper bound on it (see gaussian_w2_squared)."""
    return float(np.sum((psd_sqrt(Gamma_demo_t) - psd_sqrt(Gamma_theta_t)) ** 2))


def gaussian_w2_squared(S1, S2) -> float:
    """Exact W2^2(N(0,S1), N(0,S2)) = tr S1 + tr S2 - 2 tr((S1^{1/2} S2 S1^{1/2})^{1/2})."""
    r1 = psd_sqrt(S1)
    cross = psd_sqrt(r1 @ np.asarray(S2, float) @ r1)
    return float(max(np.trace(S1) + np.trace(S2) - 2.0 * np.trace(cross), 0.0))


def monte_carlo_rollouts(A, B, K, Sigma_w, T: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """States of n independent rollouts of a_t = K s_t from s_0 = 0 (the paper's initial condition).

    Returns an array of shape (n, T+1, dim) holding s_0 (= 0), s_1, ..., s_T."""
    X = closed_loop(A, B, K)
    Lw = np.linalg.cholesky(np.asarray(Sigma_w, float))
    d = X.shape[0]
    s = np.zeros((int(T) + 1, int(n), d))  # time-major while simulating (contiguous slices)
    for t in range(int(T)):
        # einsum rather than `@`: OpenBLAS threading makes tall-skinny matmuls ~10x slower here
        s[t + 1] = np.einsum("nj,ij->ni", s[t], X) + np.einsum("nj,ij->ni", rng.standard_normal((int(n), d)), Lw)
    return s.transpose(1, 0, 2)


# ------------------------------------------------------------------ Monte Carlo check (part a)
def random_stable_lds(n_state: int, n_action: int, closed_loop_radius: float, noise_floor: float,
                      rng: np.random.Generator):
    """(A, B, Sigma_w, K_demo) with rho(A + B K_demo) = closed_loop_radius (A itself may be unstable)."""
    B = rng.standard_normal((n_state, n_action)) / math.sqrt(n_action)
    K_demo = rng.standard_normal((n_action, n_state)) / math.sqrt(n_state)
    M = rng.standard_normal((n_state, n_state))
    M *= closed_loop_radius / spectral_radius(M)
    A = M - B @ K_demo
    W = rng.standard_normal((n_state, n_state))
    Sigma_w = W @ W.T / n_state + noise_floor * np.eye(n_state)
    return A, B, Sigma_w, K_demo


def perturbed_policy(A, B, K_demo, scale: float, rng: np.random.Generator, max_halvings: int = 30):
    """K = K_demo + delta E (E Gaussian, ||E||_F ~ 1); delta halves from `scale` until rho(A+BK) < 1."""
    E = rng.standard_normal(K_demo.shape)
    E /= np.linalg.norm(E)
    delta = float(scale)
    for _ in range(max_halvings):
        K = K_demo + delta * E
        if spectral_radius(closed_loop(A, B, K)) < 1.0:
            return K, delta
        delta /= 2
    raise ValueError("could not find a stabilising perturbation of K_demo")


def _mc_cov(states: np.ndarray) -> np.ndarray:
    """Per-time second moments E[s_t s_t^T] (the mean is known to be 0), shape (T+1, d, d)."""
    n = states.shape[0]
    return np.stack([np.einsum("ni,nj->ij", states[:, t], states[:, t]) / n for t in range(states.shape[1])])


def monte_carlo_check(A, B, Sigma_w, K_demo, K, T: int, n: int, rng: np.random.Generator):
    """Closed forms of Proposition "LDS" against n Monte Carlo rollouts; returns (summary, per-t rows)."""
    s_demo = monte_carlo_rollouts(A, B, K_demo, Sigma_w, T, n, rng)
    s_k = monte_carlo_rollouts(A, B, K, Sigma_w, T, n, rng)
    G_demo = state_covariances(A, B, K_demo, Sigma_w, T)
    G_k = state_covariances(A, B, K, Sigma_w, T)
    C_demo, C_k = _mc_cov(s_demo), _mc_cov(s_k)
    rows, rel_errs, zmax = [], [], 0.0
    for t in range(1, T + 1):
        for G, C in ((G_demo[t], C_demo[t]), (G_k[t], C_k[t])):
            rel_errs.append(np.linalg.norm(C - G) / np.linalg.norm(G))
            sd = np.sqrt((np.outer(np.diag(G), np.diag(G)) + G ** 2) / n)  # sd of a Gaussian second moment
            zmax = max(zmax, float(np.max(np.abs(C - G) / sd)))
        rows.append({"gamma_rel_err_demo": float(rel_errs[-2]), "gamma_rel_err_K": float(rel_errs[-1]),
                     "ttf_paper": ttf_shift_w2(G_demo[t], G_k[t]), "ttf_w2": gaussian_w2_squared(G_demo[t], G_k[t]),
                     "ttf_paper_mc": ttf_shift_w2(C_demo[t], C_k[t]), "ttf_w2_mc": gaussian_w2_squared(C_demo[t], C_k[t])})
    D = K_demo - K
    # per-rollout time-averaged losses over t = 1..T, then mean and standard error over rollouts
    lval_roll = (np.einsum("ntj,ij->nti", s_demo[:, 1:], D) ** 2).sum(-1).mean(1)
    lid_roll = (np.einsum("ntj,ij->nti", s_k[:, 1:], D) ** 2).sum(-1).mean(1)
    lval = validation_loss(K_demo, K, G_demo[1:].mean(0))
    lid = ideal_loss(K_demo, K, G_k[1:].mean(0))
    last = rows[-1]
    rel = lambda est, ref: abs(est - ref) / abs(ref)
    summary = {
        "mc_gamma_rel_err_max": float(max(rel_errs)),
        "mc_gamma_max_abs_z": zmax,
        "lval_closed": lval, "lval_mc": float(lval_roll.mean()), "mc_lval_rel_err": rel(lval_roll.mean(), lval),
        "mc_lval_z": float((lval_roll.mean() - lval) / (lval_roll.std() / math.sqrt(n))),
        "lideal_closed": lid, "lideal_mc": float(lid_roll.mean()), "mc_lideal_rel_err": rel(lid_roll.mean(), lid),
        "mc_lideal_z": float((lid_roll.mean() - lid) / (lid_roll.std() / math.sqrt(n))),
        "ttf_paper_T": last["ttf_paper"], "ttf_w2_T": last["ttf_w2"],
        "mc_ttf_paper_rel_err": rel(last["ttf_paper_mc"], last["ttf_paper"]),
        "mc_ttf_w2_rel_err": rel(last["ttf_w2_mc"], last["ttf_w2"]),
        "rho_demo": spectral_radius(closed_loop(A, B, K_demo)), "rho_K": spectral_radius(closed_loop(A, B, K)),
    }
    return summary, rows
