"""Lanczos residual report and replica check."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_glas, loader

from laplace_glas import replica_check, residual_report


def fit(toy_regression, **kw):
    _, X, y = toy_regression
    return fit_glas(*toy_regression, **kw), loader(X, y)


def test_residual_report(toy_regression):
    la, _ = fit(toy_regression)
    report = residual_report(la)
    torch.testing.assert_close(report.eigenvalues, la.eigenvalues)
    assert report.residuals.shape == (10,) and (report.residuals < 1e-3).all()
    assert report.n_products == la.lanczos_info.n_products > 10
    text = str(report)
    assert "10/10 eigenpairs converged" in text and "GGN products" in text


def test_replica_check_passes_converged_solve(toy_regression):
    la, dl = fit(toy_regression)
    check = replica_check(la, dl, n_replicas=2)
    assert check.passed and check.flagged == []
    assert check.best_overlap.min() > 0.99
    assert len(check.overlaps) == 2 and check.overlaps[0].shape == (10, 10)
    torch.testing.assert_close(
        check.replica_eigenvalues[0], la.lanczos_info.values, rtol=1e-4, atol=0
    )
    assert "all eigenvectors matched" in str(check)


def test_replica_check_flags_unconverged_solve(toy_regression):
    # a loose tolerance and a minimal Lanczos basis stop ARPACK early
    la, dl = fit(toy_regression, tol=0.5, ncv=11)
    assert la.lanczos_info.residuals.max() > 0.05
    check = replica_check(la, dl, n_replicas=2)
    assert not check.passed
    assert set(check.flagged) <= set(range(10)) and 9 in check.flagged
    assert "FLAGGED" in str(check)


def test_replica_check_on_subsamples(toy_regression):
    la, dl = fit(toy_regression)
    check = replica_check(la, dl, n_replicas=2, subsample=60)
    assert check.subsample == 60
    assert ((check.best_overlap > 0) & (check.best_overlap <= 1 + 1e-6)).all()
    # other data give other eigenvectors: overlaps fall below the full-data replicas' ~1
    assert check.best_overlap.mean() < 0.99
    assert "subsamples of 60 points" in str(check)
    with pytest.raises(ValueError, match="subsample_size"):
        replica_check(la, dl, subsample=1000)
