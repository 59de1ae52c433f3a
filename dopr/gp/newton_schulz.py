"""Quintic Newton-Schulz iteration for the orthogonal polar factor of a matrix.

For G = U S V^T, each step maps X -> a X + b (X X^T) X + c (X X^T)^2 X, which applies the
odd polynomial phi(s) = a s + b s^3 + c s^5 to every singular value and leaves U and V alone.
Starting from X_0 = G / ||G||_F (all singular values in [0, 1]), five steps with the
coefficients of Jordan et al. (2024) push every singular value into roughly [0.7, 1.2], so
the result approximates U V^T without an SVD.
"""

import math

import torch

# (a, b, c): chosen for a steep slope at zero (phi'(0) = a) rather than exact convergence to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                   coefficients: tuple = NS_COEFFICIENTS) -> torch.Tensor:
    """Approximate U V^T for a 2-D ``G = U S V^T`` with ``steps`` quintic Newton-Schulz steps of
    ``coefficients`` (a, b, c); ``eps`` guards the normalisation ``G / max(||G||_F, eps)``.

    Computed in float32, or in bfloat16 when ``G`` is on a CUDA device; returned as float32.
    """
    if G.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"Invalid number of Newton-Schulz steps: {steps}")
    a, b, c = coefficients
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    # Iterate on the wide orientation so that the Gram matrix X X^T is the smaller one.
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.T
    # ||X||_2 <= ||X||_F, so dividing by the Frobenius norm puts all singular values in [0, 1].
    X = X / X.norm().clamp_min(eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    if transposed:
        X = X.T
    return X.float()


def as_matrix(t):
    """A weight as the matrix Muon orthogonalises: (out, in x kernel) for a convolution's filters (Keller
    Jordan's reference Muon), the weight itself when it is a matrix."""
    return t if t.ndim == 2 else t.reshape(t.shape[0], -1)


def matrix_shape(shape) -> tuple:
    """(rows, columns) of :func:`as_matrix` for a weight of `shape`."""
    return shape[0], math.prod(shape[1:])
