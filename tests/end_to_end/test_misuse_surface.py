"""Misuse, second round: the cases an adversarial pass over the public surface found
(diagnostics given other objects, float64 data for a float32 model, non-tensor
arguments, empty plot inputs). Each must be a named error from laplace_glas.
"""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas as G
from laplace_glas import plotting

matplotlib.use("Agg")


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1))


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 2, generator=g)
    return X, torch.sin(X.sum(1, keepdim=True))


@pytest.fixture(scope="module")
def train(data):
    return DataLoader(TensorDataset(*data), batch_size=10)


@pytest.fixture(scope="module")
def fitted(train):
    la = G.ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    la.fit(train)
    return la


@pytest.fixture(scope="module")
def kron(train):
    la = Laplace(_mlp(), "regression", subset_of_weights="all", hessian_structure="kron")
    la.fit(train)
    return la


DIAGNOSTICS = {
    "activity_scores": lambda la, dl, X: G.activity_scores(la),
    "per_parameter": lambda la, dl, X: G.per_parameter(la, torch.zeros(3)),
    "alignment": lambda la, dl, X: G.alignment(la, X[:4]),
    "coverage": lambda la, dl, X: G.coverage(la, dl, n_samples=5),
    "interval_width": lambda la, dl, X: G.interval_width(la, dl, n_samples=5),
    "select_dimension": lambda la, dl, X: G.select_dimension(la, dl, n_samples=5),
    "residual_report": lambda la, dl, X: G.residual_report(la),
    "replica_check": lambda la, dl, X: G.replica_check(la, dl, n_replicas=1),
}


@pytest.mark.parametrize("name", DIAGNOSTICS)
@pytest.mark.parametrize("other", ["kron", None, "a string"])
def test_diagnostics_given_another_object_name_it(kron, train, data, name, other):
    la = kron if other == "kron" else other
    expected = "KronLaplace" if other == "kron" else type(other).__name__
    with pytest.raises(TypeError, match=rf"needs a fitted GLAS posterior .*got {expected}\."):
        DIAGNOSTICS[name](la, train, data[0])


@pytest.mark.parametrize("name", DIAGNOSTICS)
def test_diagnostics_of_an_unfitted_posterior_say_so(train, data, name):
    la = G.ActiveSubspaceLaplace(_mlp(), "regression", n_components=3)
    with pytest.raises(G.NotFittedError, match="is not fitted yet"):
        DIAGNOSTICS[name](la, train, data[0])


@pytest.mark.parametrize("cls", [G.ActiveSubspaceLaplace, G.LastLayerActiveSubspaceLaplace])
def test_float64_data_for_a_float32_model_is_named_at_fit(data, cls):
    la = cls(_mlp(), "regression", n_components=3)
    train64 = DataLoader(TensorDataset(*(t.double() for t in data)), batch_size=10)
    with pytest.raises(TypeError, match=r"inputs of batch 0 are float64 but the model's "):
        la.fit(train64)
    assert getattr(la, "_eigenpairs", None) is None


@pytest.mark.parametrize("entry", ["coverage", "calibrate"])
def test_float64_data_for_a_float32_model_is_named_in_calibration(fitted, data, entry):
    calib64 = DataLoader(TensorDataset(*(t.double() for t in data)), batch_size=10)
    before = fitted.prior_precision.clone()
    with pytest.raises(TypeError, match=r"The calibration inputs of batch 0 are float64"):
        if entry == "coverage":
            G.coverage(fitted, calib64, n_samples=5)
        else:
            fitted.calibrate(calib64, n_samples=5)
    assert torch.equal(fitted.prior_precision, before)


@pytest.mark.parametrize(
    ("curvature", "error", "match"),
    [
        ("a", TypeError, r"curvature must be a 1-d array or tensor of numbers, got 'a'"),
        (torch.tensor([1.0, math.nan]), ValueError, r"1 non-finite entries"),
        (torch.tensor([-1.0, 2.0]), ValueError, r"curvature must be >= 0"),
        (torch.ones(2, 2), ValueError, r"finite 1-d array \(k,\), got shape \(2, 2\)"),
    ],
)
def test_optimal_prior_precision_refuses_bad_curvatures(curvature, error, match):
    with pytest.raises(error, match=match):
        G.optimal_prior_precision(curvature, 1.0)


def test_optimal_prior_precision_drops_rounding_below_zero():
    a = torch.tensor([2.0, 1.0, -1e-12], dtype=torch.float64)
    tau = G.optimal_prior_precision(a, 0.5)
    # the stationarity condition tau m = sum_j a_j / (a_j + tau) over the positive a_j
    assert abs(tau * 0.5 - sum(x / (x + tau) for x in (2.0, 1.0))) < 1e-10


def test_compute_eigenpairs_of_a_non_operator():
    with pytest.raises(TypeError, match=r"operator must be a square linear operator"):
        G.compute_eigenpairs("a", 2)


@pytest.mark.parametrize("bad", ["x", None, [1.0, 2.0]])
def test_activity_functions_name_non_tensor_scores(fitted, bad):
    for call in (
        lambda: G.per_parameter(fitted, bad),
        lambda: G.cumulative_activity(bad),
        lambda: G.weights_for_share(bad),
    ):
        with pytest.raises(TypeError, match=r"scores must be a torch.Tensor, got"):
            call()


@pytest.mark.parametrize("share", [None, "0.9", True, math.nan, 0, 1.5])
def test_weights_for_share_names_the_share(share):
    with pytest.raises(ValueError, match=r"share must be a number in \(0, 1\]"):
        G.weights_for_share(torch.rand(5), share=share)


@pytest.mark.parametrize("x", ["x", [1, 2]])
def test_alignment_of_non_tensor_inputs(fitted, x):
    with pytest.raises(TypeError, match=r"x must be a tensor of inputs \(batch, \.\.\.\)"):
        G.alignment(fitted, x)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": "a"}, r"threshold must be a real number, got 'a'"),
        ({"seed": "a"}, r"seed must be an int or None, got str"),
        ({"n_replicas": 2.5}, r"n_replicas must be a positive int, got 2.5"),
    ],
)
def test_replica_check_arguments_of_the_wrong_type(fitted, train, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        G.replica_check(fitted, train, **kwargs)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: plotting.plot_cumulative_activity({}), ValueError, r"scores is empty"),
        (lambda: plotting.plot_cumulative_activity([1]), TypeError, r"entry 'activity' is list"),
        (lambda: plotting.plot_coverage_vs_k({}), ValueError, r"selections is empty"),
        (lambda: plotting.plot_coverage_vs_k({"a": 1}), TypeError, r"entry 'a' is int"),
        (lambda: plotting.plot_alignment({}), ValueError, r"alignments is empty"),
        (lambda: plotting.plot_alignment({"a": 1}), TypeError, r"entry 'a' is int"),
        (
            lambda: plotting.plot_predictive_band(*(torch.rand(n) for n in (5, 4, 5, 5))),
            ValueError,
            r"the same number of points; got x: \(5,\), mean: \(4,\)",
        ),
        (
            lambda: plotting.plot_predictive_band(*(torch.rand(5),) * 4, level=2),
            ValueError,
            r"level must be a number in \(0, 1\), got 2",
        ),
    ],
)
def test_plots_name_empty_or_mistyped_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
