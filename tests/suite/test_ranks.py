"""experiments.llm.ranks: stable, nuclear and activation stable ranks on matrices with known spectra (float64)."""
import pytest
import torch

from experiments.llm.ranks import activation_stable_rank, nuclear_rank, stable_rank


def with_spectrum(s, rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))[0][:, : len(s)]
    v = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))[0][:, : len(s)]
    return u @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ v.T


# float64 SVD and eigh are backward stable: the singular values carry errors ~ 1e-15 ||A||, so the
# ratios below agree to ~1e-13; 1e-10 leaves room for any LAPACK.
TOL = 1e-10


@pytest.mark.parametrize("shape", [(7, 12), (12, 7)])
def test_stable_and_nuclear_rank_of_a_matrix_with_known_singular_values(shape):
    a = with_spectrum([3.0, 2.0, 1.0, 0.5], *shape)
    assert stable_rank(a) == pytest.approx((9 + 4 + 1 + 0.25) / 9, rel=TOL)
    assert nuclear_rank(a) == pytest.approx((3 + 2 + 1 + 0.5) ** 2 / (9 + 4 + 1 + 0.25), rel=TOL)


def test_r_equal_singular_values_give_rank_r_for_every_measure_and_zero_gives_zero():
    a = with_spectrum([2.0] * 5, 9, 11)
    assert stable_rank(a) == pytest.approx(5, rel=TOL) and nuclear_rank(a) == pytest.approx(5, rel=TOL)
    assert activation_stable_rank(a @ a.T / 11) == pytest.approx(5, rel=TOL)
    z = torch.zeros(4, 6)
    assert stable_rank(z) == nuclear_rank(z) == activation_stable_rank(z @ z.T) == 0.0


def test_activation_stable_rank_of_the_covariance_is_the_stable_rank_of_the_activations():
    x = with_spectrum([5.0, 1.0, 1.0, 0.1], 16, 64, seed=3)   # d x b activations
    sigma = x @ x.T / 64
    assert activation_stable_rank(sigma) == pytest.approx(stable_rank(x), rel=TOL)
    # the covariance's own stable rank: sum e_i^2 / e_1^2 with eigenvalues e_i = s_i^2 / b
    assert stable_rank(sigma) == pytest.approx((625 + 1 + 1 + 1e-4) / 625, rel=TOL)


def test_rank_measures_refuse_what_is_not_a_finite_matrix():
    with pytest.raises(ValueError, match="needs a matrix, got a tensor of shape \\(3,\\)"):
        stable_rank(torch.ones(3))
    with pytest.raises(ValueError, match="covariance must be square"):
        activation_stable_rank(torch.ones(2, 3))
    with pytest.raises(ValueError, match="non-finite"):
        nuclear_rank(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
