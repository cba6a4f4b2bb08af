"""likelihood='reward_modeling' as laplace-torch defines it.

Training batches are preference pairs: inputs ``(B, 2, d)`` on which the model returns
the pair's two rewards ``(B, 2)`` as logits, targets the preferred index; the curvature
and the training loss are the classification ones (Bradley-Terry). Predictions on
individual inputs ``(B, d)`` are a regression of the reward ``(B, 1)``, and a
classification over a pair with ``fitting=True``. Compared with laplace-torch's
``FullLaplace(likelihood='reward_modeling')`` in the ``k >= rank`` limit, whose ``H``
is replaced by the exact GGN from ``torch.func`` Jacobians for the tight comparisons.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import pairwise_probit
from laplace import Laplace
from test_subsets import exact_H
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from laplace_glas import ActiveSubspaceLaplace

TAU = 0.7


class Reward(nn.Module):
    """Pairs ``(B, 2, d)`` -> ``(B, 2)`` logits; single inputs ``(B, d)`` -> ``(B, 1)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x):
        if isinstance(x, dict):
            x = x["pairs"]
        if x.ndim == 3:
            return self.net(x).squeeze(-1)
        return self.net(x)


class Pairs(Dataset):
    def __init__(self, X, y):
        self.X, self.y = X, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pairs": self.X[i], "pref": self.y[i]}


def data():
    g = torch.Generator().manual_seed(4)
    X = torch.randn(5, 2, 3, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1])
    Xtest = torch.randn(3, 3, generator=g, dtype=torch.float64)
    return X, y, Xtest


def fitted_pair(loss_scaling, dict_batches=False):
    model = Reward().double()  # D = 21; rank(G) <= 5 pairs
    X, y, Xtest = data()
    keys = {"dict_key_x": "pairs", "dict_key_y": "pref"} if dict_batches else {}
    dl = DataLoader(Pairs(X, y) if dict_batches else TensorDataset(X, y), batch_size=2)
    glas = Laplace(
        model,
        "reward_modeling",
        "all",
        "glas",
        prior_precision=TAU,
        n_components=8,
        complement="prior",
        loss_scaling=loss_scaling,
        **keys,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # null-space eigenvalues are flagged
        glas.fit(dl)
    temperature = float(len(y)) if loss_scaling == "mean" else 1.0
    full = Laplace(
        model,
        "reward_modeling",
        "all",
        "full",
        prior_precision=TAU,
        temperature=temperature,
        **keys,
    )
    full.fit(dl)
    as_fitted = full.log_marginal_likelihood().detach()
    D = sum(p.numel() for p in model.parameters())
    full.H = exact_H(model, X, "classification", torch.arange(D))
    return glas, full, Xtest, X, as_fitted


@pytest.mark.parametrize("dict_batches", [False, True])
@pytest.mark.parametrize("loss_scaling", ["sum", "mean"])
def test_reward_modeling_equals_full_laplace_at_full_rank(loss_scaling, dict_batches):
    glas, full, Xtest, X, as_fitted = fitted_pair(loss_scaling, dict_batches)
    assert glas.likelihood == "reward_modeling"
    assert glas.lanczos_info.operator == "jacobian"  # classification curvature (stored)
    torch.testing.assert_close(glas.log_marginal_likelihood(), as_fitted, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-9, atol=0
    )
    torch.testing.assert_close(
        glas.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-6, atol=1e-12
    )
    x = {"pairs": Xtest} if dict_batches else Xtest
    f_mu, f_var = glas(x)  # individual rewards: regression
    ref_mu, ref_var = full(x, pred_type="glm")
    assert f_mu.shape == (3, 1) and f_var.shape == (3, 1, 1)
    torch.testing.assert_close(f_mu, ref_mu, rtol=1e-10, atol=0)
    torch.testing.assert_close(f_var, ref_var, rtol=1e-6, atol=1e-12)
    pairs = {"pairs": X[:3]} if dict_batches else X[:3]
    torch.testing.assert_close(  # preference pairs while fitting: classification
        glas(pairs, fitting=True),
        pairwise_probit(*full._glm_predictive_distribution(pairs)),
        rtol=1e-6,
        atol=1e-12,
    )


def test_reward_nn_predictive_is_a_regression_of_the_reward():
    glas, _, Xtest, X, _ = fitted_pair("sum")
    mean, var = glas(Xtest, pred_type="nn", link_approx="mc", n_samples=20)
    assert mean.shape == (3, 1) and var.shape == (3, 1) and (var >= 0).all()
    probs = glas(X[:3], pred_type="nn", link_approx="mc", n_samples=20, fitting=True)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))


def test_reward_modeling_needs_unit_noise_and_refuses_calibration():
    with pytest.raises(ValueError, match="reward_modeling needs sigma_noise=1"):
        ActiveSubspaceLaplace(Reward(), "reward_modeling", sigma_noise=0.5, n_components=2)
    glas, *_ = fitted_pair("sum")
    X, y, _ = data()
    with pytest.raises(ValueError, match="likelihood='reward_modeling' has none to cover"):
        glas.calibrate(DataLoader(TensorDataset(X, y), batch_size=2))
