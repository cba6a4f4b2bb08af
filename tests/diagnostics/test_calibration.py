"""Coverage-based choice of k and the prior precision."""

from __future__ import annotations

import statistics
import warnings

import numpy as np
import pytest
import torch
from conftest import fit_glas, loader
from laplace import Laplace
from torch import nn

from laplace_glas import (
    CoverageNotReachedWarning,
    DimensionSelection,
    coverage,
    interval_width,
    select_dimension,
)
from laplace_glas.diagnostics.coverage import _credible_sets


@pytest.fixture(scope="module")
def fitted(toy_regression):
    la = fit_glas(*toy_regression, loss_scaling="mean", complement="zero")  # GLAS's route
    g = torch.Generator().manual_seed(7)
    Xc = torch.rand(300, 1, generator=g) * 4 - 2
    yc = torch.sin(3 * Xc) + 0.1 * torch.randn(300, 1, generator=g)
    return la, loader(Xc, yc, batch_size=100), Xc, yc


def test_glm_sweep_equals_truncated_predictive(fitted):
    """The vectorised sweep over k equals la(x) after truncating to k (no recompute)."""
    la, calib, Xc, yc = fitted
    n_products = la.lanczos_info.n_products
    sel = select_dimension(
        la,
        calib,
        0.9,
        ks=[1, 3, 7],
        prior_precisions=[0.5, 2.0],
        pred_type="glm",
        empirical_bayes=False,
        include_noise=False,
    )
    z = statistics.NormalDist().inv_cdf(0.95)
    for row in sel.rows:
        la.n_components, la.prior_precision = row.k, row.prior_precision
        f, var = la(Xc, pred_type="glm")
        half = z * var.reshape(-1, 1).sqrt()
        expected = ((yc - f).abs() <= half).double().mean().item()
        assert row.coverage == pytest.approx(expected, abs=1e-12)
        assert row.mean_width == pytest.approx(2 * half.mean().item(), rel=1e-5)
        got = coverage(la, calib, 0.9, pred_type="glm", include_noise=False)
        assert got == pytest.approx(expected, abs=1e-12)
        width = interval_width(la, calib, 0.9, include_noise=False)
        assert width == pytest.approx(row.mean_width, rel=1e-6)
    assert la.lanczos_info.n_products == n_products
    la.n_components, la.prior_precision = 10, 1.0


def test_nn_and_glm_sweeps_agree_under_mean_scaling(fitted):
    la, calib, *_ = fitted
    g = torch.Generator().manual_seed(0)
    nn_sel = select_dimension(
        la,
        calib,
        0.9,
        ks=[1, 2, 5],
        pred_type="nn",
        n_samples=400,
        generator=g,
        empirical_bayes=False,
    )
    glm_sel = select_dimension(la, calib, 0.9, ks=[1, 2, 5], pred_type="glm", empirical_bayes=False)
    for a, b in zip(nn_sel.rows, glm_sel.rows):
        assert abs(a.coverage - b.coverage) < 0.08
    la.n_components, la.prior_precision = 10, 1.0


def test_coverage_reached_at_k1_with_noise_added(fitted):
    la, calib, *_ = fitted
    sel = select_dimension(
        la,
        calib,
        0.9,
        prior_precisions=[1.0],
        pred_type="glm",
        empirical_bayes=False,
        include_noise=True,
    )
    assert sel.reached and sel.k == 1 and sel.coverage >= 0.9


def test_never_reached_warns_and_reports_best(fitted):
    la, calib, *_ = fitted
    with pytest.warns(CoverageNotReachedWarning, match="best achieved"):
        sel = select_dimension(
            la, calib, 0.9, prior_precisions=[1e9, 1e10], pred_type="glm",
            empirical_bayes=False, include_noise=False,
        )  # fmt: skip
    assert not sel.reached
    best = max(r.coverage for r in sel.rows)
    assert sel.coverage == best < 0.9
    assert "NOT reached" in str(sel)


