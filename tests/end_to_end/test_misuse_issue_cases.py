"""Misuse, second round: the issue's cases that had no test of their own (a subnetwork
state loaded into other weights, a grid search on NaN targets, refused prior tunings and
loads that must leave the posterior as it was, state fields of the wrong type).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401
from laplace_glas import (
    ActiveSubspaceLaplace,
    FittedWeightsChangedWarning,
    SubnetActiveSubspaceLaplace,
)


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.fixture(scope="module")
def train():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 1, generator=g)
    return DataLoader(TensorDataset(X, torch.sin(X)), batch_size=10)


def _subnet(model, train=None):
    la = SubnetActiveSubspaceLaplace(
        model, "regression", subnetwork_indices=torch.arange(0, 20), n_components=3
    )
    if train is not None:
        la.fit(train)
    return la


def _snapshot(la):
    return (la.prior_precision.clone(), la.H, la.loss, la.n_components, la.mean)


def _unchanged(la, before):
    assert torch.equal(la.prior_precision, before[0])
    assert la.H is before[1] and la.loss is before[2]
    assert la.n_components == before[3] and la.mean is before[4]


def test_a_subnetwork_state_loaded_into_other_weights_warns_at_prediction(train):
    state = _subnet(_mlp(), train).state_dict()
    x = torch.linspace(-1, 1, 3).reshape(-1, 1)
    same = _subnet(_mlp())
    same.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FittedWeightsChangedWarning)
        same(x, pred_type="glm")  # the weights it was fitted at: no warning
    moved = _mlp()
    with torch.no_grad():
        moved[0].weight.add_(0.5)  # inside the subnetwork (indices 0..19)
    other = _subnet(moved)
    other.load_state_dict(state)
    with pytest.warns(FittedWeightsChangedWarning, match="weights differ from those GLAS"):
        other(x, pred_type="glm")


def test_a_gridsearch_on_nan_targets_is_refused(train):
    la = ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    la.fit(train)
    X = next(iter(train))[0]
    nan = DataLoader(TensorDataset(X, torch.full((len(X), 1), math.nan)), batch_size=5)
    before = _snapshot(la)
    with pytest.raises(ValueError, match="contain NaN or inf: every prior precision"):
        la.optimize_prior_precision(method="gridsearch", val_loader=nan, pred_type="glm")
    _unchanged(la, before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "marglik", "prior_structure": "layerwise"}, "prior_structure='layerwise'"),
        ({"method": "marglik", "prior_structure": "diag"}, "prior_structure='diag'"),
        ({"method": "gridsearch", "prior_structure": "diag"}, "prior_structure='diag'"),
    ],
)
def test_a_subnetwork_refuses_structured_priors_before_any_change(train, kwargs, match):
    la = _subnet(_mlp(), train)
    before = _snapshot(la)
    if kwargs["method"] == "gridsearch":
        kwargs = {**kwargs, "val_loader": train, "pred_type": "glm"}
    with pytest.raises(ValueError, match=match + r" is not implemented for SubnetActive"):
        la.optimize_prior_precision(**kwargs)
    _unchanged(la, before)
    la(next(iter(train))[0], pred_type="glm")  # still predicts


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior_structure": "diag", "init_prior_prec": 0}, r"got min 0, max 0"),
        ({"prior_structure": "layerwise", "lr": 1e6, "n_steps": 50}, r"positive and finite"),
    ],
)
def test_a_refused_marglik_tuning_leaves_the_prior(train, kwargs, match):
    la = ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    la.fit(train)
    before = _snapshot(la)
    with pytest.raises(ValueError, match=match):
        la.optimize_prior_precision(method="marglik", **kwargs)
    _unchanged(la, before)


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("prior_mean", [0.0], TypeError, r"prior_mean must be a real number, got list"),
        ("prior_mean", torch.tensor([math.nan]), ValueError, r"prior_mean"),
        ("loss", "x", TypeError, r"state_dict\['loss'\] must be a real number, got 'x'"),
        ("loss", math.inf, ValueError, r"state_dict\['loss'\] is not finite"),
        ("sigma_noise", "a", ValueError, r"sigma_noise must be a real number, got 'a'"),
        ("temperature", [1], ValueError, r"temperature must be a real number, got list"),
        ("n_components", "3", ValueError, r"n_components'\] must be an int >= 1"),
        ("n_data", "40", ValueError, r"n_data'\] must be an int >= 1"),
        ("mean", [1.0], ValueError, r"mean'\] must be a floating-point tensor"),
        ("H", [1, 2], ValueError, r"H'\]\[0\] \(eigenvectors\) must be a floating-point"),
        ("prior_precision", "a", ValueError, r"prior_precision must be a real number"),
    ],
)
def test_a_state_field_of_the_wrong_type_is_refused_and_changes_nothing(
    train, key, value, error, match
):
    la = ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    la.fit(train)
    state = la.state_dict()
    state[key] = value
    before = _snapshot(la)
    with pytest.raises(error, match=match):
        la.load_state_dict(state)
    _unchanged(la, before)


def test_a_model_in_train_mode_is_left_in_train_mode_and_fits_as_in_eval_mode():
    """fit runs every pass in evaluation mode (dropout off) and gives the caller's modes
    back, as the README says; the eigenpairs are those of the evaluation-mode network."""
    import copy

    from laplace import Laplace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1)).double()
    X = torch.randn(40, 2, dtype=torch.float64)
    y = torch.randn(40, 1, dtype=torch.float64)
    batches = [(X[:20], y[:20]), (X[20:], y[20:])]
    fits = {}
    for mode in ("train", "eval"):
        network = copy.deepcopy(model).train(mode == "train")
        la = Laplace(network, "regression", subset_of_weights="all", hessian_structure="glas",
                     n_components=3)  # fmt: skip
        la.fit(batches)
        assert network.training == (mode == "train")
        la(X[:3], pred_type="glm")
        assert network.training == (mode == "train")
        fits[mode] = la.eigenvalues
    torch.testing.assert_close(fits["train"], fits["eval"])


def _small_fit(**kwargs):
    from laplace import Laplace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    X = torch.randn(48, 2, dtype=torch.float64)
    y = X[:, :1].sin()
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=3, **kwargs)  # fmt: skip
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    return la, X, y


def test_an_empty_grid_without_an_evidence_optimum_is_refused_by_name():
    from torch.nn.utils import parameters_to_vector

    torch.manual_seed(0)
    weights = parameters_to_vector(
        nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double().parameters()
    ).detach()
    la, X, y = _small_fit(prior_mean=weights)
    with pytest.raises(ValueError, match="no k has an empirical-Bayes optimum"):
        la.calibrate(DataLoader(TensorDataset(X, y), batch_size=16), prior_precisions=[])


def test_a_negative_definite_kron_factor_is_refused_on_load():
    la, *_ = _small_fit()
    assert la.complement == "kron"
    state = la.state_dict()
    state["ggn_kron"] = [list(block) for block in state["ggn_kron"]]
    state["ggn_kron"][0][0] = -state["ggn_kron"][0][0]
    before = la.posterior_covariance.to_dense()
    with pytest.raises(ValueError, match="negative eigenvalue"):
        la.load_state_dict(state)
    torch.testing.assert_close(la.posterior_covariance.to_dense(), before)


@pytest.mark.parametrize("complement", ["kron", "diag"])
def test_allclose_and_einsum_take_the_curvature_complements_operators(complement):
    la, *_ = _small_fit(complement=complement)
    sigma = la.posterior_covariance
    dense = sigma.to_dense()
    assert torch.allclose(sigma, dense) and torch.allclose(dense, sigma)
    assert torch.equal(la.posterior_precision, la.posterior_precision.to_dense())
    J = torch.randn(3, la.n_params, dtype=torch.float64)
    torch.testing.assert_close(torch.einsum("nd,de,me->nm", J, sigma, J), J @ dense @ J.T)
    with pytest.raises(TypeError):
        torch.exp(sigma)


def test_a_layer_frozen_after_construction_is_named_at_the_refit():
    la, X, y = _small_fit()
    before = la.eigenvalues.clone()
    la.model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias no longer require grad"):
        la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    torch.testing.assert_close(la.eigenvalues, before)  # the refused fit changed nothing


# ---------------------------------------------------------------- the second round's last
def _fitted_all(train, **options):
    la = ActiveSubspaceLaplace(_mlp(), "regression", n_components=3, **options)
    la.fit(train)
    return la


def test_a_subnetwork_prior_mean_of_the_whole_network_s_length_is_refused_by_name():
    """It passed the constructor (checked against the whole D) and broke the evidence
    with a shape error."""
    D = sum(p.numel() for p in _mlp().parameters())
    with pytest.raises(ValueError, match=r"prior_mean has 25 entries .* D_S=20 weights"):
        SubnetActiveSubspaceLaplace(_mlp(), "regression", subnetwork_indices=torch.arange(20),
                                    n_components=3, prior_mean=torch.zeros(D))  # fmt: skip
    la = SubnetActiveSubspaceLaplace(_mlp(), "regression", subnetwork_indices=torch.arange(20),
                                     n_components=3, prior_mean=torch.zeros(20))  # fmt: skip
    assert la.prior_mean.shape == (20,)


def test_grid_search_targets_of_shape_n_against_outputs_n_1_are_refused_by_name(train):
    la = _fitted_all(train)
    X = torch.cat([x for x, _ in train])
    flat = DataLoader(TensorDataset(X, torch.sin(X)[:, 0]), batch_size=10)
    before = la.prior_precision.clone()
    with pytest.raises(ValueError, match=r"targets have shape \(10,\).*shape \(N, 1\)"):
        la.optimize_prior_precision(method="gridsearch", val_loader=flat, grid_size=3)
    assert torch.equal(la.prior_precision, before)


def test_targets_given_as_a_python_list_are_refused_by_name():
    class OnIds(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

        def forward(self, batch):
            return self.head(self.emb(batch["input_ids"]).mean(1))

    ids, labels = torch.randint(0, 10, (20, 5)), torch.randint(0, 3, (20,))
    batches = [{"input_ids": ids[i : i + 10], "labels": labels[i : i + 10].tolist()}
               for i in (0, 10)]  # fmt: skip
    la = ActiveSubspaceLaplace(OnIds(), "classification", n_components=2)
    with pytest.raises(TypeError, match="targets under dict_key_y='labels' are a list"):
        la.fit(batches)


def test_a_loaded_enable_backprop_that_is_not_a_bool_is_refused_at_load(train):
    state = _fitted_all(train).state_dict()
    state["enable_backprop"] = "yes"
    other = ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    with pytest.raises(ValueError, match=r"state_dict\['enable_backprop'\].*True or False"):
        other.load_state_dict(state)
    assert not hasattr(other, "_eigenpairs") or other._eigenpairs is None


def test_last_layer_loads_of_a_list_or_of_a_whole_network_state_name_the_state():
    from laplace import Laplace

    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 1, generator=g)
    data = DataLoader(TensorDataset(X, torch.sin(X)), batch_size=10)
    whole = Laplace(_mlp(), "regression", subset_of_weights="all", hessian_structure="glas",
                    n_components=3)  # fmt: skip
    whole.fit(data)
    last = Laplace(_mlp(), "regression", subset_of_weights="last_layer",
                   hessian_structure="glas", n_components=3)  # fmt: skip
    with pytest.raises(ValueError, match="A GLAS state dict is a mapping, got list"):
        last.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="of a 'ActiveSubspaceLaplace', not of a 'LastLayer"):
        last.load_state_dict(whole.state_dict())
