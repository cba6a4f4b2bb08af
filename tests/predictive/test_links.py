"""Link functions: the eigh-based Gaussian sampler, the centred probit and the centred
Laplace bridge."""

from __future__ import annotations

import math

import torch

from laplace_glas.predictive.links import centred_logits, gaussian_samples, laplace_bridge, probit


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
    """laplace-torch's formula, uncentred."""
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var.diagonal(dim1=-2, dim2=-1))
    return torch.softmax(kappa * mu, -1)


def test_centred_logits_are_the_projection():
    mu, var = _gaussians(3)
    P = torch.eye(4, dtype=torch.float64) - 0.25
    centred_mu, centred_var = centred_logits(mu, var)
    torch.testing.assert_close(centred_mu, mu @ P)
    torch.testing.assert_close(centred_var, P @ var @ P)


def test_probit_ignores_what_softmax_ignores():
    """A common shift of the mean and any covariance along 1 (``1 v^T + v 1^T + a 1 1^T``)
    leave the exact predictive unchanged, and the centred probit too."""
    mu, var = _gaussians(4)
    g = torch.Generator().manual_seed(5)
    ones = torch.ones(5, 4, 1, dtype=torch.float64)
    v = torch.randn(5, 4, 1, generator=g, dtype=torch.float64)
    along_ones = ones @ v.transpose(1, 2) + v @ ones.transpose(1, 2) + 30.0 * ones @ ones.mT
    probs = probit(mu, var)
    torch.testing.assert_close(probit(mu + 7.0, var + along_ones), probs)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=torch.float64))
    # nothing along 1 and a centred mean: laplace-torch's probit itself
    centred_mu, centred_var = centred_logits(mu, var)
    torch.testing.assert_close(probit(mu, var), _laplace_torch_probit(centred_mu, centred_var))


def test_probit_near_the_exact_predictive_where_the_variance_is_common():
    """``Sigma = 0.05 I + 25 1 1^T``: the exact predictive is close to softmax(mu); the
    uncentred probit shrinks every logit by the shared variance toward uniform."""
    mu = torch.tensor([[3.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    var = (0.05 * torch.eye(4, dtype=torch.float64) + 25.0).unsqueeze(0)
    g = torch.Generator().manual_seed(6)
    exact = torch.softmax(gaussian_samples(mu, var, 200_000, generator=g), -1).mean(0)
    assert (probit(mu, var) - exact).abs().max() < 0.01
    assert (_laplace_torch_probit(mu, var) - exact).abs().max() > 0.3
