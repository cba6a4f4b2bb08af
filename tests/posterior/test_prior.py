"""The Prior objects against dense references on a small D."""

import pytest
import torch

from laplace_glas.posterior import DiagonalPrior, LayerwisePrior, Prior, ScalarPrior
from laplace_glas.posterior.closed_forms import ScalarPriorPosterior
from laplace_glas.posterior.diagonal_prior import DiagonalPriorPosterior, layer_grams

SIZES = [5, 4, 3]
D, K = sum(SIZES), 3
DTYPE = torch.float64


def _values(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    n = {"scalar": 1, "layerwise": len(SIZES), "diagonal": D}[kind]
    return 0.2 + 3 * torch.rand(n, generator=gen, dtype=DTYPE)


def _dense_diagonal(kind: str) -> torch.Tensor:
    values = _values(kind)
    if kind == "scalar":
        return values.expand(D).clone()
    if kind == "layerwise":
        return torch.cat([v.repeat(n) for v, n in zip(values, SIZES, strict=True)])
    return values


@pytest.fixture
def U() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.linalg.qr(torch.randn(D, K, generator=gen, dtype=DTYPE))[0]


KINDS = {"scalar": ScalarPrior, "layerwise": LayerwisePrior, "diagonal": DiagonalPrior}


@pytest.mark.parametrize("kind", list(KINDS))
def test_factory_picks_the_class_by_shape(kind):
    prior = Prior.of(_values(kind), SIZES)
    assert type(prior) is KINDS[kind]
    assert prior.n_params == D
    assert (prior.tau is not None) == (kind == "scalar")


def test_factory_takes_numbers_and_zero_dim_tensors():
    assert isinstance(Prior.of(2.0, SIZES), ScalarPrior)
    assert isinstance(Prior.of(torch.tensor(2.0), SIZES), ScalarPrior)
    assert float(Prior.of(2.0, SIZES).tau) == 2.0


def test_factory_prefers_diagonal_when_layers_are_weights():
    # one weight per parameter tensor: laplace-torch reads the values per weight
    prior = Prior.of(torch.ones(3, dtype=DTYPE), [1, 1, 1])
    assert isinstance(prior, DiagonalPrior)


@pytest.mark.parametrize("shape", [(2,), (D + 1,), (2, 2), (1, D)])
def test_factory_refuses_wrong_shapes(shape):
    with pytest.raises(ValueError, match="shape"):
        Prior.of(torch.ones(shape, dtype=DTYPE), SIZES)


@pytest.mark.parametrize(
    "values, match",
    [
        (torch.tensor([0.0]), "> 0"),
        (torch.tensor([-1.0]), "> 0"),
        (torch.tensor([1.0, 0.0, 2.0]), "> 0"),
        (-torch.ones(D), "> 0"),
        (torch.tensor([1.0, float("nan"), 2.0]), "finite"),
        (torch.tensor([float("inf")]), "finite"),
    ],
)
def test_factory_refuses_non_positive_or_non_finite_values(values, match):
    with pytest.raises(ValueError, match=match):
        Prior.of(values.to(DTYPE), SIZES)


def test_flat_scalar_prior_only_where_allowed():
    prior = Prior.of(0.0, SIZES, allow_flat=True)
    assert isinstance(prior, ScalarPrior)
    with pytest.raises(ValueError, match="needs a proper prior"):
        prior.log_det()
    with pytest.raises(ValueError, match=">= 0"):
        Prior.of(-1.0, SIZES, allow_flat=True)
    with pytest.raises(ValueError, match="> 0"):
        Prior.of(torch.tensor([0.0, 1.0, 1.0], dtype=DTYPE), SIZES, allow_flat=True)


def test_factory_refuses_integer_tensors():
    with pytest.raises(ValueError, match="floating point"):
        Prior.of(torch.tensor([1, 2, 3]), SIZES)


@pytest.mark.parametrize("kind", list(KINDS))
def test_diagonal_matches_the_expansion(kind):
    prior = Prior.of(_values(kind), SIZES)
    torch.testing.assert_close(prior.diagonal(), _dense_diagonal(kind), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_projected_grams_match_dense(kind, U):
    prior = Prior.of(_values(kind), SIZES)
    P0 = torch.diag(_dense_diagonal(kind))
    torch.testing.assert_close(prior.projected_gram(U), U.T @ P0 @ U)
    torch.testing.assert_close(prior.inverse_projected_gram(U), U.T @ torch.linalg.inv(P0) @ U)


def test_layerwise_grams_from_cached_blocks(U):
    prior = Prior.of(_values("layerwise"), SIZES)
    blocks = layer_grams(U, SIZES)
    torch.testing.assert_close(prior.projected_gram(U, blocks), prior.projected_gram(U))
    torch.testing.assert_close(
        prior.inverse_projected_gram(U, blocks), prior.inverse_projected_gram(U)
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_log_det_matches_dense(kind):
    prior = Prior.of(_values(kind), SIZES)
    torch.testing.assert_close(prior.log_det(), torch.logdet(torch.diag(_dense_diagonal(kind))))


@pytest.mark.parametrize("kind", list(KINDS))
def test_scatter_matches_dense_quadratic_form(kind):
    prior = Prior.of(_values(kind), SIZES)
    P0 = torch.diag(_dense_diagonal(kind))
    delta = torch.randn(4, D, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    torch.testing.assert_close(prior.scatter(delta[0]), delta[0] @ P0 @ delta[0])
    torch.testing.assert_close(prior.scatter(delta), ((delta @ P0) * delta).sum(-1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_complement_variance_matches_dense(kind, U):
    """``(I - U U^T) P_0^{-1} (I - U U^T)``: what the prior puts off ``span(U)``."""
    prior = Prior.of(_values(kind), SIZES)
    projector = torch.eye(D, dtype=DTYPE) - U @ U.T
    expected = projector @ torch.diag(1 / _dense_diagonal(kind)) @ projector
    operator = prior.complement_variance(U)
    torch.testing.assert_close(operator.to_dense(), expected)
    x = torch.randn(D, 2, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    torch.testing.assert_close(operator @ x, expected @ x)
    torch.testing.assert_close(operator.diagonal(), expected.diagonal())


@pytest.mark.parametrize("kind", list(KINDS))
def test_inverse_gram_matches_dense(kind):
    prior = Prior.of(_values(kind), SIZES)
    J = torch.randn(2, D, generator=torch.Generator().manual_seed(4), dtype=DTYPE)
    calls = []

    def gram(weights):
        calls.append(weights is None)
        return J @ J.T if weights is None else (J * weights) @ J.T

    expected = J @ torch.diag(1 / _dense_diagonal(kind)) @ J.T
    torch.testing.assert_close(prior.inverse_gram(gram), expected)
    assert calls == [kind == "scalar"]  # a scalar prior scales one unweighted Gram


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("complement", ["zero", "prior"])
def test_posterior_matches_dense(kind, complement, U):
    prior = Prior.of(_values(kind), SIZES)
    a = torch.tensor([4.0, 1.0, 0.0], dtype=DTYPE)
    post = prior.posterior(U, a, complement, lambda: layer_grams(U, SIZES))
    assert isinstance(post, ScalarPriorPosterior if kind == "scalar" else DiagonalPriorPosterior)
    P0 = torch.diag(_dense_diagonal(kind))
    if complement == "prior":
        precision = P0 + (U * a) @ U.T
        expected = torch.linalg.inv(precision)
        torch.testing.assert_close(post.log_det_posterior_precision, torch.logdet(precision))
    else:
        expected = U @ torch.linalg.inv(torch.diag(a) + U.T @ P0 @ U) @ U.T
    torch.testing.assert_close(post.covariance.to_dense(), expected)
    torch.testing.assert_close(
        post.log_det_ratio, torch.logdet(P0 + (U * a) @ U.T) - prior.log_det()
    )


def test_scalar_posterior_equals_diagonal_algebra_at_constant_p(U):
    """The closed forms and the Woodbury algebra agree for ``p = tau 1``."""
    a = torch.tensor([3.0, 0.5, 0.1], dtype=DTYPE)
    scalar = Prior.of(torch.tensor([0.7], dtype=DTYPE), SIZES)
    diagonal = Prior.of(torch.full((D,), 0.7, dtype=DTYPE), SIZES)
    delta = torch.randn(3, D, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    for complement in ("zero", "prior"):
        s = scalar.posterior(U, a, complement)
        d = diagonal.posterior(U, a, complement)
        torch.testing.assert_close(s.covariance.to_dense(), d.covariance.to_dense())
        torch.testing.assert_close(s.subspace_variances, d.subspace_variances)
        torch.testing.assert_close(s.square_norm(delta), d.square_norm(delta))
        torch.testing.assert_close(s.log_det_ratio, d.log_det_ratio)
        assert s.log_normaliser()[0] == d.log_normaliser()[0]
        torch.testing.assert_close(s.log_normaliser()[1], d.log_normaliser()[1])


@pytest.mark.parametrize("kind", ["layerwise", "diagonal"])
def test_embedded_directions_refuse_structured_priors(kind):
    with pytest.raises(ValueError, match="not implemented for Owner"):
        Prior.of(_values(kind), SIZES).check_embedded("Owner")
    Prior.of(_values("scalar"), SIZES).check_embedded("Owner")  # no error
