"""``la.posterior``: the read-only view of a fitted posterior, against the object's own
public answers and a dense reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fit_glas, loader, mlp, regression_data, train

from laplace_glas import NotFittedError, SubnetActiveSubspaceLaplace
from laplace_glas.posterior.view import FittedPosterior
from laplace_glas.validation import ArgumentTypeError


@pytest.fixture(scope="module")
def fitted():
    X, y = regression_data(60)
    model = train(mlp([1, 8, 1], dtype=torch.float64), X.double(), y.double(), steps=100)
    return fit_glas(model, X.double(), y.double(), n_components=6, loss_scaling="sum"), X.double()


def test_the_view_is_frozen_and_agrees_with_the_public_properties(fitted):
    la, _ = fitted
    view = la.posterior
    assert isinstance(view, FittedPosterior)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.n_components = 2  # type: ignore[misc]
    k = la.n_components
    assert view.n_computed == la.lanczos_info.k == 6
    torch.testing.assert_close(view.eigenvectors[:, :k], la.eigenvectors)
    torch.testing.assert_close(view.ggn_eigenvalues[:k], la.eigenvalues)
    torch.testing.assert_close(view.curvature[:k], la.subspace_curvature)
    # a_j = s lambda_j / T with s = N (loss_scaling='sum'), T = 1
    torch.testing.assert_close(view.curvature, la.n_data * view.ggn_eigenvalues)
    assert view.scaling_factor == la.n_data
    assert view.tau == pytest.approx(float(la.prior_precision))
    assert view.dtype == torch.float64 and view.device == torch.device("cpu")
    assert view.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert sum(s.numel() for s in view.param_shapes) == la.n_params
    assert view.eigen_solve is la.lanczos_info
    torch.testing.assert_close(view.network_weights, la.mean)


def test_the_view_is_a_snapshot(fitted):
    la, _ = fitted
    before = la.posterior
    old = la.prior_precision.clone()
    try:
        la.prior_precision = 3.0
        assert la.posterior.tau == 3.0
        assert before.tau == pytest.approx(float(old))
    finally:
        la.prior_precision = old


def test_the_view_holds_every_computed_pair_after_truncation(fitted):
    la, _ = fitted
    la.n_components = 2
    try:
        view = la.posterior
        assert view.n_components == 2 and view.n_computed == 6
        torch.testing.assert_close(view.network_directions(5), la.lanczos_info.vectors[:, :5])
        assert view.check_k(6) == 6
        with pytest.raises(ValueError, match=r"k must lie in \[1, 6\]"):
            view.check_k(7)
        with pytest.raises(ArgumentTypeError, match="k must be an int"):
            view.check_k(2.5)
    finally:
        la.n_components = 6


def test_glm_moments_of_the_view_are_the_predictive(fitted):
    la, X = fitted
    f_mu, f_var, _ = la.posterior.glm_moments(X[:5])
    mean, var = la(X[:5], pred_type="glm")
    torch.testing.assert_close(f_mu.reshape(mean.shape), mean)
    torch.testing.assert_close(f_var.reshape(var.shape), var)


def test_the_view_refuses_before_fit():
    from laplace import Laplace

    la = Laplace(mlp([1, 4, 1]), "regression", "all", "glas", n_components=2)
    with pytest.raises(NotFittedError, match="not fitted"):
        la.posterior  # noqa: B018


def test_a_subnetwork_view_embeds_its_directions_and_draws():
    X, y = regression_data(50)
    model = train(mlp([1, 6, 1]), X, y, steps=50)
    indices = torch.tensor([0, 3, 7, 12, 15])
    la = SubnetActiveSubspaceLaplace(model, "regression", indices, n_components=3)
    la.fit(loader(X, y))
    view = la.posterior
    D_net = sum(p.numel() for p in model.parameters())
    V = view.network_directions(3)
    assert V.shape == (D_net, 3)
    # the embedding puts the subnetwork's eigenvectors at its indices, zeros elsewhere
    torch.testing.assert_close(V[indices], view.eigenvectors)
    outside = torch.ones(D_net, dtype=torch.bool)
    outside[indices] = False
    assert torch.all(V[outside] == 0)
    draws = torch.randn(4, len(indices))
    embedded = view.embed_weight_draws(draws)
    torch.testing.assert_close(embedded[:, indices], draws)
    assert view.network_weights.shape == (D_net,)
