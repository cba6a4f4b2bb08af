"""The comparison harness and its Markdown writer, on a 1-8-1 MLP and 50 points."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import loader, mlp, regression_data, train

from laplace_glas.applications.compare import (
    ComparisonRow,
    PeakMemory,
    Structure,
    compare_structures,
    default_structures,
    format_table,
    rss_method,
)


@pytest.fixture(scope="module")
def tiny():
    X, y = regression_data(80, seed=3)
    model = train(mlp([1, 8, 1]), X[:50], y[:50], steps=200)
    return model, (X[:50], y[:50]), (X[50:65], y[50:65]), (X[65:], y[65:])


FAST = [
    Structure("GLAS mean", "all", "glas", {"n_components": 4, "loss_scaling": "mean"}),
    Structure("GLAS sum", "all", "glas", {"n_components": 4, "loss_scaling": "sum"}),
    Structure("all / diag", "all", "diag"),
    Structure("last_layer / full", "last_layer", "full"),
    Structure("bogus", "all", "no-such-structure"),
    Structure("all / full (limit)", "all", "full", max_params=10),
]


@pytest.fixture(scope="module")
def rows(tiny):
    model, train_xy, calib_xy, test_xy = tiny
    return compare_structures(
        model,
        "regression",
        loader(*train_xy, batch_size=25),
        loader(*calib_xy),
        loader(*test_xy),
        structures=FAST,
        sigma_noise=0.1,
        n_predict_timing=40,
    )


def test_one_row_per_structure_in_order(rows):
    assert [r.name for r in rows] == [s.name for s in FAST]
    assert all(isinstance(r, ComparisonRow) for r in rows)


def test_successful_rows_are_complete(rows):
    for r in rows[:4]:
        assert r.status == "ok", r.error
        assert r.error is None
        for value in (r.nll, r.rmse, r.coverage, r.coverage_f, r.mean_width, r.fit_time):
            assert value is not None and math.isfinite(value)
        assert 0 <= r.coverage_f <= r.coverage <= 1  # adding sigma^2 widens the interval
        assert r.mean_width > 2 * 1.6448 * 0.1 - 1e-6  # at least the noise's own interval
        assert r.prior_time >= 0 and r.predict_time_per_1000 > 0
        assert r.prior_precision > 0
        assert r.peak_rss_mb is not None and r.peak_rss_mb >= 0
        assert r.rss_method == rss_method()


def test_same_mean_for_every_structure(rows):
    # all 'glm' predictives share the MAP mean: the RMSE cannot differ
    rmses = [r.rmse for r in rows if r.status == "ok"]
    assert max(rmses) - min(rmses) < 1e-5


def test_glas_reports_selected_k(rows):
    for r in rows[:2]:
        assert r.k_max == 4
        assert 1 <= r.k <= r.k_max
        assert r.calibration_reached in (True, False)
        assert r.calibration_time is not None
    for r in rows[2:4]:
        assert r.k is None and r.calibration_time is None


def test_failing_structure_gives_error_row(rows):
    bogus = rows[4]
    assert bogus.status == "failed"
    assert "no-such-structure" in bogus.error
    assert bogus.nll is None and bogus.fit_time is None


def test_size_limit_skips_with_note(rows):
    skipped = rows[5]
    assert skipped.status == "skipped"
    assert "max_params = 10" in skipped.error
    assert skipped.fit_time is None


def test_model_weights_restored(tiny, rows):
    model = tiny[0]
    X = tiny[3][0]
    before = model(X)
    assert torch.equal(before, model(X))
    assert not model.training


def test_format_table(rows):
    table = format_table(rows)
    lines = table.splitlines()
    header = lines[0]
    assert header.startswith("| structure |") and "RMSE" in header and "cov. 90% (y)" in header
    n_cols = header.count("|")
    table_lines = [line for line in lines if line.startswith("|")]
    assert len(table_lines) == 2 + len(rows)
    assert all(line.count("|") == n_cols for line in table_lines)
    assert "FAILED: ValueError" in table
    assert "SKIPPED: 25 parameters > max_params" in table
    assert "4 / 4" in table or "/ 4 |" in table  # selected / computed k
    assert format_table([]) == ""


def test_format_table_classification_columns():
    row = ComparisonRow("x", "all", "kron", accuracy=0.9, nll=0.3, coverage=0.95, mean_width=1.2)
    table = format_table([row])
    assert "acc." in table and "RMSE" not in table and "mean set size" in table


def test_default_structures_cover_the_issue():
    keys = [(s.subset_of_weights, s.hessian_structure) for s in default_structures()]
    for key in [
        ("all", "glas"),
        ("all", "kron"),
        ("all", "diag"),
        ("all", "full"),
        ("last_layer", "kron"),
        ("last_layer", "full"),
        ("all", "gp"),
    ]:
        assert key in keys
    scalings = {s.kwargs.get("loss_scaling") for s in default_structures() if s.is_glas}
    assert scalings == {"mean", "sum"}
    assert any(s.is_ella for s in default_structures())


def test_sigma_defaults_to_training_rmse_and_validation(tiny):
    model, train_xy, calib_xy, test_xy = tiny
    args = (model, "regression", loader(*train_xy), loader(*calib_xy), loader(*test_xy))
    rows = compare_structures(
        *args, structures=[Structure("ll", "last_layer", "diag")], n_predict_timing=0
    )
    assert rows[0].status == "ok" and rows[0].predict_time_per_1000 is None
    with pytest.raises(ValueError, match="coverage"):
        compare_structures(*args, coverage=1.5)
    with pytest.raises(ValueError, match="pred_type"):
        compare_structures(*args, pred_type="gp")


def test_peak_memory_probe_sees_an_allocation():
    with PeakMemory() as probe:
        block = torch.ones(40 * 2**20 // 4)  # 40 MiB, touched
        del block
    if probe.method == "VmHWM reset":
        assert probe.peak_mb > 30
    else:
        assert probe.peak_mb >= 0
