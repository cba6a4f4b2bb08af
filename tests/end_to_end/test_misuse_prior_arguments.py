"""Misuse, second round: non-numeric prior precisions given to ``calibrate`` and the
grid search, and a model moved to the 'meta' device after construction. Each is a
named error before any work, and the posterior is left as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401
from laplace_glas.validation import ArgumentTypeError


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g)
    y = torch.sin(X.sum(1, keepdim=True))
    return DataLoader(TensorDataset(X, y), batch_size=10)


def _fitted(loader):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.n_components = 3
    la.fit(loader)
    return la


def _state(la):
    return (la.prior_precision.clone(), la.n_components, la.H[0].clone(), la.H[1].clone())


def _same(a, b):
    return all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("prior_precisions", "message"),
    [
        ("a", r"prior_precisions must be a sequence of positive numbers or a 1-d tensor, got str"),
        (3.0, r"prior_precisions must be a sequence .* got float \(3\.0\)"),
        (["a", "b"], r"prior_precisions\[0\] must be a real number, got 'a'"),
        ([1.0, None], r"prior_precisions\[1\] must be a real number, got NoneType"),
        (torch.ones(2, 2), r"1-d tensor, got a tensor of shape \(2, 2\)"),
        (torch.tensor([1.0 + 1j]), r"prior_precisions\[0\] must be a real number"),
        ([True], r"prior_precisions\[0\] must be a real number, got True"),
    ],
)
def test_calibrate_refuses_non_numeric_prior_precisions(data, prior_precisions, message):
    la = _fitted(data)
    before = _state(la)
    with pytest.raises(ArgumentTypeError, match=message):
        la.calibrate(data, ks=[2, 3], prior_precisions=prior_precisions, n_samples=10)
    assert _same(before, _state(la))


def test_calibrate_takes_a_1d_tensor_of_either_dtype(data):
    la = _fitted(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = la.calibrate(data, ks=[3], prior_precisions=torch.tensor([2.0, 5.0]), n_samples=10)
        b = la.calibrate(
            data, ks=[3], prior_precisions=torch.tensor([2, 5], dtype=torch.int64), n_samples=10
        )
    assert [r.prior_precision for r in a.rows] == [r.prior_precision for r in b.rows]
    assert {2.0, 5.0} <= {r.prior_precision for r in a.rows}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"log_prior_prec_min": "a"}, r"log_prior_prec_min must be a real number, got 'a'"),
        ({"log_prior_prec_max": None}, r"log_prior_prec_max must be a real number"),
        ({"loss": "mse"}, r"loss must be a torchmetrics.Metric or a callable"),
    ],
)
def test_gridsearch_refuses_non_numeric_bounds_and_loss(data, kwargs, message):
    la = _fitted(data)
    before = _state(la)
    with pytest.raises(ArgumentTypeError, match=message):
        la.optimize_prior_precision(
            method="gridsearch", val_loader=data, pred_type="glm", grid_size=3, **kwargs
        )
    assert _same(before, _state(la))


def test_a_model_moved_to_meta_after_construction_is_refused_at_fit(data):
    la = _fitted(data)
    before = _state(la)
    la.model.to("meta")
    with pytest.raises(ValueError, match=r"are on the 'meta' device \(shapes without values\)"):
        la.fit(data)
    assert _same(before, _state(la))