def test_ties_broken_by_narrowest_interval(fitted):
    la, calib, *_ = fitted
    sel = select_dimension(
        la,
        calib,
        0.9,
        ks=[1, 2],
        prior_precisions=[1e-3, 1e-2, 1e-1],
        pred_type="glm",
        empirical_bayes=False,
        include_noise=True,
    )
    k1 = [r for r in sel.rows if r.k == 1]
    assert len({r.coverage for r in k1}) == 1 and k1[0].coverage >= 0.9  # a tie
    assert len({r.mean_width for r in k1}) == 3
    assert sel.k == 1
    assert sel.prior_precision == pytest.approx(min(k1, key=lambda r: r.mean_width).prior_precision)
    assert sel.prior_precision == pytest.approx(1e-1)


def test_calibrate_applies_selection_and_reports_table(fitted):
    la, calib, *_ = fitted
    sel = la.calibrate(calib, 0.9, pred_type="glm")
    assert isinstance(sel, DimensionSelection)
    assert la.n_components == sel.k and float(la.prior_precision) == pytest.approx(
        sel.prior_precision
    )
    assert sel.reached and not any(r.empirical_bayes for r in sel.rows)  # tuned, not EB
    assert "narrowest calibrated intervals" in sel.k_rule
    d = sel.to_dict()
    assert d["k"] == sel.k and len(d["rows"]) == len(sel.rows)
    text = str(sel)
    assert "coverage" in text and "k chosen by: the narrowest" in text
    grid = la.calibrate(calib, 0.9, pred_type="glm", prior_precisions=[1.0])
    assert any(r.empirical_bayes for r in grid.rows) and "(EB)" in str(grid)
    la.n_components, la.prior_precision = 10, 1.0


