"""Layerwise and diagonal prior precisions.

References: laplace-torch's FullLaplace with the same prior in the k >= rank limit
(``H`` replaced by the exact float64 GGN, see ``test_equivalence``), where the
prior-complement posterior is FullLaplace's and the evidence is FullLaplace's for both
complements; and dense ``D x D`` algebra on the tiny float64 networks for the
restricted posterior ``U (diag(a) + U^T P_0 U)^{-1} U^T`` and Woodbury's form.
"""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch
from conftest import explicit_jacobian, loader, pairwise_probit
from laplace import Laplace
from test_equivalence import (  # noqa: F401 (fixtures)
    classification_setup,
    fitted_pair,
    regression_setup,
)

from laplace_glas.diagnostics.calibration import select_dimension
from laplace_glas.posterior.prior import DiagonalPriorPosterior

STRUCTURES = ["layerwise", "diag"]
CASES = [(lik, s) for lik in ("regression", "classification") for s in ("sum", "mean")]
XTEST = torch.linspace(-3, 3, 7, dtype=torch.float64).reshape(-1, 1)


def structured_prior(la, structure: str) -> torch.Tensor:
    """A non-constant prior precision: one value per parameter tensor or per weight."""
    g = torch.Generator().manual_seed(5)
    n = la.n_layers if structure == "layerwise" else la.n_params
    return (0.3 + 2.0 * torch.rand(n, generator=g)).to(torch.float64)


def pair_with_prior(request, likelihood, loss_scaling, complement, structure):
    setup = request.getfixturevalue(f"{likelihood}_setup")
    glas, full, X = fitted_pair(setup, likelihood, loss_scaling, complement)
    prior = structured_prior(glas, structure)
    glas.prior_precision = prior
    full.prior_precision = prior
    return glas, full, X


def test_ggn_rank_is_captured(request):
    """The premise of the FullLaplace comparisons: k >= rank(G)."""
    for likelihood in ("regression", "classification"):
        glas, full, _ = fitted_pair(
            request.getfixturevalue(f"{likelihood}_setup"), likelihood, "sum", "prior"
        )
        H = (glas.eigenvectors * glas.subspace_curvature) @ glas.eigenvectors.T
        torch.testing.assert_close(H, full._H_factor * full.H, rtol=0, atol=1e-9)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("complement", ["zero", "prior"])
