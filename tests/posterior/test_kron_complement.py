"""complement='kron': KFAC's curvature off span(U), against dense references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import explicit_jacobian, fit_glas, loader, mlp, regression_data, train
from laplace.utils.matrix import Kron
from torch.func import jacrev, vmap

from laplace_glas.posterior.closed_forms import ScalarPriorPosterior
from laplace_glas.posterior.kron_complement import KronComplementPosterior, KronCurvature

DOUBLE = torch.float64


def random_factor(n: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    M = torch.randn(n, n + 1, generator=g, dtype=DOUBLE)
    return scale * M @ M.T / n


@pytest.fixture
def parts():
    """``U`` (D = 3*2 + 3 + 2 = 11, k = 3), ``a``, ``tau`` and KFAC factors with
    blocks ``[B, A]`` (3 x 2), ``[B]`` (3) and ``[B]`` (2).
    """
    g = torch.Generator().manual_seed(0)
    kron = Kron(
        [
            [random_factor(3, g, 2.0), random_factor(2, g)],
            [random_factor(3, g)],
            [random_factor(2, g, 4.0)],
        ]
    )
    D = 11
    U = torch.linalg.qr(torch.randn(D, 3, generator=g, dtype=DOUBLE))[0]
    a = torch.tensor([30.0, 4.0, 0.5], dtype=DOUBLE)
    return U, a, torch.tensor(0.7, dtype=DOUBLE), kron, torch.tensor(1.3, dtype=DOUBLE)


def dense_kron(kron: Kron) -> torch.Tensor:
    """The block-diagonal ``K`` formed explicitly with ``torch.kron``."""
    blocks = [F[0] if len(F) == 1 else torch.kron(F[0], F[1]) for F in kron.kfacs]
    return torch.block_diag(*blocks)


def dense_sigma(U, a, tau, C):
    """``U diag(1/(a+tau)) U^T + P (C + tau I)^{-1} P``, formed explicitly."""
    eye = torch.eye(U.shape[0], dtype=U.dtype)
    P = eye - U @ U.T
    return U @ torch.diag(1 / (a + tau)) @ U.T + P @ torch.linalg.inv(C + tau * eye) @ P


def posterior_of(parts) -> tuple[KronComplementPosterior, torch.Tensor]:
    U, a, tau, kron, s = parts
    curvature = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device), s)
    return KronComplementPosterior(U, a, tau, curvature), dense_sigma(
        U, a, tau, s * dense_kron(kron)
    )


def test_the_kron_curvature_is_the_dense_kronecker_product(parts):
    U, _, tau, kron, s = parts
    C = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device), s)
    dense = s * dense_kron(kron)
    eye = torch.eye(11, dtype=DOUBLE)
    torch.testing.assert_close(C.to_dense(tau), dense + tau * eye)
    torch.testing.assert_close(C.to_dense(tau, -1.0), torch.linalg.inv(dense + tau * eye))
    torch.testing.assert_close(C.logdet(tau), torch.logdet(dense + tau * eye))
    torch.testing.assert_close(C.eigenvalues.sort().values, torch.linalg.eigvalsh(dense))
    half = C.to_dense(tau, -0.5)
    torch.testing.assert_close(half @ half, torch.linalg.inv(dense + tau * eye))


@pytest.mark.parametrize("exponent", [-1.0, 1.0])
def test_the_kron_factor_is_a_non_symmetric_root(parts, exponent):
    """``F = Q diag((lambda + tau)^(e/2))``: ``F F^T = (C + tau I)^e`` (the dense
    Kronecker product), in the eigenbasis, not the symmetric root."""
    U, _, tau, kron, s = parts
    C = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device), s)
    eye = torch.eye(11, dtype=DOUBLE)
    expected = torch.linalg.matrix_power(s * dense_kron(kron) + tau * eye, int(exponent))
    F = C.factor(eye, tau, exponent)
    torch.testing.assert_close(F @ F.T, expected)
    assert not torch.allclose(F, C.to_dense(tau, exponent / 2))
    W = torch.randn(4, 2, 11, generator=torch.Generator().manual_seed(1), dtype=DOUBLE)
    WF = C.factor(W, tau, exponent)
    torch.testing.assert_close(WF @ WF.transpose(-1, -2), W @ expected @ W.transpose(-1, -2))


def test_every_form_equals_the_dense_posterior(parts):
    post, sigma = posterior_of(parts)
    U, tau, D = parts[0], parts[2], 11
    torch.testing.assert_close(post.covariance.to_dense(), sigma)
    torch.testing.assert_close(post.precision.to_dense(), torch.linalg.inv(sigma))
    V, w, base = post.covariance_factors()
    eye = torch.eye(D, dtype=DOUBLE)
    torch.testing.assert_close(V @ torch.diag(w) @ V.T + base(eye), sigma)
    torch.testing.assert_close(post.log_det_posterior_precision, -torch.logdet(sigma))
    torch.testing.assert_close(post.log_det_ratio, -torch.logdet(sigma) - D * tau.log())
    torch.testing.assert_close(post.precision.logdet(), -torch.logdet(sigma))
    torch.testing.assert_close(post.covariance.logdet(), torch.logdet(sigma))
    torch.testing.assert_close(post.covariance.diagonal(), sigma.diagonal())
    torch.testing.assert_close(post.precision.diagonal(), torch.linalg.inv(sigma).diagonal())
    torch.testing.assert_close(post.precision.clone().to_dense(), torch.linalg.inv(sigma))
    x = torch.randn(D, 2, dtype=DOUBLE)
    torch.testing.assert_close(post.covariance @ x, sigma @ x)
    torch.testing.assert_close(post.subspace_variances, torch.diagonal(U.T @ sigma @ U))
    delta = torch.randn(4, D, dtype=DOUBLE)
    expected = torch.einsum("nd,de,ne->n", delta, torch.linalg.inv(sigma), delta)
    torch.testing.assert_close(post.square_norm(delta), expected)
    torch.testing.assert_close(post.square_norm(delta[0]), expected[0])


def test_draws_have_the_posterior_covariance(parts):
    post, sigma = posterior_of(parts)
    draws = post.sample(200_000, torch.Generator().manual_seed(1))
    empirical = draws.T @ draws / draws.shape[0]
    # entries of sigma are O(1); the Monte Carlo error of 2e5 draws is ~ 3 / sqrt(2e5)
    assert (empirical - sigma).abs().max() < 0.02
    # no draw has a component the posterior does not allow: U^T draws ~ N(0, diag(v))
    z = draws @ parts[0]
    torch.testing.assert_close(z.var(0), post.subspace_variances, rtol=0.02, atol=0)


def test_zero_kron_curvature_is_the_prior_complement(parts):
    U, a, tau, kron, _ = parts
    blocks = KronCurvature.decompose(kron, DOUBLE, U.device)
    zero = KronCurvature(blocks, torch.zeros((), dtype=DOUBLE))
    post = KronComplementPosterior(U, a, tau, zero)
    prior = ScalarPriorPosterior(U, a, tau, "prior")
    torch.testing.assert_close(post.covariance.to_dense(), prior.covariance.to_dense())
    torch.testing.assert_close(post.log_det_ratio, prior.log_det_ratio)


def test_a_flat_prior_is_refused(parts):
    U, a, _, kron, s = parts
    C = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device), s)
    with pytest.raises(ValueError, match="proper prior"):
        KronComplementPosterior(U, a, torch.tensor(0.0, dtype=DOUBLE), C)


# ---------------------------------------------------------------- fitted posteriors


def explicit_kfac(model: torch.nn.Sequential, X: torch.Tensor, hessian) -> torch.Tensor:
    """KFAC of the summed GGN of an ``mlp`` written out: per ``nn.Linear`` ``B (x) A`` for
    the weight and ``B`` for the bias, ``A = mean_n a_n a_n^T``, ``B = sum_n S_n^T Lambda_n
    S_n`` with ``S_n = df_n / ds_n`` the output's Jacobian in the pre-activation
    (``torch.func``; independent of curvlinops).
    """
    layers = list(model)
    out = model(X).detach()
    Lam = hessian(out)  # (N, C, C)
    blocks = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Linear):
            continue
        a = torch.nn.Sequential(*layers[:i])(X).detach()
        s = layer(a).detach()
        rest = torch.nn.Sequential(*layers[i + 1 :])
        S = vmap(jacrev(rest))(s)  # (N, C, d_out)
        B = torch.einsum("nco,ncd,ndp->op", S, Lam, S)
        A = a.T @ a / X.shape[0]
        blocks += [torch.kron(B.contiguous(), A.contiguous()), B]
    return torch.block_diag(*blocks)


def unit_noise(out: torch.Tensor) -> torch.Tensor:
    return torch.eye(out.shape[1], dtype=out.dtype).expand(out.shape[0], -1, -1)


def softmax_hessian(out: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(out, -1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


@pytest.fixture(scope="module")
def fitted():
    X, y = regression_data(40, d_out=2)
    X, y = X.double(), y.double()
    model = train(mlp([1, 5, 2], dtype=DOUBLE), X, y, steps=200)
    la = fit_glas(
        model, X, y, n_components=4, complement="kron", loss_scaling="sum", prior_precision=0.5
    )
    return la, model, X, y


def dense_posterior(la, model, X, X_train):
    """The Jacobian ``(n*C, D)`` at ``X`` and the dense ``Sigma`` of ``la``."""
    K = explicit_kfac(model, X_train, unit_noise)
    return explicit_jacobian(model, X), dense_sigma(
        la.eigenvectors, la.subspace_curvature, la.prior_precision[0], la._H_factor * K
    )


def test_the_fitted_factors_are_the_explicit_kfac_and_laplace_torchs(fitted):
    from laplace import KronLaplace

    la, model, X, y = fitted
    K = explicit_kfac(model, X, unit_noise)
    torch.testing.assert_close(la._ggn_kron.to_matrix(), K)
    reference = KronLaplace(model, "regression")
    reference.fit(loader(X, y, 10))  # equal batches: laplace-torch's sum of factors
    torch.testing.assert_close(la._ggn_kron.to_matrix(), reference.H_facs.to_matrix())


def test_the_classification_factors_are_the_explicit_kfac():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 2, generator=g, dtype=DOUBLE)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    model = train(mlp([2, 5, 3], dtype=DOUBLE), X, y, steps=100, classification=True)
    padded = y.clone()
    padded[:10] = -100  # padding is left out, as in the loss
    la = fit_glas(model, X, padded, "classification", n_components=3, complement="kron")
    torch.testing.assert_close(
        la._ggn_kron.to_matrix(), explicit_kfac(model, X[10:], softmax_hessian)
    )


def test_the_evidence_counts_every_direction(fitted):
    la, model, X, _ = fitted
    _, sigma = dense_posterior(la, model, X, X)
    tau = la.prior_precision[0]
    expected = (
        la.log_likelihood
        - 0.5 * (-torch.logdet(sigma) - la.n_params * tau.log())
        - 0.5 * la.scatter
    )
    torch.testing.assert_close(la.log_marginal_likelihood(), expected)
    torch.testing.assert_close(la.posterior_covariance.to_dense(), sigma)
    torch.testing.assert_close(la.posterior_precision.to_dense(), torch.linalg.inv(sigma))


def test_the_evidence_gradient_matches_finite_differences(fitted):
    la, *_ = fitted
    for value in (0.05, 0.5, 5.0):
        tau = torch.tensor([value], dtype=DOUBLE, requires_grad=True)
        (grad,) = torch.autograd.grad(la.log_marginal_likelihood(prior_precision=tau), tau)
        h = 1e-6 * value

        def evidence(t: float) -> float:
            return float(
                la.log_marginal_likelihood(prior_precision=torch.tensor([t], dtype=DOUBLE))
            )

        central = (evidence(value + h) - evidence(value - h)) / (2 * h)
        assert float(grad) == pytest.approx(central, rel=1e-6, abs=1e-6)
    # and in the noise (the complement's curvature scales with 1 / sigma^2)
    sigma = torch.tensor(0.2, dtype=DOUBLE, requires_grad=True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(sigma_noise=sigma), sigma)
    h = 1e-7

    def at(s: float) -> float:
        return float(la.log_marginal_likelihood(sigma_noise=torch.tensor(s, dtype=DOUBLE)))

    assert float(grad) == pytest.approx((at(0.2 + h) - at(0.2 - h)) / (2 * h), rel=1e-6)
    la.sigma_noise, la.prior_precision = 0.1, 0.5  # the fixture's


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
        h = 1e-4
        slope = (evidence(tau * math.exp(h)) - evidence(tau * math.exp(-h))) / (2 * h)
        assert abs(slope) < 1e-5 * max(1.0, abs(best))
    finally:
        la.prior_precision = before


def test_weight_draws_have_the_dense_covariance(fitted):
    la, model, X, _ = fitted
    _, sigma = dense_posterior(la, model, X, X)
    draws = la.sample(100_000, generator=torch.Generator().manual_seed(0)) - la.mean
    empirical = draws.T @ draws / draws.shape[0]
    # relative to the posterior's scale: max |Sigma_ij| is the largest prior variance
    scale = float(sigma.abs().max())
    assert float((empirical - sigma).abs().max()) < 0.03 * scale


def test_state_dict_round_trip_keeps_the_factors(fitted):
    la, model, X, y = fitted
    state = la.state_dict()
    assert all(isinstance(block, tuple) for block in state["ggn_kron"])
    other = fit_glas(model, X, y, n_components=2, loss_scaling="sum", complement="zero")
    with pytest.warns(UserWarning, match="replaced by the saved 'kron'"):
        other.load_state_dict(state)
    assert other.complement == "kron"
    torch.testing.assert_close(other(X[:5], pred_type="glm")[1], la(X[:5], pred_type="glm")[1])
    torch.testing.assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    broken = dict(state)
    del broken["ggn_kron"]
    with pytest.raises(ValueError, match="ggn_kron"):
        other.load_state_dict(broken)
    broken["ggn_kron"] = state["ggn_kron"][:-1]
    with pytest.raises(ValueError, match="one block per parameter tensor"):
        other.load_state_dict(broken)
    blocks = list(state["ggn_kron"])
    blocks[2] = (blocks[2][0], blocks[2][1][:-1, :-1])  # the second layer's A: 5 x 5
    broken["ggn_kron"] = tuple(blocks)
    with pytest.raises(ValueError, match="Kronecker size"):
        other.load_state_dict(broken)
    blocks = list(state["ggn_kron"])
    B = blocks[2][0].clone()
    B[0, 1] += 1.0
    broken["ggn_kron"] = (*blocks[:2], (B, blocks[2][1]), *blocks[3:])
    with pytest.raises(ValueError, match="not symmetric"):
        other.load_state_dict(broken)
    assert other.complement == "kron"  # a refused load leaves it as it was


def test_a_float32_model_gets_the_float64_factors_to_its_precision():
    X, y = regression_data(40)
    model = train(mlp([1, 6, 1]), X, y, steps=100)
    single = fit_glas(model, X, y, n_components=3, complement="kron", loss_scaling="sum")
    double = fit_glas(
        copy.deepcopy(model).double(), X.double(), y.double(), n_components=3, complement="kron",
        loss_scaling="sum",
    )  # fmt: skip
    torch.testing.assert_close(
        single._ggn_kron.to_matrix().double(), double._ggn_kron.to_matrix(), rtol=1e-4, atol=1e-4
    )
    assert torch.isfinite(single(X[:4].float())[1]).all()


def test_calibration_rows_equal_the_posteriors_own_coverage(fitted):
    from laplace_glas import select_dimension
    from laplace_glas.diagnostics.calibration import coverage

    la, model, X, y = fitted
    calib = loader(X[::2], y[::2])
    selection = select_dimension(
        la, calib, ks=[1, 3], prior_precisions=[0.3, 2.0], empirical_bayes=True,
        include_noise=False,
    )  # fmt: skip
    for row in selection.rows:
        other = la.with_loss_scaling("sum")
        other.n_components, other.prior_precision = row.k, row.prior_precision
        assert row.coverage == pytest.approx(coverage(other, calib, include_noise=False))
        J, sigma = dense_posterior(other, model, X[::2], X)
        var = torch.einsum("nd,de,ne->n", J, sigma, J)
        half = 1.6448536269514722 * var.sqrt()  # the epistemic interval (no noise)
        assert row.mean_width == pytest.approx(float(2 * half.mean()), rel=1e-6)
    eb = [r for r in selection.rows if r.empirical_bayes and r.k == 3]
    other = la.with_loss_scaling("sum")
    other.n_components = 3
    other.optimize_prior_precision()
    assert eb[0].prior_precision == pytest.approx(float(other.prior_precision), rel=1e-6)


def test_kron_refuses_what_it_cannot_serve(fitted):
    from laplace.curvature import CurvlinopsEF

    from laplace_glas import (
        ActiveSubspaceLaplace,
        LastLayerActiveSubspaceLaplace,
        SubnetActiveSubspaceLaplace,
    )

    la, model, X, y = fitted
    small = mlp([1, 4, 1])
    with pytest.raises(ValueError, match="complement='kron' is not available"):
        LastLayerActiveSubspaceLaplace(small, "regression", n_components=2, complement="kron")
    with pytest.raises(ValueError, match="complement='kron' is not available"):
        SubnetActiveSubspaceLaplace(
            small, "regression", torch.tensor([0, 1, 2]), n_components=2, complement="kron"
        )
    with pytest.raises(ValueError, match="cannot follow a custom loss_fn"):
        ActiveSubspaceLaplace(
            small, "regression", complement="kron", loss_fn=torch.nn.MSELoss(reduction="sum")
        )
    with pytest.raises(ValueError, match="cannot follow the ef backend"):
        ActiveSubspaceLaplace(small, "regression", complement="kron", backend=CurvlinopsEF)
    other = la.with_loss_scaling("sum")
    other.prior_precision = torch.ones(4, dtype=DOUBLE)  # layerwise: the blocks keep it
    assert torch.isfinite(other.posterior_variances).all()
    with pytest.raises(ValueError, match="per-weight prior needs complement='diag'"):
        other.prior_precision = torch.ones(other.n_params, dtype=DOUBLE)
    zero = fit_glas(model, X, y, n_components=2, loss_scaling="mean", complement="zero")
    zero.complement = "kron"
    with pytest.raises(ValueError, match="Refit with complement='kron'"):
        zero.posterior_variances  # noqa: B018


def test_a_layer_kfac_does_not_cover_is_refused_before_the_solve():
    X, y = regression_data(20)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"nn\.Linear or nn\.Conv2d"):
        fit_glas(model, X, y, n_components=2, complement="kron")


def test_conv_factors_follow_the_weights_flattening():
    """A last Conv2d with one output position and a scalar output under unit noise has
    the same sensitivity for every input, so KFAC's weight block is the exact GGN block
    ``sum_n vec(x_n) vec(x_n)^T``: the factors' layout is the weight's (C_in, kh, kw)
    flattening.
    """
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, 2, 3, generator=g, dtype=DOUBLE)
    y = torch.randn(30, 1, generator=g, dtype=DOUBLE)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 1, (2, 3)), torch.nn.Flatten()).to(DOUBLE)
    la = fit_glas(model, X, y, n_components=2, complement="kron", loss_scaling="sum")
    J = explicit_jacobian(model, X)  # (N, 12 + 1)
    torch.testing.assert_close(la._ggn_kron.to_matrix()[:12, :12], J[:, :12].T @ J[:, :12])
    _, f_var = la(X[:4])
    expected = torch.einsum("nd,de,ne->n", J[:4], la.posterior_covariance.to_dense(), J[:4])
    torch.testing.assert_close(f_var.reshape(-1), expected)


def test_the_complement_covariance_is_a_gram_of_its_root(parts):
    """``B = P E^{-1} P = R R^T`` with ``R = P F``, ``F F^T = E^{-1}``: ``J B J^T`` formed as
    ``(J R)(J R)^T`` (positive semi-definite in floating point)."""
    post, sigma = posterior_of(parts)
    U, D = parts[0], 11
    _, _, base = post.covariance_factors()
    eye = torch.eye(D, dtype=DOUBLE)
    R = base.root(eye)
    projector = eye - U @ U.T
    # the root is P F with KFAC's eigenbasis factor F (no rotation back by Q^T)
    torch.testing.assert_close(R, projector @ post.C.factor(eye, post.tau, -1.0))
    torch.testing.assert_close(R @ R.T, base(eye))
    subspace = U @ torch.diag(post.subspace_variances) @ U.T
    torch.testing.assert_close(R @ R.T, projector @ (sigma - subspace) @ projector)
    torch.testing.assert_close(U.T @ R, torch.zeros(U.shape[1], D, dtype=DOUBLE))


def test_float32_variances_stay_nonnegative_under_a_huge_prior(parts):
    """At ``tau = 1.6e7`` in float32 the ``V diag(w) V^T + E^{-1}`` form (with negative
    ``w``) rounded a predictive variance to -5.7e-7; the two Gram terms of
    :meth:`covariance_factors` cannot go below 0, and they still equal the float64 ones."""
    U, a, _, kron, s = parts
    tau = torch.tensor(15893627.0, dtype=DOUBLE)
    g = torch.Generator().manual_seed(3)
    Js = torch.randn(64, 3, 11, generator=g, dtype=DOUBLE)
    Js[:32] = Js[:32] @ U @ U.T + 1e-3 * Js[:32]  # mostly inside span(U): a tiny complement
    variances = {}
    for dtype in (torch.float32, DOUBLE):
        C = KronCurvature(KronCurvature.decompose(kron, dtype, U.device), s.to(dtype))
        post = KronComplementPosterior(U.to(dtype), a.to(dtype), tau.to(dtype), C)
        V, w, base = post.covariance_factors()
        JV, JR = Js.to(dtype) @ V, base.root(Js.to(dtype))
        f_var = torch.einsum("nck,k,nlk->ncl", JV, w, JV) + JR @ JR.transpose(-1, -2)
        variances[dtype] = f_var.diagonal(dim1=-2, dim2=-1)
    assert (variances[torch.float32] >= 0).all()
    torch.testing.assert_close(
        variances[torch.float32].double(), variances[DOUBLE], rtol=1e-4, atol=1e-12
    )


@pytest.mark.parametrize("complement", ["kron", "diag"])
def test_the_cached_projection_is_the_products_with_e_and_follows_the_fit(complement):
    """The evidence reuses ``U^T C_r U`` at unit scale across priors and noises; it
    equals ``U^T E U`` from ``k`` products with ``E`` at every ``(tau, sigma)``, and is
    rebuilt for another ``k`` and after a refit."""
    X, y = regression_data(40, d_out=2)
    X, y = X.double(), y.double()
    model = train(mlp([1, 5, 2], dtype=DOUBLE), X, y, steps=100)
    la = fit_glas(model, X, y, n_components=4, complement=complement, prior_precision=0.5)

    def products_with_E(post):
        return post.U.T @ post.power_of_E(post.U.T, 1.0).T

    for tau, sigma in ((0.5, 1.0), (3.0, 0.2), (1e-3, 7.0)):
        la.prior_precision, la.sigma_noise = tau, sigma
        post = la._posterior()
        assert post.projected is not None
        torch.testing.assert_close(post._projected_precision(), products_with_E(post))
    first = la._projection_cache[1]
    la.n_components = 3
    post = la._posterior()
    assert la._projection_cache[1][0].shape == (3, 3)
    torch.testing.assert_close(post._projected_precision(), products_with_E(post))
    la.n_components = 4
    la.fit(loader(X[:30], y[:30], 10))  # another fit: other eigenvectors
    post = la._posterior()
    assert la._projection_cache[1][0] is not first[0]
    torch.testing.assert_close(post._projected_precision(), products_with_E(post))
