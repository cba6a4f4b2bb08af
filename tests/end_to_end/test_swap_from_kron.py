"""laplace-torch's README loops with ``hessian_structure='glas'`` in place of ``'kron'``.

The three loops of laplace-torch's README (the prior alone through
``optimize_prior_precision``, the prior and the noise together through
``log_marginal_likelihood(prior_prec, sigma)`` and an optimiser, a grid search on
validation data) run on the same data and model with ``'full'`` (the reference),
``'kron'`` and GLAS:

* with ``loss_scaling='sum'`` and ``k`` at the GGN's rank (``complement='prior'``: the
  prior is the posterior in the GGN's null space), GLAS *is* the full Laplace posterior,
  so each loop ends where ``'full'`` ends;
* the documented like-for-like swap (``loss_scaling='sum', complement='diag'``, default
  ``k``) gives a noise level and variances close to ``'full'``'s;
* the defaults (``loss_scaling='sum'``, ``complement='auto'``: ``'kron'`` on this MLP)
  are a like-for-like swap too: no warning, full's noise level, comparable variances;
* mean scaling (GLAS's generalised posterior, laplace-torch at temperature ``N``) warns
  in the noise loop, where its sigma comes out ``sqrt(N)`` times too small.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import loader, mlp, pairwise_probit, regression_data, train
from laplace import Laplace

from laplace_glas.curvature.solvers.eigenpairs import NumericalRankWarning

DT = torch.float64
X_TEST = torch.tensor([[0.3], [-1.1], [2.5]], dtype=DT)
EXACT = {"hessian_structure": "glas", "loss_scaling": "sum", "complement": "prior"}
SWAP = {"hessian_structure": "glas", "loss_scaling": "sum", "complement": "diag"}
MEAN = {"hessian_structure": "glas", "loss_scaling": "mean", "complement": "zero"}


@pytest.fixture(scope="module", autouse=True)
def float64_default():
    """laplace-torch's FullLaplace builds H through float32 temporaries under a float32
    default dtype (1e-7 off the float64 J^T J); under float64 it is exact to 1e-15."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    yield
    torch.set_default_dtype(before)


def regression_problem(n):
    X, y = regression_data(n, dtype=DT, seed=3)
    return train(mlp([1, 8, 1], dtype=DT), X, y, steps=500), X, y  # D = 25


@pytest.fixture(scope="module")
def few():
    """N = 10 points: the regression GGN has rank 10 < D = 25."""
    return regression_problem(10)


@pytest.fixture(scope="module")
def many():
    return regression_problem(200)


def fitted(problem, likelihood="regression", **structure):
    model, X, y = problem
    la = Laplace(model, likelihood, subset_of_weights="all", **structure)
    la.fit(loader(X, y))
    return la


def prior_only(problem, **structure):
    """README loop 1: ``optimize_prior_precision()``, then a 'glm' predictive."""
    la = fitted(problem, **structure)
    la.optimize_prior_precision(method="marglik", n_steps=1000)
    _, f_var = la(X_TEST, pred_type="glm")
    return float(la.prior_precision), f_var.flatten()


def prior_and_noise(problem, steps=300, **structure):
    """README loop 2: Adam on ``-log_marginal_likelihood(prior_prec, sigma)``."""
    la = fitted(problem, **structure)
    log_prior = torch.zeros(1, dtype=DT, requires_grad=True)
    log_sigma = torch.zeros(1, dtype=DT, requires_grad=True)
    optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(steps):
        optimizer.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        optimizer.step()
    la.prior_precision, la.sigma_noise = log_prior.exp().detach(), log_sigma.exp().detach()
    _, f_var = la(X_TEST, pred_type="glm")
    return float(la.prior_precision), float(la.sigma_noise), f_var.flatten()


def gridsearch(problem, **structure):
    """README loop 3: the prior on a validation loader (here outside the training range)."""
    la = fitted(problem, **structure)
    g = torch.Generator().manual_seed(5)
    X_val = 1.8 + torch.rand(40, 1, generator=g, dtype=DT)
    y_val = torch.sin(3 * X_val) + 0.1 * torch.randn(40, 1, generator=g, dtype=DT)
    la.optimize_prior_precision(
        method="gridsearch", val_loader=loader(X_val, y_val), pred_type="glm", grid_size=21
    )
    return float(la.prior_precision)


def no_warning_on_sigma():
    """Inside ``warnings.catch_warnings()``: any UserWarning fails, except the GGN's
    numerical rank (the 1-8-1 net's GGN has rank 17 of D = 25)."""
    warnings.simplefilter("error", UserWarning)
    warnings.filterwarnings("ignore", category=NumericalRankWarning)


# ------------------------------------------------ GLAS 'sum' at the GGN's rank is 'full'
def test_prior_only_loop_at_the_ggn_rank_ends_where_full_ends(few):
    full_prior, full_var = prior_only(few, hessian_structure="full")
    prior, var = prior_only(few, n_components=10, **EXACT)
    assert prior == pytest.approx(full_prior, rel=1e-3)
    torch.testing.assert_close(var, full_var, rtol=1e-3, atol=0)


