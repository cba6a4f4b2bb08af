"""Link functions: the eigh-based Gaussian sampler and the centred Laplace bridge."""

from __future__ import annotations

import torch

from laplace_glas.predictive.links import gaussian_samples, laplace_bridge


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
