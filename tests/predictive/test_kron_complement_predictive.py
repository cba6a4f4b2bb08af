"""complement='kron' in the predictives: 'glm' moments, functional (co)variance and 'nn'
draws against the dense posterior of a classifier (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_glas, mlp, output_jacobian, pairwise_probit, train

DOUBLE = torch.float64


def dense_kfac(la) -> torch.Tensor:
    """``C = s K / T`` of ``la``, densified from the stored factors with ``torch.kron``."""
    blocks = [
        F[0] if len(F) == 1 else torch.kron(F[0].contiguous(), F[1].contiguous())
        for F in la._ggn_kron.kfacs
    ]
    return la._H_factor * torch.block_diag(*blocks)


def dense_sigma(la) -> torch.Tensor:
    U, a, tau = la.eigenvectors, la.subspace_curvature, la.prior_precision[0]
    eye = torch.eye(U.shape[0], dtype=DOUBLE)
    P = eye - U @ U.T
    inverse = torch.linalg.inv(dense_kfac(la) + tau * eye)
    return U @ torch.diag(1 / (a + tau)) @ U.T + P @ inverse @ P


@pytest.fixture(scope="module")
def classifier():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(60, 2, generator=g, dtype=DOUBLE)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    model = train(mlp([2, 6, 3], dtype=DOUBLE), X, y, steps=150, classification=True)
    la = fit_glas(
        model, X, y, "classification", n_components=5, complement="kron", loss_scaling="sum"
    )
    la.optimize_prior_precision()
    return la, model, X


def test_glm_moments_and_functional_variance_equal_j_sigma_jt(classifier):
    la, model, X = classifier
    sigma = dense_sigma(la)
    f, J = output_jacobian(model, X[:6])  # (6, 3, D)
    expected = torch.einsum("ncd,de,nke->nck", J, sigma, J)
    f_mu, f_var = la._glm_predictive_distribution(X[:6])
    torch.testing.assert_close(f_mu, f)
    torch.testing.assert_close(f_var, expected)
    torch.testing.assert_close(la.functional_variance(J), expected)
    flat = J.reshape(-1, J.shape[-1])
    torch.testing.assert_close(la.functional_covariance(J), flat @ sigma @ flat.T)
    # the probit predictive from those moments
    torch.testing.assert_close(la(X[:6]), pairwise_probit(f, expected))


def test_glm_functional_samples_have_the_dense_covariance(classifier):
    la, model, X = classifier
    sigma = dense_sigma(la)
    _, J = output_jacobian(model, X[:2])
    expected = torch.einsum("ncd,de,nke->nck", J, sigma, J)
    fs = la.functional_samples(X[:2], n_samples=40_000, generator=torch.Generator().manual_seed(0))
    centred = fs - fs.mean(0)
    empirical = torch.einsum("snc,snk->nck", centred, centred) / fs.shape[0]
    assert float((empirical - expected).abs().max()) < 0.05 * float(expected.abs().max())


def test_nn_outputs_follow_the_weight_posterior(classifier):
    """'nn' pushes la.sample's draws through the network: at a tiny posterior scale the
    logits' covariance is the linearised J Sigma J^T.
    """
    la, model, X = classifier
    before = la.prior_precision.clone()
    try:
        la.prior_precision = 1e4  # a narrow posterior: the network is linear over it
        sigma = dense_sigma(la)
        _, J = output_jacobian(model, X[:2])
        expected = torch.einsum("ncd,de,nke->nck", J, sigma, J)
        fs = la.functional_samples(
            X[:2], pred_type="nn", n_samples=20_000, generator=torch.Generator().manual_seed(1)
        )
        centred = fs - fs.mean(0)
        empirical = torch.einsum("snc,snk->nck", centred, centred) / fs.shape[0]
        assert float((empirical - expected).abs().max()) < 0.05 * float(expected.abs().max())
    finally:
        la.prior_precision = before