def test_prior_and_noise_loop_at_the_ggn_rank_ends_where_full_ends(few):
    full_prior, full_sigma, full_var = prior_and_noise(few, hessian_structure="full")
    with warnings.catch_warnings():
        no_warning_on_sigma()  # 'sum' is a likelihood in sigma
        prior, sigma, var = prior_and_noise(few, n_components=10, **EXACT)
    assert (prior, sigma) == pytest.approx((full_prior, full_sigma), rel=1e-6)
    torch.testing.assert_close(var, full_var, rtol=1e-6, atol=0)
    full, glas = fitted(few, hessian_structure="full"), fitted(few, n_components=10, **EXACT)
    for p, s in [(0.1, 0.05), (1.0, 0.3), (30.0, 2.0)]:
        p, s = torch.tensor(p, dtype=DT), torch.tensor(s, dtype=DT)
        assert float(glas.log_marginal_likelihood(p, s)) == pytest.approx(
            float(full.log_marginal_likelihood(p, s)), rel=1e-9
        )


def test_gridsearch_at_the_ggn_rank_picks_fulls_prior(few):
    assert gridsearch(few, n_components=10, **EXACT) == gridsearch(few, hessian_structure="full")


def test_classification_probit_at_the_ggn_rank_is_fulls():
    """Softmax GGN of N = 8 points on 3 classes: rank <= N (C - 1) = 16 < D = 99."""
    g = torch.Generator().manual_seed(1)
    centers = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]], dtype=DT)
    y = torch.arange(3).repeat_interleave(40)
    X = centers[y] + 0.8 * torch.randn(120, 2, generator=g, dtype=DT)
    model = train(mlp([2, 16, 3], dtype=DT), X, y, steps=300, classification=True)
    few_points = (model, X[::15], y[::15])
    x = torch.tensor([[0.0, 2.0], [0.0, -0.5], [4.0, 4.0]], dtype=DT)
    probs = []
    for structure in ({"hessian_structure": "full"}, {"n_components": 16, **EXACT}):
        la = fitted(few_points, "classification", **structure)
        la.optimize_prior_precision(method="marglik", n_steps=1000)
        if structure.get("hessian_structure") == "full":  # GLAS's probit: differences
            prob = pairwise_probit(*la._glm_predictive_distribution(x))
        else:
            prob = la(x, pred_type="glm", link_approx="probit")
        probs.append((float(la.prior_precision), prob))
    assert probs[1][0] == pytest.approx(probs[0][0], rel=1e-3)
    torch.testing.assert_close(probs[1][1], probs[0][1], rtol=1e-3, atol=1e-4)


# ------------------------------------------- the documented swap on N = 200 (k = 20 of 25)
def test_documented_swap_gives_fulls_noise_level_and_comparable_variances(many):
    _, full_sigma, full_var = prior_and_noise(many, hessian_structure="full")
    _, kron_sigma, _ = prior_and_noise(many, hessian_structure="kron")
    with warnings.catch_warnings():
        no_warning_on_sigma()
        _, sigma, var = prior_and_noise(many, **SWAP)
    assert sigma == pytest.approx(full_sigma, rel=0.05)
    assert sigma == pytest.approx(kron_sigma, rel=0.05)
    ratio = var / full_var
    assert bool(((ratio > 0.5) & (ratio < 2)).all()), ratio
    full_prior, full_var = prior_only(many, hessian_structure="full")
    prior, var = prior_only(many, **SWAP)
    assert full_prior / 2 < prior < 2 * full_prior
    ratio = var / full_var
    assert bool(((ratio > 0.5) & (ratio < 2)).all()), ratio


def test_the_defaults_are_a_like_for_like_swap(many):
    """The defaults (sum scaling, 'auto' -> 'kron' here) in laplace-torch's noise loop:
    no warning, full's noise level, variances within a factor 2 of full's."""
    _, full_sigma, full_var = prior_and_noise(many, hessian_structure="full")
    with warnings.catch_warnings():
        no_warning_on_sigma()
        _, sigma, var = prior_and_noise(many, hessian_structure="glas")
    assert sigma == pytest.approx(full_sigma, rel=0.05)
    ratio = var / full_var
    assert bool(((ratio > 0.5) & (ratio < 2)).all()), ratio
    assert fitted(many, hessian_structure="glas").complement == "kron"


# ----------------------------------------------------------------- mean scaling tells
def test_mean_scaling_warns_in_the_noise_loop(many):
    """Mean scaling divides the curvature by N: the evidence's optimum in sigma is the
    summed posterior's divided by sqrt(N), which the loop is told about."""
    _, full_sigma, _ = prior_and_noise(many, hessian_structure="full")
    with pytest.warns(UserWarning, match="not a likelihood in sigma"):
        _, sigma, _ = prior_and_noise(many, **MEAN)
    assert sigma * math.sqrt(200) == pytest.approx(full_sigma, rel=0.05)
    assert sigma < full_sigma / 10


def test_mean_scaling_variances_are_those_at_temperature_n(many):
    """What the FAQ's swap section states: mean scaling is laplace-torch at T = N, whose
    variances are far larger than Kron's or full's."""
    mean = fitted(many, prior_precision=0.3, **MEAN)
    hot = fitted(
        many, hessian_structure="glas", loss_scaling="sum", complement="zero",
        temperature=200.0, prior_precision=0.3,
    )  # fmt: skip
    full = fitted(many, hessian_structure="full", prior_precision=0.3)
    var = mean(X_TEST, pred_type="glm")[1]
    torch.testing.assert_close(var, hot(X_TEST, pred_type="glm")[1], rtol=1e-8, atol=0)
    assert bool((var > 10 * full(X_TEST, pred_type="glm")[1]).all())
