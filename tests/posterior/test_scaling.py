"""Loss scaling (mean: s = 1, sum: s = N), temperature, observation noise, and prior tuning.

The posterior sees the curvature ``a_j = s * lambda_j / T`` along ``u_j``, with
``lambda_j`` the eigenvalues of the mean-loss GGN ``G = (1/N) sum_n J_n^T J_n / sigma^2``,
so ``1 / v_j - tau = a_j``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import explicit_jacobian, loader, mlp, regression_data, train

from laplace_glas import ActiveSubspaceLaplace

DT = torch.float64
N1, N2 = 50, 400
SIGMA = 0.2
TAU = 0.5
K = 4


@pytest.fixture(scope="module")
def data():
    return regression_data(N2, dtype=DT, seed=4)


@pytest.fixture(scope="module")
def model(data):
    """ONE model (1-10-10-1 tanh, D = 141, float64) trained on all N2 points."""
    X, y = data
    return train(mlp([1, 10, 10, 1], dtype=DT), X, y, steps=300)


def fit(model, X, y, k=K, **kwargs):
    kwargs.setdefault("sigma_noise", SIGMA)
    kwargs.setdefault("prior_precision", TAU)
    kwargs.setdefault("complement", "zero")  # the subspace's closed forms
    la = ActiveSubspaceLaplace(model, "regression", n_components=k, **kwargs)
    la.fit(loader(X, y, batch_size=64))
    return la


@pytest.fixture(scope="module")
def pair(model, data):
    """Mean- and sum-scaled GLAS on the same model, data and prior (N = 100)."""
    X, y = data[0][:100], data[1][:100]
    return fit(model, X, y, loss_scaling="mean"), fit(model, X, y, loss_scaling="sum")


def precision_minus_prior(la):
    """``1 / v_j - tau``: the curvature the posterior adds along ``u_j``."""
    return 1.0 / la.posterior_variances - la.prior_precision


# ---------------------------------------------------------------- mean vs sum
def test_mean_and_sum_share_the_eigenpairs(pair):
    mean, total = pair
    assert torch.equal(mean.eigenvalues, total.eigenvalues)
    assert torch.equal(mean.eigenvectors, total.eigenvectors)
    assert (mean.eigenvalues > 0).all()


def test_sum_over_mean_precision_ratio_is_n(pair):
    mean, total = pair
    assert mean.scaling_factor == 1.0
    assert total.scaling_factor == 100.0
    ratio = precision_minus_prior(total) / precision_minus_prior(mean)
    torch.testing.assert_close(ratio, torch.full((K,), 100.0, dtype=DT), rtol=1e-9, atol=0)
    # and the closed forms themselves: v = 1 / (s lambda + tau)
    lam = mean.eigenvalues
    torch.testing.assert_close(mean.posterior_variances, 1 / (lam + TAU), rtol=1e-13, atol=0)
    torch.testing.assert_close(total.posterior_variances, 1 / (100 * lam + TAU), rtol=1e-13, atol=0)
    assert (total.posterior_variances < mean.posterior_variances).all()


def test_eigenvalues_are_those_of_the_mean_loss_ggn(pair, data):
    """Anchor the absolute scale: lambda = eig((1/N) sum J^T J / sigma^2), not N times it."""
    mean, _ = pair
    X = data[0][:100]
    J = explicit_jacobian(mean.model, X)
    G = J.T @ J / (100 * SIGMA**2)
    ref = torch.linalg.eigvalsh(G).flip(0)[:K]
    torch.testing.assert_close(mean.eigenvalues, ref, rtol=1e-9, atol=0)


def test_evidence_occam_term_uses_the_scaled_curvature(pair):
    mean, total = pair
    for la, s in ((mean, 1.0), (total, 100.0)):
        expected = torch.log1p(s * la.eigenvalues / TAU).sum()
        torch.testing.assert_close(la.log_det_ratio, expected, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- the effect of N
@pytest.fixture(scope="module")
def by_n(model, data):
    X, y = data
    fits = {}
    for scaling in ("mean", "sum"):
        for n in (N1, N2):
            fits[scaling, n] = fit(model, X[:n], y[:n], k=2, loss_scaling=scaling)
    return fits


def test_mean_scaling_eigenvalues_stay_order_one_with_n(by_n):
    lam1 = by_n["mean", N1].eigenvalues[0]
    lam2 = by_n["mean", N2].eigenvalues[0]
    assert 0.5 < float(lam2 / lam1) < 2.0
    # the eigen-solve does not depend on the scaling
    assert torch.equal(by_n["sum", N2].eigenvalues, by_n["mean", N2].eigenvalues)


def test_mean_scaling_variances_do_not_shrink_with_n(by_n):
    v1 = by_n["mean", N1].posterior_variances[0]
    v2 = by_n["mean", N2].posterior_variances[0]
    assert float(v2 / v1) > 0.5


def test_sum_scaling_precision_grows_like_n(by_n):
    a1 = precision_minus_prior(by_n["sum", N1])[0]
    a2 = precision_minus_prior(by_n["sum", N2])[0]
    assert 4.0 <= float(a2 / a1) <= 12.0  # N2 / N1 = 8
    v1 = by_n["sum", N1].posterior_variances[0]
    v2 = by_n["sum", N2].posterior_variances[0]
    assert float(v1 / v2) > 4.0


# ---------------------------------------------------------------- temperature and noise
@pytest.mark.parametrize("loss_scaling", ["mean", "sum"])
def test_temperature_divides_the_curvature(model, data, loss_scaling):
    X, y = data[0][:100], data[1][:100]
    cold = fit(model, X, y, loss_scaling=loss_scaling)
    warm = fit(model, X, y, loss_scaling=loss_scaling, temperature=2.0)
    assert torch.equal(warm.eigenvalues, cold.eigenvalues)
    torch.testing.assert_close(
        precision_minus_prior(warm), precision_minus_prior(cold) / 2, rtol=1e-9, atol=0
    )
    # setting the temperature after fit is the same as fitting with it
    cold.temperature = 2.0
    torch.testing.assert_close(
        cold.posterior_variances, warm.posterior_variances, rtol=1e-13, atol=0
    )


def test_eigenvalues_scale_like_inverse_noise_variance(model, data):
    X, y = data[0][:100], data[1][:100]
    la = fit(model, X, y, loss_scaling="mean")
    lam = la.eigenvalues.clone()
    a = la.subspace_curvature.clone()
    U = la.eigenvectors.clone()
    la.sigma_noise = 2 * SIGMA
    torch.testing.assert_close(la.eigenvalues, lam / 4, rtol=1e-13, atol=0)
    torch.testing.assert_close(la.subspace_curvature, a / 4, rtol=1e-13, atol=0)
    torch.testing.assert_close(la.posterior_variances, 1 / (lam / 4 + TAU), rtol=1e-13, atol=0)
    assert torch.equal(la.eigenvectors, U)
    # fitting with the larger noise from the start gives the same eigenvalues
    noisy = fit(model, X, y, loss_scaling="mean", sigma_noise=2 * SIGMA)
    torch.testing.assert_close(noisy.eigenvalues, lam / 4, rtol=1e-9, atol=0)


# ---------------------------------------------------------------- prior precision
@pytest.mark.parametrize("loss_scaling", ["mean", "sum"])
def test_closed_form_marglik_matches_brute_force_grid(pair, loss_scaling):
    la = pair[0] if loss_scaling == "mean" else pair[1]
    tau_before = la.prior_precision.clone()
    try:
        log10_grid = torch.linspace(-4, 4, 1601, dtype=DT)
        step = float(log10_grid[1] - log10_grid[0])
        with torch.no_grad():
            evidence = torch.stack(
                [la.log_marginal_likelihood(prior_precision=10**t) for t in log10_grid]
            ).reshape(-1)
        best = int(evidence.argmax())
        assert 0 < best < len(log10_grid) - 1, "the grid must bracket the optimum"
        assert abs(float(log10_grid[best]) - math.log10(TAU)) > 0.1  # not the starting tau
        la.optimize_prior_precision()
        tau = la.prior_precision
        assert tau.shape == (1,)
        assert abs(math.log10(float(tau)) - float(log10_grid[best])) <= step
        with torch.no_grad():
            at_tau = la.log_marginal_likelihood(prior_precision=tau)
        assert float(at_tau) >= float(evidence.max()) - 1e-9 * abs(float(evidence.max()))
        # and it is a maximum: moving away in either direction loses evidence
        with torch.no_grad():
            for factor in (0.9, 1.1):
                assert float(la.log_marginal_likelihood(prior_precision=tau * factor)) < at_tau
    finally:
        la.prior_precision = tau_before


def test_gridsearch_with_a_validation_loader(model, data):
    X, y = data[0][:100], data[1][:100]
    la = fit(model, X, y, loss_scaling="mean")
    X_val, y_val = regression_data(60, dtype=DT, seed=11)
    val = loader(X_val, y_val, batch_size=20)
    la.optimize_prior_precision(method="gridsearch", val_loader=val, grid_size=9)
    tau = la.prior_precision
    assert tau.numel() == 1
    assert 1e-4 <= float(tau) <= 1e4


def gaussian_nll(mean, var, target):
    var = var.reshape(mean.shape) + SIGMA**2
    return (0.5 * torch.log(2 * math.pi * var) + (target - mean) ** 2 / (2 * var)).mean()


def test_gridsearch_picks_the_grid_point_with_the_lowest_validation_loss(model, data):
    """With a loss that depends on the predictive variance, gridsearch agrees with a hand search."""
    X, y = data[0][:100], data[1][:100]
    la = fit(model, X, y, loss_scaling="sum")
    X_val, y_val = regression_data(60, dtype=DT, seed=11, noise=0.3)
    grid = torch.logspace(-3, 3, 13, dtype=DT)
    by_hand = []
    for t in grid:
        la.prior_precision = float(t)
        f_mu, f_var = la(X_val)
        by_hand.append(float(gaussian_nll(f_mu, f_var, y_val)))
    assert max(by_hand) - min(by_hand) > 1e-3  # the loss does depend on tau
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(
            method="gridsearch",
            val_loader=loader(X_val, y_val),
            loss=gaussian_nll,
            log_prior_prec_min=-3,
            log_prior_prec_max=3,
            grid_size=13,
        )
    expected = float(grid[int(torch.tensor(by_hand).argmin())])
    assert math.isclose(float(la.prior_precision), expected, rel_tol=1e-6)


def test_tuning_sigma_through_the_mean_scaled_evidence_warns(toy_regression):
    """laplace-torch's README loop tunes prior and noise through the evidence: under mean
    scaling that drives sigma far below the residuals, so it warns; 'sum' does not."""
    import warnings

    from conftest import fit_glas

    model, X, y = toy_regression
    la = fit_glas(model, X, y, n_components=5, loss_scaling="mean", complement="zero")
    with pytest.warns(UserWarning, match="not a likelihood in sigma"):
        la.log_marginal_likelihood(sigma_noise=torch.tensor(0.1))
    summed = la.with_loss_scaling("sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summed.log_marginal_likelihood(sigma_noise=torch.tensor(0.1))
        la.log_marginal_likelihood(prior_precision=torch.tensor(1.0))


def test_a_gridsearch_on_nan_validation_targets_is_refused(toy_regression):
    from conftest import fit_glas

    model, X, y = toy_regression
    la = fit_glas(model, X, y, n_components=5)
    before = la.prior_precision.clone()
    bad = loader(X[:20], torch.full_like(y[:20], float("nan")))
    with pytest.raises(ValueError, match="validation data contain NaN or inf"):
        la.optimize_prior_precision(method="gridsearch", val_loader=bad, grid_size=5)
    assert torch.equal(la.prior_precision, before)