@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
def test_evidence_equals_full_laplace(request, likelihood, loss_scaling, complement, structure):
    glas, full, _ = pair_with_prior(request, likelihood, loss_scaling, complement, structure)
    for name in ("log_det_ratio", "scatter", "log_det_prior_precision"):
        torch.testing.assert_close(getattr(glas, name), getattr(full, name), rtol=1e-8, atol=0)
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-8, atol=0
    )
    # differentiable in the prior precision, with FullLaplace's gradient
    grads = []
    for la in (glas, full):
        log_prior = la.prior_precision.detach().log().requires_grad_(True)
        la.log_marginal_likelihood(prior_precision=log_prior.exp()).backward()
        grads.append(log_prior.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("likelihood, loss_scaling", CASES)
def test_prior_complement_equals_full_laplace(request, likelihood, loss_scaling, structure):
    glas, full, X = pair_with_prior(request, likelihood, loss_scaling, "prior", structure)
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-7, atol=1e-12
    )
    torch.testing.assert_close(
        glas.posterior_precision.to_dense(), full.posterior_precision, rtol=1e-8, atol=1e-12
    )
    torch.testing.assert_close(
        glas.posterior_covariance.diagonal(),
        full.posterior_covariance.diagonal(),
        rtol=1e-7,
        atol=0,
    )
    torch.testing.assert_close(
        glas.log_det_posterior_precision, full.log_det_posterior_precision, rtol=1e-8, atol=0
    )
    torch.testing.assert_close(
        glas.posterior_precision.logdet(), full.log_det_posterior_precision, rtol=1e-8, atol=0
    )
    torch.testing.assert_close(
        glas.posterior_covariance.logdet(), -full.log_det_posterior_precision, rtol=1e-8, atol=0
    )
    copy = glas.posterior_precision.clone()
    torch.testing.assert_close(copy.to_dense(), full.posterior_precision, rtol=1e-8, atol=1e-12)
    Xtest = XTEST.repeat(1, X.shape[1])
    f_g, v_g = glas._glm_predictive_distribution(Xtest)
    f_f, v_f = full._glm_predictive_distribution(Xtest)
    torch.testing.assert_close(f_g, f_f)
    torch.testing.assert_close(v_g, v_f, rtol=1e-7, atol=1e-12)
    _, vj_g = glas._glm_predictive_distribution(Xtest, joint=True)
    _, vj_f = full._glm_predictive_distribution(Xtest, joint=True)
    torch.testing.assert_close(vj_g, vj_f, rtol=1e-7, atol=1e-12)
    Js, _ = full.backend.jacobians(Xtest)
    torch.testing.assert_close(glas.functional_variance(Js), v_f, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(
        glas.functional_covariance(Js), full.functional_covariance(Js), rtol=1e-7, atol=1e-12
    )
    values = full.sample(3, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([full.log_prob(v) for v in values])
    torch.testing.assert_close(glas.log_prob(values), ref, rtol=1e-8, atol=0)
    if likelihood == "regression":
        _, var = glas(Xtest, pred_type="glm")
        torch.testing.assert_close(var, v_f, rtol=1e-7, atol=1e-12)


def _sample_covariance_check(samples: torch.Tensor, mean: torch.Tensor, ref: torch.Tensor) -> None:
    n = samples.shape[0]
    emp = torch.cov(samples.T)
    # sd of a sample covariance entry: sqrt((S_ii S_jj + S_ij^2) / n)
    sd = ((ref.diagonal()[:, None] * ref.diagonal()[None, :] + ref**2) / n).sqrt()
    assert ((emp - ref).abs() / sd.clamp(min=1e-300)).max() < 6.0
    assert ((samples.mean(0) - mean).abs() / (ref.diagonal() / n).sqrt()).max() < 6.0


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("complement", ["zero", "prior"])
def test_sample_covariance(request, complement, structure):
    glas, full, _ = pair_with_prior(request, "regression", "sum", complement, structure)
    samples = glas.sample(100_000, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (100_000, glas.n_params)
    if complement == "prior":
        ref = full.posterior_covariance
    else:
        U, a, p = glas.eigenvectors, glas.subspace_curvature, glas.prior_precision_diag
        ref = U @ torch.linalg.inv(torch.diag(a) + U.T @ torch.diag(p) @ U) @ U.T
        outside = (samples - glas.mean) - ((samples - glas.mean) @ U) @ U.T
        assert outside.abs().max() < 1e-10  # restricted posterior: no variance off span(U)
    # the operator and the sampler describe the same covariance
    torch.testing.assert_close(glas.posterior_covariance.to_dense(), ref, rtol=1e-7, atol=1e-12)
    _sample_covariance_check(samples, glas.mean, ref)
    if complement == "zero":
        _sample_covariance_check(
            samples @ glas.eigenvectors,
            glas.mean @ glas.eigenvectors,
            glas.eigenvectors.T @ ref @ glas.eigenvectors,
        )


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_optimize_prior_precision_marglik_equals_full_laplace(request, likelihood, structure):
    glas, full, _ = pair_with_prior(request, likelihood, "sum", "zero", structure)
    kwargs = dict(method="marglik", prior_structure=structure, n_steps=60, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # laplace-torch's link_approx reminder
        glas.optimize_prior_precision(**kwargs)
        full.optimize_prior_precision(**kwargs)
    n = glas.n_layers if structure == "layerwise" else glas.n_params
    assert glas.prior_precision.shape == (n,)
    torch.testing.assert_close(glas.prior_precision, full.prior_precision, rtol=1e-6, atol=0)
    assert not torch.allclose(glas.prior_precision, torch.ones_like(glas.prior_precision))
    # a non-scalar init keeps its structure (laplace-torch's rule)
    init = structured_prior(glas, "layerwise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        glas.optimize_prior_precision(init_prior_prec=init, n_steps=20)
        full.optimize_prior_precision(init_prior_prec=init, n_steps=20)
    assert glas.prior_precision.shape == (glas.n_layers,)
    torch.testing.assert_close(glas.prior_precision, full.prior_precision, rtol=1e-6, atol=0)


def test_marglik_ascent_increases_the_evidence(request):
    glas, _, _ = pair_with_prior(request, "regression", "mean", "zero", "layerwise")
    before = glas.log_marginal_likelihood().item()
    glas.optimize_prior_precision(prior_structure="diag", n_steps=50)
    assert glas.prior_precision.shape == (glas.n_params,)
    assert glas.log_marginal_likelihood().item() > before


@pytest.mark.parametrize("structure", STRUCTURES)
def test_gridsearch_equals_full_laplace(request, structure):
    glas, full, _ = pair_with_prior(request, "classification", "sum", "prior", structure)
    model = request.getfixturevalue("classification_setup")[0]
    g = torch.Generator().manual_seed(0)
    Xval = torch.randn(12, 2, generator=g, dtype=torch.float64)
    with torch.no_grad():
        yval = torch.softmax(model(Xval), -1).multinomial(1, generator=g).squeeze(1)

    def centred_forward_call(x, likelihood, joint, link_approx, *args):
        assert link_approx == "probit" and likelihood == "classification" and not joint
        return pairwise_probit(*full._glm_predictive_distribution(x))

    full._glm_forward_call = centred_forward_call  # GLAS's probit: on differences
    kwargs = dict(
        method="gridsearch",
        prior_structure=structure,
        val_loader=loader(Xval, yval, batch_size=4),
        grid_size=15,
        log_prior_prec_min=-2,
        log_prior_prec_max=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        glas.optimize_prior_precision(**kwargs)
        full.optimize_prior_precision(**kwargs)
    n = glas.n_layers if structure == "layerwise" else glas.n_params
    assert glas.prior_precision.shape == (n,)
    chosen = float(full.prior_precision.reshape(-1)[0])
    assert 0.011 < chosen < 99.0  # an interior optimum of the grid [0.01, 100]: it mattered
    torch.testing.assert_close(
        glas.prior_precision, torch.full((n,), chosen, dtype=torch.float64), rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("structure", STRUCTURES)
def test_restricted_posterior_against_dense_algebra(request, structure):
    """complement='zero': glm variance J U A^{-1} U^T J^T with explicit Jacobians,
    log density of the projection, precision operator on span(U)."""
    glas, _, _ = pair_with_prior(request, "regression", "sum", "zero", structure)
    model = request.getfixturevalue("regression_setup")[0]
    U, a, p = glas.eigenvectors, glas.subspace_curvature, glas.prior_precision_diag
    A = torch.diag(a) + U.T @ torch.diag(p) @ U
    Sigma = U @ torch.linalg.inv(A) @ U.T
    J = explicit_jacobian(model, XTEST)  # (n, D), one output
    _, var = glas._glm_predictive_distribution(XTEST)
    torch.testing.assert_close(var.reshape(-1), torch.diag(J @ Sigma @ J.T), rtol=1e-8, atol=0)
    torch.testing.assert_close(
        glas.posterior_variances, torch.diag(torch.linalg.inv(A)), rtol=1e-8, atol=0
    )
    x = glas.mean + torch.randn(glas.n_params, generator=torch.Generator().manual_seed(1)).double()
    z = (x - glas.mean) @ U
    ref = torch.distributions.MultivariateNormal(torch.zeros_like(z), precision_matrix=A)
    torch.testing.assert_close(glas.log_prob(x), ref.log_prob(z), rtol=1e-10, atol=0)
    op = glas.posterior_precision  # U A U^T on span(U), infinite off it
    torch.testing.assert_close(
        (op.vectors * op.values) @ op.vectors.T, U @ A @ U.T, rtol=1e-10, atol=1e-12
    )
    assert math.isinf(float(op.complement))


def test_woodbury_against_dense_inverse_with_rank_deficient_curvature():
    """Woodbury's covariance, determinant lemma and sampler's square root on a dense
    example whose curvature has zero directions (a_j = 0)."""
    g = torch.Generator().manual_seed(0)
    D, k = 30, 6
    U, _ = torch.linalg.qr(torch.randn(D, k, generator=g, dtype=torch.float64))
    a = torch.tensor([50.0, 4.0, 1.0, 0.1, 0.0, 0.0], dtype=torch.float64)
    p = 0.2 + torch.rand(D, generator=g, dtype=torch.float64) * 5
    P = (U * a) @ U.T + torch.diag(p)
    post = DiagonalPriorPosterior(U, a, p, "prior")
    torch.testing.assert_close(post.covariance.to_dense(), torch.linalg.inv(P), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        post.log_det_ratio, torch.logdet(P) - p.log().sum(), rtol=1e-12, atol=0
    )
    x = torch.randn(D, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(post.covariance @ x, torch.linalg.solve(P, x), rtol=1e-10, atol=0)
    torch.testing.assert_close(post.precision @ x, P @ x, rtol=1e-12, atol=0)
    # the sampler is linear in its standard normals: its matrix L has L L^T = P^{-1}
    eye_draws = []
    for i in range(D):
        e = torch.zeros(1, D, dtype=torch.float64)
        e[0, i] = 1.0
        c, R = post._capacitance
        root_c = c.sqrt()
        gfac = -1.0 / (root_c * (1.0 + root_c))
        BR = (U * a.sqrt() * p.rsqrt()[:, None]) @ R
        eye_draws.append(((e + ((e @ BR) * gfac) @ BR.T) * p.rsqrt())[0])
    L = torch.stack(eye_draws, dim=1)
    torch.testing.assert_close(L @ L.T, torch.linalg.inv(P), rtol=1e-10, atol=1e-14)
    restricted = DiagonalPriorPosterior(U, a, p, "zero")
    A = torch.diag(a) + U.T @ torch.diag(p) @ U
    torch.testing.assert_close(
        restricted.covariance.to_dense(), U @ torch.linalg.inv(A) @ U.T, rtol=1e-10, atol=1e-14
    )


def test_constant_structured_prior_equals_the_scalar_closed_forms(request):
    """Two code paths, one posterior: a layerwise prior with equal entries is tau."""
    tau = 1.7
    for complement in ("zero", "prior"):
        glas, _, _ = fitted_pair(
            request.getfixturevalue("regression_setup"), "regression", "sum", complement
        )
        glas.prior_precision = tau
        scalar = (
            glas.log_marginal_likelihood().detach(),
            glas._glm_predictive_distribution(XTEST)[1],
            glas.posterior_variances,
            glas.posterior_covariance.to_dense(),
            glas.log_prob(glas.mean + 0.01),
        )
        glas.prior_precision = torch.full((glas.n_layers,), tau, dtype=torch.float64)
        layerwise = (
            glas.log_marginal_likelihood().detach(),
            glas._glm_predictive_distribution(XTEST)[1],
            glas.posterior_variances,
            glas.posterior_covariance.to_dense(),
            glas.log_prob(glas.mean + 0.01),
        )
        for s, lw in zip(scalar, layerwise):
            torch.testing.assert_close(lw, s, rtol=1e-9, atol=1e-14)


def linear_model_posterior(n_components: int):
    """GLAS ('prior' complement, sum scaling) of a fitted 3-1 linear regression, and the
    generator that drew its data (for the test inputs that follow).
    """
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = X @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=0.5,
        n_components=n_components,
        complement="prior",
        loss_scaling="sum",
    )
    la.fit(loader(X, y))
    return la, g


def test_nn_predictive_of_a_linear_model_matches_glm():
    """For a linear model the 'nn' predictive is the 'glm' one (up to sampling)."""
    la, g = linear_model_posterior(n_components=2)
    la.prior_precision = torch.tensor([0.5, 3.0], dtype=torch.float64)  # weight, bias
    Xtest = torch.randn(5, 3, generator=g, dtype=torch.float64)
    _, var_glm = la(Xtest, pred_type="glm")
    n = 40_000
    _, var_nn = la(
        Xtest,
        pred_type="nn",
        link_approx="mc",
        n_samples=n,
        generator=torch.Generator().manual_seed(1),
    )
    rel_sd = math.sqrt(2 / n)
    assert ((var_nn.reshape(-1) / var_glm.reshape(-1) - 1).abs() < 6 * rel_sd).all()


# ---------------------------------------------------------------- misuse
def test_prior_of_the_wrong_length_or_sign_is_refused(request):
    glas, _, _ = fitted_pair(
        request.getfixturevalue("regression_setup"), "regression", "sum", "zero"
    )
    before = glas.prior_precision.clone()
    with pytest.raises(ValueError, match=r"n_layers=4.*D=19.*shape \(3,\)"):
        glas.prior_precision = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positive and finite"):
        glas.prior_precision = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positive and finite"):
        glas.log_marginal_likelihood(torch.tensor([1.0, math.nan, 1.0, 1.0]).double())
    for shape in ((2, 2), (1, 1)):  # laplace-torch refuses 2-D prior precisions
        with pytest.raises(ValueError, match=r"prior_precision must be a number or a 1-D"):
            glas.prior_precision = torch.ones(shape, dtype=torch.float64)
    assert torch.equal(glas.prior_precision, before)
    with pytest.raises(ValueError, match=r"prior_structure must be one of"):
        glas.optimize_prior_precision(prior_structure="blockwise")
    with pytest.raises(ValueError, match=r"n_layers=4"):
        glas.optimize_prior_precision(init_prior_prec=torch.ones(5, dtype=torch.float64))
    assert torch.equal(glas.prior_precision, before)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_state_dict_round_trip_keeps_the_structured_prior(request, structure, tmp_path):
    glas, _, _ = pair_with_prior(request, "regression", "sum", "prior", structure)
    path = tmp_path / "glas.pt"
    torch.save(glas.state_dict(), path)
    model = request.getfixturevalue("regression_setup")[0]
    other = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=0.3,
        n_components=8,
        complement="prior",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(other.prior_precision, glas.prior_precision, rtol=0, atol=0)
    torch.testing.assert_close(other.log_marginal_likelihood(), glas.log_marginal_likelihood())
    state = glas.state_dict()
    state["prior_precision"] = -state["prior_precision"]
    with pytest.raises(ValueError, match=r"prior_precision.*positive"):
        other.load_state_dict(state)


def test_layer_gram_cache_follows_truncation_and_refit(request):
    """The cached U_l^T U_l blocks are those of the current eigenvectors."""
    glas, _, _ = pair_with_prior(request, "regression", "sum", "zero", "layerwise")
    p = glas.prior_precision_diag

    def dense_restricted(la):
        U = la.eigenvectors
        return torch.diag(la.subspace_curvature) + U.T @ torch.diag(p) @ U

    assert torch.isfinite(glas.log_det_ratio)  # fills the cache at k = 8
    glas.n_components = 5
    op = glas.posterior_precision
    torch.testing.assert_close(
        (op.vectors * op.values) @ op.vectors.T,
        glas.eigenvectors @ dense_restricted(glas) @ glas.eigenvectors.T,
    )
    assert torch.isfinite(glas.log_det_ratio)  # cache at k = 5
    glas.H[0].copy_(glas.H[0].flip(1).clone())  # in place: the cache must notice
    op = glas.posterior_precision
    torch.testing.assert_close(
        (op.vectors * op.values) @ op.vectors.T,
        glas.eigenvectors @ dense_restricted(glas) @ glas.eigenvectors.T,
    )


# ---------------------------------------------------------------- calibration
def calibration_points(model, n: int, seed: int):
    """``n`` held-out inputs on [-2, 2] and targets: the model's output plus noise 0.3."""
    g = torch.Generator().manual_seed(seed)
    Xc = torch.rand(n, 1, generator=g, dtype=torch.float64) * 4 - 2
    with torch.no_grad():
        return Xc, model(Xc) + 0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("complement", ["zero", "prior"])
def test_calibration_at_the_own_structured_prior_against_dense_algebra(request, complement):
    """Rows with prior_precision=None are the posterior's own diagonal prior at each k:
    coverage, width and NLL from J Sigma_k J^T with explicit Jacobians."""
    glas, _, _ = pair_with_prior(request, "regression", "sum", complement, "diag")
    model = request.getfixturevalue("regression_setup")[0]
    Xc, yc = calibration_points(model, 30, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = select_dimension(
            glas, loader(Xc, yc, batch_size=7), coverage=0.8, ks=[2, 5, 8], include_noise=False
        )
    own = {r.k: r for r in sel.rows if r.prior_precision is None}
    assert sorted(own) == [2, 5, 8]
    assert any(r.empirical_bayes for r in sel.rows)  # the scalar EB candidates stay
    J = explicit_jacobian(model, Xc)
    with torch.no_grad():
        f = model(Xc).reshape(-1)
    p = glas.prior_precision_diag
    z = statistics.NormalDist().inv_cdf(0.9)
    for k, row in own.items():
        U, a = glas.H[0][:, :k], glas._curvature_up_to(k)
        if complement == "zero":
            Sigma = U @ torch.linalg.inv(torch.diag(a) + U.T @ torch.diag(p) @ U) @ U.T
        else:
            Sigma = torch.linalg.inv((U * a) @ U.T + torch.diag(p))
        var = torch.diag(J @ Sigma @ J.T)
        half = z * var.sqrt()
        covered = float(((yc.reshape(-1) - f).abs() <= half).double().mean())
        assert row.coverage == pytest.approx(covered, abs=1e-12)
        assert row.mean_width == pytest.approx(float(2 * half.mean()), rel=1e-8)
        total = var + 0.09
        nll = float(
            (0.5 * (torch.log(2 * math.pi * total) + (yc.reshape(-1) - f) ** 2 / total)).mean()
        )
        assert row.nll == pytest.approx(nll, rel=1e-8)
    assert "own" in str(sel)


def test_calibrate_keeps_the_structured_prior_and_sets_k(request):
    glas, _, _ = pair_with_prior(request, "regression", "sum", "zero", "layerwise")
    before = glas.prior_precision.clone()
    model = request.getfixturevalue("regression_setup")[0]
    Xc, yc = calibration_points(model, 20, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = glas.calibrate(
            loader(Xc, yc), coverage=0.5, empirical_bayes=False, pred_type="nn", n_samples=50
        )
    assert sel.prior_precision is None and all(r.prior_precision is None for r in sel.rows)
    assert glas.n_components == sel.k
    assert torch.equal(glas.prior_precision, before)


def test_nn_calibration_of_a_linear_model_matches_its_glm_calibration():
    """'nn' rows at the own prior sample the structured posterior: for a linear model
    their interval widths agree with the closed-form 'glm' rows (sampling error)."""
    la, g = linear_model_posterior(n_components=3)
    la.prior_precision = torch.tensor([0.5, 3.0], dtype=torch.float64)
    Xc = torch.randn(25, 3, generator=g, dtype=torch.float64)
    yc = Xc @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    calib = loader(Xc, yc + 0.5 * torch.randn(25, 1, generator=g, dtype=torch.float64))
    widths = {}
    for pred_type in ("glm", "nn"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sel = select_dimension(
                la,
                calib,
                ks=[1, 3],
                pred_type=pred_type,
                n_samples=4000,
                empirical_bayes=False,
                generator=torch.Generator().manual_seed(1),
            )
        widths[pred_type] = [r.mean_width for r in sel.rows]
    torch.testing.assert_close(
        torch.tensor(widths["nn"]), torch.tensor(widths["glm"]), rtol=0.05, atol=0
    )


def test_activity_scores_refuse_a_structured_prior_clearly(request):
    from laplace_glas.diagnostics.activity import activity_scores

    glas, _, _ = pair_with_prior(request, "regression", "sum", "zero", "layerwise")
    with pytest.raises(ValueError, match=r"scalar \(isotropic\) prior precision.*shape \(4,\)"):
        activity_scores(glas, weighting="posterior")
    assert activity_scores(glas, weighting="eigenvalue").shape == (glas.n_params,)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_float32_posterior_with_a_structured_prior(toy_regression, structure):
    """float32 runs in float32 and agrees with the same algebra in float64."""
    from conftest import fit_glas

    model, X, y = toy_regression
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la = fit_glas(model, X, y, n_components=6, complement="prior")
    prior = structured_prior(la, structure).float()
    la.prior_precision = prior
    U, a = la.eigenvectors, la.subspace_curvature
    ref = DiagonalPriorPosterior(U.double(), a.double(), la.prior_precision_diag.double(), "prior")
    assert la.log_det_ratio.dtype == torch.float32
    torch.testing.assert_close(la.log_det_ratio.double(), ref.log_det_ratio, rtol=1e-4, atol=0)
    _, f_var = la(X[:5], pred_type="glm")
    assert f_var.dtype == torch.float32 and bool((f_var > 0).all())
    assert la.sample(3, generator=torch.Generator().manual_seed(0)).dtype == torch.float32
    la.optimize_prior_precision(prior_structure=structure, n_steps=5)
    assert la.prior_precision.dtype == torch.float32 and bool(
        torch.isfinite(la.prior_precision).all()
    )


def test_subnetwork_posterior_refuses_a_structured_prior_clearly():
    from conftest import mlp

    from laplace_glas import SubnetActiveSubspaceLaplace

    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 2, generator=g)
    y = torch.randn(6, 1, generator=g)
    model = mlp([2, 4, 1])
    la = SubnetActiveSubspaceLaplace(
        model, "regression", torch.tensor([0, 3, 5, 9, 12]), n_components=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=3))
    la.prior_precision = torch.ones(la.n_params)  # one per subnetwork weight
    for call in (lambda: la.log_marginal_likelihood(), lambda: la.sample(2), lambda: la(X)):
        with pytest.raises(ValueError, match=r"not implemented for SubnetActiveSubspaceLaplace"):
            call()


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_last_layer_structured_prior_equals_full_ll_laplace(likelihood):
    """Last-layer GLAS with a diagonal prior equals FullLLLaplace in the k >= rank limit
    (laplace-torch's last-layer Laplace takes scalar or diagonal priors)."""
    from test_subsets import fitted as fitted_subset

    glas, full, Xtest, _ = fitted_subset("last_layer", likelihood)
    g = torch.Generator().manual_seed(7)
    prior = 0.3 + 2 * torch.rand(glas.n_params, generator=g, dtype=torch.float64)
    glas.prior_precision = prior
    full.prior_precision = prior
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-8, atol=0
    )
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-7, atol=1e-12
    )
    _, v_g = glas._glm_predictive_distribution(Xtest)
    _, v_f = full._glm_predictive_distribution(Xtest)
    torch.testing.assert_close(v_g, v_f, rtol=1e-7, atol=1e-12)
