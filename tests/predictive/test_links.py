"""Link functions: the eigh-based Gaussian sampler, the probit on differences of logits
and the centred Laplace bridge."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import pairwise_probit

from laplace_glas.predictive.links import gaussian_samples, laplace_bridge, probit


def test_gaussian_samples_of_a_singular_covariance():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(2, 4, 1, generator=g, dtype=torch.float64)
    cov = B @ B.transpose(1, 2)  # rank 1 in 4 dimensions: Cholesky would fail
    mu = torch.randn(2, 4, generator=g, dtype=torch.float64)
    draws = gaussian_samples(mu, cov, 100_000, generator=g)
    assert draws.shape == (100_000, 2, 4)
    for i in range(2):
        emp = torch.cov(draws[:, i].T)
        torch.testing.assert_close(emp, cov[i], atol=0.05 * cov[i].abs().max(), rtol=0)
        torch.testing.assert_close(
            draws[:, i].mean(0), mu[i], atol=0.02 * cov[i].diag().max().sqrt().item() * 3, rtol=0
        )


def test_gaussian_samples_diagonal():
    g = torch.Generator().manual_seed(1)
    mu, var = torch.zeros(3, 2), torch.tensor([[1.0, 4.0]] * 3)
    draws = gaussian_samples(mu, var, 50_000, generator=g)
    torch.testing.assert_close(draws.var(0), var, rtol=0.05, atol=0)


def test_laplace_bridge_is_shift_invariant_and_normalised():
    g = torch.Generator().manual_seed(2)
    mu = torch.randn(5, 3, generator=g, dtype=torch.float64)
    A = torch.randn(5, 3, 3, generator=g, dtype=torch.float64)
    var = A @ A.transpose(1, 2) + 0.1 * torch.eye(3, dtype=torch.float64)
    probs = laplace_bridge(mu, var)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    # softmax is invariant to a common shift of the logits; so is the centred bridge
    torch.testing.assert_close(laplace_bridge(mu + 7.0, var), probs)
    assert (probs >= 0).all()


def _gaussians(seed: int, n: int = 5, C: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = 2 * torch.randn(n, C, generator=g, dtype=torch.float64)
    A = torch.randn(n, C, C, generator=g, dtype=torch.float64)
    return mu, A @ A.transpose(1, 2)


def _laplace_torch_probit(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """laplace-torch's formula, ``softmax(kappa * mu)``."""
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var.diagonal(dim1=-2, dim2=-1))
    return torch.softmax(kappa * mu, -1)


def test_probit_equals_the_term_by_term_formula():
    mu, var = _gaussians(3)
    probs = probit(mu, var)
    torch.testing.assert_close(probs, pairwise_probit(mu, var))
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    # no variance: the softmax itself
    torch.testing.assert_close(probit(mu, torch.zeros_like(var)), torch.softmax(mu, -1))
    # float32 in, float32 out
    assert probit(mu.float(), var.float()).dtype == torch.float32


def test_probit_of_two_classes_is_the_binary_probit():
    """``sigmoid(m / sqrt(1 + pi/8 v))`` for the difference ``f_1 - f_2 ~ N(m, v)``;
    laplace-torch's formula counts only half of ``v`` for independent logits."""
    mu, var = _gaussians(4, C=2)
    m = mu[:, 0] - mu[:, 1]
    v = var[:, 0, 0] + var[:, 1, 1] - 2 * var[:, 0, 1]
    binary = torch.sigmoid(m / torch.sqrt(1 + math.pi / 8 * v))
    torch.testing.assert_close(probit(mu, var)[:, 0], binary)
    independent = torch.diag_embed(torch.full((5, 2), 3.0, dtype=torch.float64))
    half = torch.sigmoid(m / torch.sqrt(torch.tensor(1 + math.pi / 8 * 3.0)))
    torch.testing.assert_close(_laplace_torch_probit(mu, independent)[:, 0], half)


def test_probit_ignores_what_softmax_ignores():
    """A common shift of the mean and any covariance along 1 (``1 v^T + v 1^T + a 1 1^T``)
    leave the exact predictive unchanged, and the probit too."""
    mu, var = _gaussians(5)
    g = torch.Generator().manual_seed(5)
    ones = torch.ones(5, 4, 1, dtype=torch.float64)
    v = torch.randn(5, 4, 1, generator=g, dtype=torch.float64)
    along_ones = ones @ v.transpose(1, 2) + v @ ones.transpose(1, 2) + 30.0 * ones @ ones.mT
    torch.testing.assert_close(probit(mu + 7.0, var + along_ones), probit(mu, var))


def test_probit_near_the_exact_predictive_where_the_variance_is_common():
    """``Sigma = 0.05 I + 25 1 1^T``: the exact predictive is close to softmax(mu);
    laplace-torch's formula shrinks every logit by the shared variance toward uniform."""
    mu = torch.tensor([[3.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    var = (0.05 * torch.eye(4, dtype=torch.float64) + 25.0).unsqueeze(0)
    g = torch.Generator().manual_seed(6)
    exact = torch.softmax(gaussian_samples(mu, var, 200_000, generator=g), -1).mean(0)
    assert (probit(mu, var) - exact).abs().max() < 0.01
    assert (_laplace_torch_probit(mu, var) - exact).abs().max() > 0.3


def test_probit_refuses_diagonal_variances():
    mu, var = _gaussians(7)
    with pytest.raises(ValueError, match=r"\(n, C, C\)"):
        probit(mu, var.diagonal(dim1=-2, dim2=-1))


def test_probit_is_differentiable_in_the_mean_and_the_covariance():
    """``enable_backprop=True`` differentiates the predictive: the in-place steps on the
    link's own buffers keep autograd's gradient (finite differences)."""
    mu, var = _gaussians(8, n=3, C=3)
    mu.requires_grad_(True)
    var.requires_grad_(True)
    assert torch.autograd.gradcheck(probit, (mu, var))


@pytest.mark.parametrize("C", [2, 3])
def test_probit_closer_to_monte_carlo_than_laplace_torchs_formula(C):
    """On 30 random Gaussians (full covariances of scale 1 to 30), the mean absolute
    error of the probabilities against 100k Monte Carlo draws."""
    g = torch.Generator().manual_seed(9 + C)
    mu = 3 * torch.randn(30, C, generator=g, dtype=torch.float64)
    A = torch.randn(30, C, C, generator=g, dtype=torch.float64)
    scales = torch.logspace(0, math.log10(30), 30, dtype=torch.float64).reshape(-1, 1, 1)
    var = scales * (A @ A.mT) / C
    exact = torch.softmax(gaussian_samples(mu, var, 100_000, generator=g), -1).mean(0)
    ours = (probit(mu, var) - exact).abs().mean()
    theirs = (_laplace_torch_probit(mu, var) - exact).abs().mean()
    assert ours < 0.7 * theirs
