"""Activity scores, per-layer totals and cumulative shares."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import loader, mlp, regression_data, train
from laplace import Laplace

from laplace_glas import activity_scores, cumulative_activity, per_parameter, weights_for_share


def fit(model, X, y, k=6, **kw):
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=0.1,
        n_components=k,
        **kw,
    )
    la.fit(loader(X, y))
    return la


@pytest.fixture(scope="module")
def setup():
    X, y = regression_data(80, dtype=torch.float64, seed=2)
    model = train(mlp([1, 8, 8, 1], dtype=torch.float64), X, y, steps=300)
    return model, X, y, fit(model, X, y)


@pytest.mark.parametrize("weighting", ["eigenvalue", "posterior", "variance"])
def test_scores_sum_to_weights(setup, weighting):
    *_, la = setup
    scores = activity_scores(la, weighting=weighting)
    assert scores.shape == (la.n_params,) and (scores >= 0).all()
    if weighting == "eigenvalue":
        w = la.eigenvalues
    elif weighting == "posterior":
        w = la.subspace_curvature * la.posterior_variances
    else:  # the posterior in use ('auto' -> 'kron'): the trace of its covariance
        assert la.complement == "kron"
        w = torch.diagonal(la.posterior_covariance.to_dense())
    torch.testing.assert_close(scores.sum(), w.sum())


def test_eigenvalue_scores_equal_ggn_diagonal_restricted_to_subspace(setup):
    """alpha_i = sum_j lambda_j u_ij^2 = diag(U diag(lambda) U^T), checked densely."""
    *_, la = setup
    U, lam = la.eigenvectors, la.eigenvalues
    torch.testing.assert_close(activity_scores(la), torch.diagonal((U * lam) @ U.T))


def test_permuting_hidden_units_permutes_scores(setup):
    model, X, y, la = setup
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    permuted = copy.deepcopy(model)
    with torch.no_grad():
        permuted[0].weight.copy_(model[0].weight[perm])
        permuted[0].bias.copy_(model[0].bias[perm])
        permuted[2].weight.copy_(model[2].weight[:, perm])
    torch.testing.assert_close(permuted(X), model(X))
    la_p = fit(permuted, X, y)
    # index map: flat position of each parameter of the permuted model in the original
    index = torch.arange(la.n_params)
    w0 = index[:8].reshape(8, 1)[perm].reshape(-1)
    b0 = index[8:16][perm]
    w2 = index[16:80].reshape(8, 8)[:, perm].reshape(-1)
    mapping = torch.cat([w0, b0, w2, index[80:]])
    torch.testing.assert_close(
        activity_scores(la_p), activity_scores(la)[mapping], rtol=1e-7, atol=1e-10
    )


def test_per_parameter_totals_add_up(setup):
    *_, la = setup
    scores = activity_scores(la)
    totals = per_parameter(la, scores)
    assert list(totals) == [n for n, _ in la.model.named_parameters()]
    assert sum(totals.values()) == pytest.approx(float(scores.sum()), rel=1e-12)
    assert totals["0.weight"] == pytest.approx(float(scores[:8].sum()), rel=1e-12)
    with pytest.raises(ValueError, match="shape"):
        per_parameter(la, scores[:-1])


def test_cumulative_share_and_weights_for_share():
    scores = torch.tensor([1.0, 5.0, 0.0, 3.0, 1.0])
    n, share = cumulative_activity(scores)
    assert n.tolist() == [1, 2, 3, 4, 5]
    torch.testing.assert_close(share, torch.tensor([0.5, 0.8, 0.9, 1.0, 1.0], dtype=torch.float64))
    assert weights_for_share(scores, 0.8) == (2, 0.4)
    assert weights_for_share(scores, 0.81) == (3, 0.6)
    assert weights_for_share(scores, 1.0) == (4, 0.8)
    with pytest.raises(ValueError):
        weights_for_share(scores, 0.0)
    with pytest.raises(ValueError):
        cumulative_activity(torch.zeros(3))


def test_bad_arguments(setup):
    *_, la = setup
    with pytest.raises(ValueError, match="weighting"):
        activity_scores(la, weighting="gradient")
    with pytest.raises(ValueError, match="k must lie"):
        activity_scores(la, k=7)


def test_share_is_summed_in_float64_so_all_nonzero_weights_are_counted():
    """float32 scores: the total was summed in float32, the cumulative share went past 1
    and weights_for_share(…, 1.0) stopped ~10 weights short of the 50,000 non-zero ones."""
    scores = torch.rand(100_000, generator=torch.Generator().manual_seed(0))
    scores[50_000:] = 0
    _, share = cumulative_activity(scores)
    assert float(share.max()) <= 1.0
    assert weights_for_share(scores, 1.0) == (50_000, 0.5)


def test_subnetwork_totals_land_on_the_tensors_of_its_weights():
    from laplace_glas import SubnetActiveSubspaceLaplace

    X, y = regression_data(40)
    model = train(mlp([1, 6, 1]), X, y, steps=50)
    # D = 6 + 6 + 6 + 1 = 19; the subnetwork is the last layer's weights and bias
    indices = torch.arange(12, 19)
    la = SubnetActiveSubspaceLaplace(model, "regression", indices, n_components=3)
    la.fit(loader(X, y))
    scores = activity_scores(la)
    totals = per_parameter(la, scores)
    assert totals["0.weight"] == 0.0 and totals["0.bias"] == 0.0
    assert totals["2.weight"] + totals["2.bias"] == pytest.approx(float(scores.sum()))
    assert totals["2.bias"] == pytest.approx(float(scores[-1]))


def test_activity_scores_refuse_a_fractional_k_and_other_posteriors(toy_regression):

    from laplace_glas.validation import ArgumentTypeError

    model, X, y = toy_regression
    la = fit(model, X, y)
    with pytest.raises(ArgumentTypeError, match="k must be an int"):
        activity_scores(la, k=2.5)
    kron = Laplace(model, "regression", subset_of_weights="all", hessian_structure="kron")
    kron.fit(loader(X, y))
    with pytest.raises(TypeError, match="activity_scores needs a fitted GLAS posterior"):
        activity_scores(kron)
    with pytest.raises(TypeError, match="per_parameter needs a fitted GLAS posterior"):
        per_parameter(kron, torch.zeros(kron.n_params))
