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
    la, _ = fit(toy_regression, solver="lanczos")  # ARPACK's product count
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
    la, dl = fit(toy_regression, tol=0.5, ncv=11, solver="lanczos")
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


def test_subspace_overlap_ignores_rotations_within_the_subspace():
    """A replica that rotates a pair of vectors by 45 degrees inside the span: per-vector
    overlaps drop to 0.71 (flagged), the subspace overlap stays 1; a replica that swaps
    one vector for an orthogonal direction loses exactly 1/k of the span.
    """
    from laplace_glas.diagnostics.convergence import ReplicaCheck

    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(30, 5, generator=g, dtype=torch.float64))
    U = Q[:, :4]
    c = 2**-0.5
    rotation = torch.eye(4, dtype=torch.float64)
    rotation[2:, 2:] = torch.tensor([[c, -c], [c, c]], dtype=torch.float64)
    rotated = U @ rotation
    swapped = torch.cat([U[:, :3], Q[:, 4:5]], dim=1)
    overlaps = [(U.T @ rotated).abs(), (U.T @ swapped).abs()]
    best = torch.stack([o.max(dim=1).values for o in overlaps]).min(dim=0).values
    check = ReplicaCheck(overlaps, best, [j for j in range(4) if best[j] < 0.9], 0.9)
    assert check.flagged == [2, 3]
    torch.testing.assert_close(check.subspace_overlap(2), torch.tensor([1.0, 1.0]).double())
    torch.testing.assert_close(check.subspace_overlap(), torch.tensor([1.0, 0.75]).double())
    torch.testing.assert_close(check.subspace_overlap(3)[0], torch.tensor(1.0).double())
    with pytest.raises(ValueError, match="m must lie"):
        check.subspace_overlap(5)
    assert "span of u_1..u_j kept" in str(check)


def test_subspace_overlap_of_a_converged_replica_is_one(toy_regression):
    la, dl = fit(toy_regression)
    check = replica_check(la, dl, n_replicas=1)
    assert float(check.subspace_overlap()) > 1 - 1e-4


def test_replicas_never_repeat_the_fits_own_seed(toy_regression):
    """With seed=1 in the fit, replica seeds used to start at 1 as well: replica 0
    repeated the fit bit for bit and the check passed trivially."""
    la, dl = fit(toy_regression, seed=1, subsample_size=60)
    check = replica_check(la, dl, n_replicas=1, subsample=60)
    assert not torch.equal(check.replica_eigenvalues[0], la.lanczos_info.values)
    with pytest.raises(ValueError, match="include the fit's seed 1"):
        replica_check(la, dl, n_replicas=2, seed=0)


def test_replicas_avoid_the_seed_of_the_fits_generator(toy_regression):
    la, dl = fit(toy_regression, generator=torch.Generator().manual_seed(1))
    check = replica_check(la, dl, n_replicas=1)
    assert not torch.equal(check.replica_eigenvalues[0], la.lanczos_info.values)
    with pytest.raises(ValueError, match="include the fit's seed 1"):
        replica_check(la, dl, n_replicas=1, seed=1)
