"""complement='diag': the GGN diagonal's curvature off span(U), against dense references."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    explicit_jacobian,
    fit_glas,
    loader,
    mlp,
    output_jacobian,
    regression_data,
    softmax_ggn,
    train,
)

from laplace_glas.posterior.closed_forms import ScalarPriorPosterior
from laplace_glas.posterior.complement import DiagonalComplementPosterior

D, K = 12, 3


def dense_sigma(U, a, tau, c):
    """``U diag(1/(a+tau)) U^T + P diag(1/(c+tau)) P``, formed explicitly."""
    P = torch.eye(U.shape[0], dtype=U.dtype) - U @ U.T
    return U @ torch.diag(1 / (a + tau)) @ U.T + P @ torch.diag(1 / (c + tau)) @ P


@pytest.fixture
def parts():
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(D, K, generator=g, dtype=torch.float64))[0]
    a = torch.tensor([30.0, 4.0, 0.5], dtype=torch.float64)
    c = torch.rand(D, generator=g, dtype=torch.float64) * 5
    return U, a, torch.tensor(0.7, dtype=torch.float64), c


def test_every_form_equals_the_dense_posterior(parts):
    U, a, tau, c = parts
    post = DiagonalComplementPosterior(U, a, tau, c)
    sigma = dense_sigma(U, a, tau, c)
    torch.testing.assert_close(post.covariance.to_dense(), sigma)
    torch.testing.assert_close(post.precision.to_dense(), torch.linalg.inv(sigma))
    V, w = post._low_rank_factors()
    torch.testing.assert_close(V @ torch.diag(w) @ V.T + torch.diag(post.diagonal), sigma)
    U_, v, base = post.covariance_factors()
    eye = torch.eye(D, dtype=torch.float64)
    torch.testing.assert_close(U_ @ torch.diag(v) @ U_.T + base(eye), sigma)
    R = base.root(eye)
    torch.testing.assert_close(R @ R.T, base(eye))
    torch.testing.assert_close(post.log_det_posterior_precision, -torch.logdet(sigma))
    torch.testing.assert_close(post.log_det_ratio, -torch.logdet(sigma) - D * tau.log())
    torch.testing.assert_close(post.precision.logdet(), -torch.logdet(sigma))
    torch.testing.assert_close(post.covariance.logdet(), torch.logdet(sigma))
    torch.testing.assert_close(post.subspace_variances, torch.diagonal(U.T @ sigma @ U))
    delta = torch.randn(4, D, dtype=torch.float64)
    expected = torch.einsum("nd,de,ne->n", delta, torch.linalg.inv(sigma), delta)
    torch.testing.assert_close(post.square_norm(delta), expected)
    torch.testing.assert_close(post.square_norm(delta[0]), expected[0])


def test_draws_have_the_posterior_covariance(parts):
    U, a, tau, c = parts
    post = DiagonalComplementPosterior(U, a, tau, c)
    draws = post.sample(200_000, torch.Generator().manual_seed(1))
    empirical = draws.T @ draws / draws.shape[0]
    assert (empirical - dense_sigma(U, a, tau, c)).abs().max() < 0.02


def test_zero_complement_curvature_is_the_prior_complement(parts):
    U, a, tau, _ = parts
    diag = DiagonalComplementPosterior(U, a, tau, torch.zeros(D, dtype=torch.float64))
    prior = ScalarPriorPosterior(U, a, tau, "prior")
    torch.testing.assert_close(diag.covariance.to_dense(), prior.covariance.to_dense())
    torch.testing.assert_close(diag.log_det_ratio, prior.log_det_ratio)
    torch.testing.assert_close(diag.log_det_posterior_precision, prior.log_det_posterior_precision)


def test_a_flat_prior_is_refused(parts):
    U, a, _, c = parts
    with pytest.raises(ValueError, match="proper prior"):
        DiagonalComplementPosterior(U, a, torch.tensor(0.0, dtype=torch.float64), c)


@pytest.fixture(scope="module")
def fitted():
    X, y = regression_data(40)
    X, y = X.double(), y.double()
    model = train(mlp([1, 6, 1], dtype=torch.float64), X, y, steps=200)
    la = fit_glas(
        model, X, y, n_components=4, complement="diag", loss_scaling="sum", prior_precision=0.5
    )
    return la, model, X, y


def test_the_fitted_complement_curvature_is_the_explicit_ggn_diagonal(fitted):
    la, model, X, _ = fitted
    J = explicit_jacobian(model, X)  # (N, D): one output
    ggn_diag = J.square().sum(0)  # summed unit-noise GGN diagonal
    torch.testing.assert_close(la._ggn_diagonal, ggn_diag)
    # sum scaling: c = diag(G_sum) / sigma^2, as a_j = N lambda_j
    torch.testing.assert_close(la._complement_curvature(), ggn_diag / la.sigma_noise**2)


def dense_posterior(la, model, X):
    """The dense Sigma with the residual diagonal ``c - diag(U diag(a) U^T)``."""
    J = explicit_jacobian(model, X)
    U, a = la.eigenvectors, la.subspace_curvature
    residual = (la._complement_curvature() - U.square() @ a).clamp_min(0)
    return J, dense_sigma(U, a, la.prior_precision[0], residual)


def test_glm_predictive_and_functional_variance_equal_j_sigma_jt(fitted):
    la, model, X, _ = fitted
    J, sigma = dense_posterior(la, model, X[:7])
    expected = torch.einsum("nd,de,ne->n", J, sigma, J)
    _, f_var = la(X[:7], pred_type="glm")
    torch.testing.assert_close(f_var.reshape(-1), expected)
    Js = J.reshape(7, 1, -1)
    torch.testing.assert_close(la.functional_variance(Js).reshape(-1), expected)
    torch.testing.assert_close(la.functional_covariance(Js), J @ sigma @ J.T)


def test_the_evidence_counts_every_direction(fitted):
    la, model, X, _ = fitted
    _, sigma = dense_posterior(la, model, X)
    tau = la.prior_precision[0]
    expected = (
        la.log_likelihood
        - 0.5 * (-torch.logdet(sigma) - la.n_params * tau.log())
        - 0.5 * la.scatter
    )
    torch.testing.assert_close(la.log_marginal_likelihood(), expected)
    torch.testing.assert_close(la.posterior_covariance.to_dense(), sigma)


def test_marglik_maximises_the_evidence_over_every_direction(fitted):
    la, *_ = fitted
    before = la.prior_precision.clone()
    try:
        la.optimize_prior_precision()
        tau = float(la.prior_precision)
        assert math.isfinite(tau) and tau > 0

        def evidence(t: float) -> float:
            return float(la.log_marginal_likelihood(prior_precision=torch.tensor(t)))

        best = evidence(tau)
        assert best >= evidence(tau * 1.05) and best >= evidence(tau / 1.05)
        # a stationary point of the log evidence in log tau (central differences)
        h = 1e-4
        slope = (evidence(tau * math.exp(h)) - evidence(tau * math.exp(-h))) / (2 * h)
        assert abs(slope) < 1e-5 * max(1.0, abs(best))
    finally:
        la.prior_precision = before


def test_nn_samples_spread_outside_the_subspace(fitted):
    la, *_ = fitted
    draws = la.sample(500, generator=torch.Generator().manual_seed(0)) - la.mean
    outside = draws - (draws @ la.eigenvectors) @ la.eigenvectors.T
    assert outside.norm(dim=1).mean() > 0


def test_diag_serves_structured_priors_and_refuses_what_it_cannot_serve(fitted):
    la, *_ = fitted
    other = la.with_loss_scaling("sum")
    other.prior_precision = torch.ones(4, dtype=torch.float64)  # layerwise: served
    assert torch.isfinite(other.posterior_variances).all()
    other.prior_precision = torch.linspace(0.5, 2, other.n_params, dtype=torch.float64)
    assert torch.isfinite(other.posterior_variances).all()  # per weight: 'diag' takes it
    zero = fit_glas(fitted[1], fitted[2], fitted[3], n_components=2)
    zero.complement = "diag"
    with pytest.raises(ValueError, match="Refit with complement='diag'"):
        zero.posterior_variances  # noqa: B018


def test_classification_complement_curvature_is_the_softmax_ggn_diagonal():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 2, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    model = train(mlp([2, 5, 3], dtype=torch.float64), X, y, steps=100, classification=True)
    la = fit_glas(model, X, y, "classification", n_components=3, complement="diag")
    out, J = output_jacobian(model, X)
    ggn, _ = softmax_ggn(out, J, y)
    torch.testing.assert_close(la._ggn_diagonal, torch.diagonal(ggn))


def test_calibration_rows_equal_the_posteriors_own_coverage(fitted):
    from laplace_glas import select_dimension
    from laplace_glas.diagnostics.calibration import coverage

    la, model, X, y = fitted
    calib = loader(X[::2], y[::2])
    selection = select_dimension(
        la, calib, ks=[1, 3], prior_precisions=[0.3, 2.0], empirical_bayes=False,
        include_noise=False,
    )  # fmt: skip
    for row in selection.rows:
        other = la.with_loss_scaling("sum")
        other.n_components, other.prior_precision = row.k, row.prior_precision
        assert row.coverage == pytest.approx(coverage(other, calib, include_noise=False))
        # the row's width is that of the dense posterior's intervals
        J, sigma = dense_posterior(other, model, X[::2])
        half = 1.6448536269514722 * torch.einsum("nd,de,ne->n", J, sigma, J).sqrt()
        assert row.mean_width == pytest.approx(float(2 * half.mean()), rel=1e-6)


def test_state_dict_round_trip_keeps_the_complement(fitted):
    la, model, X, y = fitted
    state = la.state_dict()
    assert state["ggn_diagonal"].shape == (la.n_params,)
    other = fit_glas(model, X, y, n_components=2, loss_scaling="sum")
    other.load_state_dict(state)
    assert other.complement == "diag"
    torch.testing.assert_close(other(X[:5], pred_type="glm")[1], la(X[:5], pred_type="glm")[1])
    broken = dict(state)
    del broken["ggn_diagonal"]
    with pytest.raises(ValueError, match="ggn_diagonal"):
        other.load_state_dict(broken)
    broken["ggn_diagonal"] = -state["ggn_diagonal"] - 1
    with pytest.raises(ValueError, match="negative"):
        other.load_state_dict(broken)


def test_the_subset_posteriors_refuse_diag():
    from laplace_glas import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

    model = mlp([1, 4, 1])
    with pytest.raises(ValueError, match="complement='diag' is not available"):
        LastLayerActiveSubspaceLaplace(model, "regression", n_components=2, complement="diag")
    with pytest.raises(ValueError, match="complement='diag' is not available"):
        SubnetActiveSubspaceLaplace(
            model, "regression", torch.tensor([0, 1, 2]), n_components=2, complement="diag"
        )


def test_padded_labels_are_left_out_of_the_diagonal():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    model = train(mlp([3, 5, 3], dtype=torch.float64), X, y, steps=50, classification=True)
    padded = y.clone()
    padded[:10] = -100
    la = fit_glas(model, X, padded, "classification", n_components=3, complement="diag")
    clean = fit_glas(model, X[10:], y[10:], "classification", n_components=3, complement="diag")
    torch.testing.assert_close(la._ggn_diagonal, clean._ggn_diagonal)


def test_frozen_parameters_leave_the_diagonal_over_the_trainable_ones():
    X, y = regression_data(30)
    X, y = X.double(), y.double()
    model = train(mlp([1, 6, 1], dtype=torch.float64), X, y, steps=50)
    model[0].bias.requires_grad_(False)
    la = fit_glas(model, X, y, n_components=3, complement="diag", loss_scaling="sum")
    J = explicit_jacobian(model, X)  # over all 19 parameters: drop the frozen bias's 6
    J = torch.cat([J[:, :6], J[:, 12:]], dim=1)
    assert la._ggn_diagonal.shape == (la.n_params,) == (13,)
    torch.testing.assert_close(la._ggn_diagonal, J.square().sum(0))


def test_diag_refuses_a_custom_loss_and_other_backends():
    from laplace.curvature import CurvlinopsEF

    from laplace_glas import ActiveSubspaceLaplace

    model = mlp([1, 4, 1])
    with pytest.raises(ValueError, match="cannot follow a custom loss_fn"):
        ActiveSubspaceLaplace(
            model, "regression", complement="diag", loss_fn=torch.nn.MSELoss(reduction="sum")
        )
    with pytest.raises(ValueError, match="cannot follow the ef backend"):
        ActiveSubspaceLaplace(model, "regression", complement="diag", backend=CurvlinopsEF)


def test_an_update_after_switching_to_diag_is_refused(fitted):
    _, model, X, y = fitted
    la = fit_glas(model, X, y, n_components=3)
    la.complement = "diag"
    with pytest.raises(ValueError, match="refit with override=True"):
        la.fit(loader(X, y), override=False)


def test_calibrations_evidence_rows_use_the_whole_evidence(fitted):
    from laplace_glas import select_dimension

    la, _, X, y = fitted
    selection = select_dimension(la, loader(X, y), ks=[la.n_components], prior_precisions=[])
    other = la.with_loss_scaling("sum")
    other.optimize_prior_precision()
    (row,) = [r for r in selection.rows if r.empirical_bayes]
    assert row.prior_precision == pytest.approx(float(other.prior_precision), rel=1e-6)


def test_float32_variances_stay_nonnegative_under_a_huge_prior():
    """At ``tau = 1.6e7`` in float32 the ``V diag(w) V^T + diag(d)`` form (negative
    ``w``) rounds predictive variances of these five problems down to -6.0e-6; the two
    Gram terms of :meth:`covariance_factors` cannot go below 0."""
    worst = 0.0
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        D, k = 200, 5
        U = torch.linalg.qr(torch.randn(D, k, generator=g, dtype=torch.float64))[0]
        a = torch.rand(k, generator=g, dtype=torch.float64) * 100
        c = torch.rand(D, generator=g, dtype=torch.float64) * 5
        Js = torch.randn(64, 3, D, generator=g, dtype=torch.float64)
        Js[:32] = Js[:32] @ U @ U.T + 1e-3 * Js[:32]  # mostly inside span(U)
        post = DiagonalComplementPosterior(
            U.float(), a.float(), torch.tensor(15893627.0), c.float()
        )
        V, w, base = post.covariance_factors()
        JV, JR = Js.float() @ V, base.root(Js.float())
        f_var = torch.einsum("nck,k,nlk->ncl", JV, w, JV) + JR @ JR.transpose(-1, -2)
        worst = min(worst, f_var.diagonal(dim1=-2, dim2=-1).min().item())
    assert worst >= 0.0


def test_empirical_bayes_looks_past_the_grid_and_refuses_no_optimum():
    """The evidence optimum beyond [1e-8, 1e8] (a far prior mean) is found, not the grid's
    edge; a prior mean at the weights (no finite optimum) is refused by name, as the
    subspace alone refuses it."""
    X, y = regression_data(48, dtype=torch.float64, seed=3)
    model = train(mlp([1, 6, 1], dtype=torch.float64), X, y, steps=100)
    D = sum(p.numel() for p in model.parameters())
    for complement in ("diag", "kron"):
        far = fit_glas(model, X, y, n_components=2, loss_scaling="sum", complement=complement,
                       prior_mean=torch.full((D,), 1e5, dtype=torch.float64))  # fmt: skip
        far.optimize_prior_precision()
        tau = float(far.prior_precision)
        assert 1e-12 < tau < 1e-9  # ~ D / ||theta* - mu_0||^2 = D / (D 1e10)
        lml = far.log_marginal_likelihood(torch.tensor(tau, dtype=torch.float64))
        for other in (tau / 1.05, tau * 1.05, 1e-8):
            assert lml >= far.log_marginal_likelihood(torch.tensor(other, dtype=torch.float64))
        at_weights = fit_glas(model, X, y, n_components=2, loss_scaling="sum",
                              complement=complement, prior_mean=far.mean.clone())  # fmt: skip
        with pytest.raises(ValueError, match="no finite optimum"):
            at_weights.optimize_prior_precision()
