"""calibrate's default: the prior precision tuned over a continuous range so that the
calibration coverage reaches the level, with coverage counted by hand from the 'glm'
moments, and held-out coverage near the nominal level."""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch
from conftest import loader
from laplace import Laplace
from torch import nn

import laplace_glas  # noqa: F401
from laplace_glas import coverage, select_dimension
from laplace_glas.diagnostics.coverage import CoverageRow
from laplace_glas.diagnostics.prior_search import sharpest, tuned_rows

DOUBLE = torch.float64
SIGMA = 0.2


def _sine(n: int, g: torch.Generator):
    X = torch.rand(n, 1, generator=g, dtype=DOUBLE) * 4 - 2
    f = torch.sin(3 * X)
    return X, f, f + SIGMA * torch.randn(n, 1, generator=g, dtype=DOUBLE)


@pytest.fixture(scope="module")
def sine():
    g = torch.Generator().manual_seed(0)
    train, calib, test = _sine(200, g), _sine(1000, g), _sine(1500, g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                          nn.Linear(24, 1)).to(DOUBLE)  # fmt: skip
    optimiser = torch.optim.Adam(model.parameters(), 1e-2)
    X, _, y = train
    for _ in range(1500):
        optimiser.zero_grad()
        (model(X) - y).square().mean().backward()
        optimiser.step()
    return model, train, calib, test


def _posterior(model, train, **kwargs):
    X, _, y = train
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 sigma_noise=SIGMA, n_components=8, **kwargs)  # fmt: skip
    la.fit(loader(X, y, batch_size=100))
    return la


def _by_hand(la, X, targets, k, tau, level, noise=True):
    """Coverage of the central y- (or f-) intervals from la's own 'glm' moments."""
    la.n_components, la.prior_precision = k, tau
    f, var = la(X, pred_type="glm")
    var = var.reshape(-1, 1) + (SIGMA**2 if noise else 0.0)
    half = statistics.NormalDist().inv_cdf(0.5 + level / 2) * var.sqrt()
    return float(((targets - f).abs() <= half).double().mean())


@pytest.mark.parametrize("kwargs", [{"loss_scaling": "mean", "complement": "zero"}, {}])
def test_the_tuned_prior_is_the_root_of_the_calibration_coverage(sine, kwargs):
    model, train, (Xc, _, yc), _ = sine
    la = _posterior(model, train, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        selection = select_dimension(la, loader(Xc, yc, 250), 0.9, ks=[1, 2, 4])
    assert selection.reached
    for row in selection.rows:
        if la.complement != "zero" and row.k != selection.k:
            continue  # the curvature-aware complement: tuned at the evidence's k only
        tau = row.prior_precision
        assert _by_hand(la, Xc, yc, row.k, tau, 0.9) == pytest.approx(row.coverage, abs=1e-12)
        assert row.coverage >= 0.9
        # the root: a prior 2% stronger (narrower intervals) no longer covers
        assert _by_hand(la, Xc, yc, row.k, 1.02 * tau, 0.9) < 0.9
    if la.complement == "zero":
        assert "narrowest calibrated" in selection.k_rule
    else:
        assert la.complement == "kron" and selection.k_rule.startswith("the evidence")
        taus = {r.prior_precision for r in selection.rows}
        assert len(taus) == 1 and {r.k for r in selection.rows} == {1, 2, 4}


@pytest.mark.parametrize("noise", [True, False], ids=["y-vs-y", "f-vs-f"])
@pytest.mark.parametrize(
    "kwargs", [{}, {"loss_scaling": "mean", "complement": "zero"}], ids=["default", "mean-zero"]
)
def test_held_out_coverage_is_near_the_level(sine, kwargs, noise):
    """calibrate(coverage=0.9) on 1,000 calibration points: 0.87-0.93 on 1,500 fresh ones,
    y-intervals against y or f-intervals against the true f."""
    model, train, (Xc, fc, yc), (Xt, ft, yt) = sine
    la = _posterior(model, train, **kwargs)
    calib, test = (yc, yt) if noise else (fc, ft)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.calibrate(loader(Xc, calib, 250), 0.9, include_noise=noise)
    held_out = coverage(la, loader(Xt, test, 500), 0.9, include_noise=noise)
    assert 0.87 <= held_out <= 0.93, held_out


def test_a_level_out_of_reach_returns_the_widest_row():
    """An f-interval of the subspace alone under summed scaling cannot widen past
    sum_j (J u_j)^2 / a_j: the search returns the widest row (tau = 1e-8)."""

    def table(pairs):
        return [CoverageRow(k, t, 0.5 - 0.01 * (t > 1), 1.0 / t, 0.0) for k, t, _ in pairs]

    (row,) = tuned_rows(table, [3], 0.9, per_candidate=True)
    assert row.prior_precision == pytest.approx(1e-8) and row.coverage < 0.9


def test_a_synthetic_step_is_bracketed_to_its_edge():
    edge = 37.0

    def table(pairs):
        return [CoverageRow(k, t, 0.95 if t <= edge else 0.85, 1.0 / t, 0.0) for k, t, _ in pairs]

    rows = tuned_rows(table, [1, 2], 0.9, per_candidate=False)
    for row in rows:
        assert row.coverage >= 0.9 and edge / 1.01 <= row.prior_precision <= edge


def test_sharpest_takes_the_smallest_k_within_one_percent():
    rows = [CoverageRow(k, 1.0, 0.9, w, 0.0) for k, w in [(1, 2.0), (2, 1.005), (3, 1.0)]]
    assert sharpest(rows).k == 2
