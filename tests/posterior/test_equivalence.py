"""k >= rank(G): GLAS equals laplace-torch's FullLaplace (GGN backend).

``loss_scaling='sum'`` is compared with FullLaplace at temperature 1 and
``loss_scaling='mean'`` with FullLaplace at temperature N. A small float64 network
on few data points has a GGN of rank r < D, so k >= r captures all curvature.

laplace-torch 0.3's curvlinops backend forms ``H`` as ``linop @ torch.eye(D)`` with
a float32 identity, so even a float64 FullLaplace carries float32 round-off in
``H`` (about 1e-8 relative, seen as spurious eigenvalues ~1e-8 beyond the rank).
The tight comparisons therefore use FullLaplace with ``H`` replaced by the exact
float64 GGN built here from ``torch.func`` Jacobians (everything else, the
posterior algebra included, is laplace-torch's); one test compares with the
untouched FullLaplace at a float32-level tolerance.
"""

from __future__ import annotations

import pytest
import torch
from conftest import explicit_jacobian, loader, mlp, regression_data, train
from laplace import Laplace

N_POINTS = 5  # regression, 1 output: rank(G) <= 5
K = 8
SIGMA = 0.3
TAU = 0.7


@pytest.fixture(scope="module")
def regression_setup():
    X, y = regression_data(N_POINTS, dtype=torch.float64, seed=3)
    model = train(mlp([1, 6, 1], dtype=torch.float64), X, y, steps=200)  # D = 19
    return model, X, y


@pytest.fixture(scope="module")
def classification_setup():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 2, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2])
    model = train(mlp([2, 5, 3], dtype=torch.float64), X, y, steps=100, classification=True)
    return model, X, y  # D = 33, rank(G) <= 3 * 2 = 6


def exact_summed_ggn(model, X, likelihood):
    """laplace-torch's H: sum_n J_n^T Lambda_n J_n (unit noise for regression)."""
    J = explicit_jacobian(model, X)  # (N*C, D)
    if likelihood == "regression":
        return J.T @ J
    with torch.no_grad():
        p = torch.softmax(model(X), -1)
    N, C = p.shape
    Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    Jn = J.reshape(N, C, -1)
    return torch.einsum("ncd,nce,nef->df", Jn, Lam, Jn)


def fitted_pair(setup, likelihood, loss_scaling, complement, k=K, exact_H=True):
    model, X, y = setup
    dl = loader(X, y, batch_size=2)
    n = X.shape[0]
    sigma = SIGMA if likelihood == "regression" else 1.0
    glas = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=sigma,
        prior_precision=TAU,
        n_components=k,
        loss_scaling=loss_scaling,
        complement=complement,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the null-space eigenvalues are flagged
        glas.fit(dl)
    full = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="full",
        sigma_noise=sigma,
        prior_precision=TAU,
        temperature=float(n) if loss_scaling == "mean" else 1.0,
    )
    full.fit(dl)
    if exact_H:
        full.H = exact_summed_ggn(model, X, likelihood)
    return glas, full, X


CASES = [(lik, s) for lik in ("regression", "classification") for s in ("sum", "mean")]


def setup_for(request, likelihood):
    return request.getfixturevalue(f"{likelihood}_setup")


@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
def test_subspace_variances_equal_projected_full_covariance(request, likelihood, loss_scaling):
    glas, full, _ = fitted_pair(setup_for(request, likelihood), likelihood, loss_scaling, "zero")
    U = glas.eigenvectors
    projected = U.T @ full.posterior_covariance @ U
    torch.testing.assert_close(
        projected, torch.diag(glas.posterior_variances), rtol=1e-7, atol=1e-9
    )