def test_mean_scaling_calibrates_with_few_directions_sum_does_not(toy_regression, fitted):
    """Paper's effect on the known-noise toy problem (intervals of f, no noise)."""
    model, X, y = toy_regression
    _, calib, *_ = fitted
    out = {}
    for scaling in ("mean", "sum"):
        la = Laplace(
            model,
            "regression",
            subset_of_weights="all",
            hessian_structure="glas",
            sigma_noise=0.1,
            n_components=10,
            loss_scaling=scaling,
            complement="zero",
        )
        la.fit(loader(X, y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CoverageNotReachedWarning)
            out[scaling] = select_dimension(
                la, calib, 0.9, pred_type="glm", empirical_bayes=False,
                prior_precisions=[1.0], include_noise=False,
            )  # fmt: skip
    assert out["mean"].reached and out["mean"].k <= 3
    assert max(r.coverage for r in out["sum"].rows) < 0.8


def test_selected_posterior_is_calibrated_on_linear_gaussian_model():
    """GLAS on a linear-Gaussian model is exact once k >= rank: the selected
    predictive of y covers fresh data at the nominal level (averaged over draws of
    the true weights from the prior, within sampling error)."""
    d, r, sigma, tau, level = 20, 3, 0.3, 1.0, 0.9
    coverages, ks = [], []
    for rep in range(30):
        g = torch.Generator().manual_seed(rep)
        A = torch.randn(d, r, generator=g, dtype=torch.float64) / r**0.5
        w = torch.randn(d, 1, generator=g, dtype=torch.float64) / tau**0.5

        def draw(n, g=g, A=A, w=w):
            X = torch.randn(n, r, generator=g, dtype=torch.float64) @ A.T
            return X, X @ w + sigma * torch.randn(n, 1, generator=g, dtype=torch.float64)

        (Xtr, ytr), (Xc, yc), (Xte, yte) = draw(4), draw(500), draw(500)
        model = nn.Linear(d, 1, bias=False).double()
        P = Xtr.T @ Xtr / sigma**2 + tau * torch.eye(d, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(torch.linalg.solve(P, Xtr.T @ ytr / sigma**2).T)
        la = Laplace(
            model,
            "regression",
            subset_of_weights="all",
            hessian_structure="glas",
            sigma_noise=sigma,
            prior_precision=tau,
            n_components=5,
            loss_scaling="sum",
            complement="zero",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.fit(loader(Xtr, ytr, batch_size=4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sel = la.calibrate(
                loader(Xc, yc, 250),
                level,
                prior_precisions=[tau],
                empirical_bayes=False,
                pred_type="glm",
                include_noise=True,
            )
        # on some draws of 500 calibration points no k reaches 90% (sampling error):
        # then, and only then, calibrate says so with a CoverageNotReachedWarning
        expected = [] if sel.reached else [CoverageNotReachedWarning]
        assert [w.category for w in caught] == expected
        ks.append(sel.k)
        coverages.append(coverage(la, loader(Xte, yte, 500), level, include_noise=True))
    mean = float(np.mean(coverages))
    se = float(np.std(coverages, ddof=1) / np.sqrt(len(coverages)))
    assert abs(mean - level) < 3 * se + 0.005, (mean, se)
    assert np.median(ks) == 3  # the rank of the GGN


def test_credible_sets_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.05, 0.05, 0.9]])
    y = torch.tensor([1, 2, 2])
    covered, size = _credible_sets(probs, y, 0.85)
    # sets: {0,1} (0.9), {0,1,2} (1.0), {2} (0.9)
    assert size == pytest.approx((2 + 3 + 1) / 3)
    assert covered == pytest.approx(1.0)
    covered, _ = _credible_sets(probs, torch.tensor([2, 2, 0]), 0.85)
    assert covered == pytest.approx(1 / 3)


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_classification_selection(toy_classification, pred_type):
    model, X, y = toy_classification
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas", n_components=6
    )
    la.fit(loader(X, y))
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        sel = select_dimension(
            la, loader(X, y), 0.9, pred_type=pred_type, n_samples=50, generator=g
        )
    assert all(0 <= r.coverage <= 1 and 1 <= r.mean_width <= 3 for r in sel.rows)
    assert all(np.isfinite(r.nll) for r in sel.rows)
    assert "set size" in str(sel)


def test_bad_arguments(fitted):
    la, calib, *_ = fitted
    with pytest.raises(ValueError, match="ks must lie"):
        select_dimension(la, calib, ks=[0, 1])
    with pytest.raises(ValueError, match="ks must lie"):
        select_dimension(la, calib, ks=[11])
    with pytest.raises(ValueError, match="level"):
        select_dimension(la, calib, coverage=1.5, pred_type="glm")
    with pytest.raises(ValueError, match="positive"):
        select_dimension(la, calib, prior_precisions=[-1.0])
    with pytest.raises(ValueError, match="empty"):
        select_dimension(la, [], pred_type="glm")
    bad = loader(torch.rand(5, 1), torch.rand(5))
    with pytest.raises(ValueError, match="do not match"):
        select_dimension(la, bad, pred_type="glm")


def test_selection_beyond_numerical_rank_is_flagged():
    """A GGN of rank 3 (4 training points in a 3-dim input span): a coverage reached
    only with k > 3 comes from prior-variance directions and is flagged."""
    g = torch.Generator().manual_seed(0)
    d = 10
    A = torch.randn(d, 3, generator=g, dtype=torch.float64)
    Xtr = torch.randn(4, 3, generator=g, dtype=torch.float64) @ A.T
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w.T)
    Xc = torch.randn(200, d, generator=g, dtype=torch.float64)  # off the training span
    yc = Xc @ w + torch.randn(200, 1, generator=g, dtype=torch.float64)
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=1.0,
        prior_precision=1e-2,
        n_components=6,
        loss_scaling="mean",
        complement="zero",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(Xtr, Xtr @ w, batch_size=4))
    with pytest.warns(CoverageNotReachedWarning, match="beyond the numerical rank"):
        sel = select_dimension(
            la, loader(Xc, yc), 0.9, pred_type="glm", empirical_bayes=False,
            prior_precisions=[1e-2], include_noise=False,
        )  # fmt: skip
    assert sel.numerical_rank == 3 and sel.k > 3 and sel.beyond_rank
    assert "* k beyond the numerical rank (3)" in str(sel)