@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
@pytest.mark.parametrize("complement", ["zero", "prior"])
def test_evidence_terms_equal_full_laplace(request, likelihood, loss_scaling, complement):
    glas, full, _ = fitted_pair(
        setup_for(request, likelihood), likelihood, loss_scaling, complement
    )
    torch.testing.assert_close(glas.log_det_ratio, full.log_det_ratio, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(glas.scatter, full.scatter, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(glas.log_likelihood, full.log_likelihood, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-8, atol=1e-8
    )
    # and at another prior precision (and noise, for regression)
    tau = torch.tensor(3.0, dtype=torch.float64)
    sig = torch.tensor(0.5, dtype=torch.float64) if likelihood == "regression" else None
    torch.testing.assert_close(
        glas.log_marginal_likelihood(tau, sig),
        full.log_marginal_likelihood(tau, sig),
        rtol=1e-8,
        atol=1e-8,
    )


@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
def test_prior_complement_covariance_and_glm_predictive_equal_full(
    request, likelihood, loss_scaling
):
    glas, full, X = fitted_pair(setup_for(request, likelihood), likelihood, loss_scaling, "prior")
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-7, atol=1e-10
    )
    torch.testing.assert_close(
        glas.posterior_precision.to_dense(), full.posterior_precision, rtol=1e-7, atol=1e-7
    )
    torch.testing.assert_close(
        glas.log_det_posterior_precision, full.log_det_posterior_precision, rtol=1e-8, atol=1e-8
    )
    Xtest = torch.linspace(-3, 3, 7, dtype=torch.float64).reshape(-1, 1).repeat(1, X.shape[1])
    f_g, v_g = glas._glm_predictive_distribution(Xtest)
    f_f, v_f = full._glm_predictive_distribution(Xtest)
    torch.testing.assert_close(f_g, f_f)
    torch.testing.assert_close(v_g, v_f, rtol=1e-7, atol=1e-10)
    _, vj_g = glas._glm_predictive_distribution(Xtest, joint=True)
    _, vj_f = full._glm_predictive_distribution(Xtest, joint=True)
    torch.testing.assert_close(vj_g, vj_f, rtol=1e-7, atol=1e-10)
    values = full.sample(3, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([full.log_prob(v) for v in values])
    torch.testing.assert_close(glas.log_prob(values), ref, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(glas.log_prob(values[0]), ref[0], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("loss_scaling", ["sum", "mean"])
def test_prior_complement_sample_covariance_matches_full(regression_setup, loss_scaling):
    glas, full, _ = fitted_pair(regression_setup, "regression", loss_scaling, "prior")
    n = 200_000
    samples = glas.sample(n, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (n, glas.n_params)
    emp = torch.cov(samples.T)
    ref = full.posterior_covariance
    # statistical tolerance: sd of a sample covariance entry is sqrt((S_ii S_jj + S_ij^2)/n)
    sd = ((ref.diagonal()[:, None] * ref.diagonal()[None, :] + ref**2) / n).sqrt()
    assert ((emp - ref).abs() / sd).max() < 6.0
    torch.testing.assert_close(
        samples.mean(0), glas.mean, atol=float(5 * (ref.diagonal().max() / n) ** 0.5), rtol=0
    )


def test_zero_complement_samples_stay_in_subspace(regression_setup):
    glas, _, _ = fitted_pair(regression_setup, "regression", "sum", "zero")
    samples = glas.sample(1000, generator=torch.Generator().manual_seed(0))
    delta = samples - glas.mean
    U = glas.eigenvectors
    outside = delta - (delta @ U) @ U.T
    assert outside.abs().max() < 1e-10
    emp = torch.cov((delta @ U).T)
    torch.testing.assert_close(emp.diagonal(), glas.posterior_variances, rtol=0.15, atol=0)


def test_zero_complement_glm_variance_is_projected_full(regression_setup):
    glas, full, _ = fitted_pair(regression_setup, "regression", "sum", "zero")
    Xtest = torch.linspace(-3, 3, 9, dtype=torch.float64).reshape(-1, 1)
    _, var = glas._glm_predictive_distribution(Xtest)
    Js, _ = full.backend.jacobians(Xtest)
    U = glas.eigenvectors
    Sigma = U @ (U.T @ full.posterior_covariance @ U) @ U.T
    ref = torch.einsum("ncp,pq,nkq->nck", Js, Sigma, Js)
    torch.testing.assert_close(var, ref, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(glas.functional_variance(Js), ref, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
def test_agrees_with_untouched_full_laplace_at_float32_level(request, likelihood, loss_scaling):
    glas, full, _ = fitted_pair(
        setup_for(request, likelihood), likelihood, loss_scaling, "prior", exact_H=False
    )
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-5, atol=1e-5
    )