class _RowCounter:
    """Forward pre-hook recording the largest number of input rows the model saw."""

    def __init__(self, model: nn.Module):
        self.largest = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.largest = max(self.largest, args[0].shape[0])


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
@pytest.mark.parametrize(
    "likelihood, complement",
    [("regression", "zero"), ("regression", "prior"), ("classification", "zero")],
)
def test_sweep_runs_in_loader_batches_with_the_same_result(
    toy_regression, toy_classification, likelihood, complement, pred_type
):
    """The network sees one loader batch at a time (memory of one batch, not of the
    whole calibration set), and the rows equal those of a single-batch sweep."""
    model, X, y = toy_regression if likelihood == "regression" else toy_classification
    la = fit_glas(model, X, y, likelihood, n_components=6, complement=complement)
    la.jvp_chunk_size = 4  # 6 directions: one full and one partial chunk
    rows = {}
    for batch_size in (len(X), 7):
        counter = _RowCounter(model)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CoverageNotReachedWarning)
                sel = select_dimension(
                    la,
                    loader(X, y, batch_size),
                    0.9,
                    ks=[1, 4, 6],
                    pred_type=pred_type,
                    n_samples=30,
                    generator=torch.Generator().manual_seed(3),
                )
        finally:
            counter.handle.remove()
        assert counter.largest == batch_size
        rows[batch_size] = sel.rows
    for whole, batched in zip(rows[len(X)], rows[7]):
        assert (whole.k, whole.prior_precision) == (batched.k, batched.prior_precision)
        assert whole.coverage == pytest.approx(batched.coverage, abs=1e-12)
        assert whole.mean_width == pytest.approx(batched.mean_width, rel=1e-5)
        assert whole.nll == pytest.approx(batched.nll, rel=1e-5)


def test_coverage_table_rejects_bad_batch_size(fitted):
    from laplace_glas.diagnostics.calibration import coverage_table

    la, _, Xc, yc = fitted
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        coverage_table(la, Xc, yc, [(1, 1.0, False)], batch_size=0)


def test_defaults_use_the_same_predictive_as_coverage(fitted):
    """calibrate/select_dimension and coverage/interval_width default to 'glm', the
    posterior's own default predictive, so a calibrated k is checked with the
    predictive it was chosen by."""
    la, calib, *_ = fitted
    sel = select_dimension(la, calib, 0.9, ks=[2], empirical_bayes=False)
    assert sel.pred_type == "glm" and sel.include_noise  # y-intervals against y
    la.n_components, la.prior_precision = 2, sel.rows[0].prior_precision
    assert coverage(la, calib, 0.9) == pytest.approx(sel.rows[0].coverage, abs=1e-12)
    la.n_components, la.prior_precision = 10, 1.0


def test_empirical_bayes_candidates_use_each_k_even_above_n_components(fitted):
    """After lowering n_components, the sweep over larger k (allowed up to the computed
    eigenpairs) must use each k's own evidence optimum, not that of the current k."""
    from laplace_glas.posterior.closed_forms import optimal_prior_precision

    la, calib, *_ = fitted
    la.n_components = 2
    try:
        sel = select_dimension(la, calib, 0.9, ks=[1, 2, 5, 10], prior_precisions=[1.0])
    finally:
        la.n_components = 10
    square_norm = float((la.mean - la.prior_mean).square().sum())
    curvature = la.subspace_curvature.detach()  # all 10 again
    eb = {r.k: r.prior_precision for r in sel.rows if r.empirical_bayes}
    assert set(eb) == {1, 2, 5, 10}
    for k, tau in eb.items():
        assert tau == pytest.approx(optimal_prior_precision(curvature[:k], square_norm), rel=1e-9)
    assert len(set(eb.values())) == 4
