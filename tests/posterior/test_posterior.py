"""Closed forms of the subspace posterior against dense linear algebra."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laplace_glas.posterior.closed_forms import (
    SubspaceOperator,
    log_det_ratio,
    optimal_prior_precision,
    posterior_variances,
    sample_subspace,
)


def random_subspace(D=12, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(D, k, generator=g, dtype=torch.float64))
    a = torch.rand(k, generator=g, dtype=torch.float64) * 10
    return U, a


def evidence_terms(a, tau, m):
    return -0.5 * tau * m - 0.5 * np.log1p(a / tau).sum()


@pytest.mark.parametrize("m", [1e-3, 0.5, 10.0, 1e4])
def test_optimal_prior_precision_maximises_evidence(m):
    a = np.array([100.0, 10.0, 1.0, 0.1, 0.0])
    tau = optimal_prior_precision(torch.as_tensor(a), m)
    # MacKay fixed point
    assert math.isclose(tau * m, float(np.sum(a / (a + tau))), rel_tol=1e-9)
    grid = np.exp(np.linspace(math.log(tau) - 3, math.log(tau) + 3, 2001))
    values = np.array([evidence_terms(a, t, m) for t in grid])
    assert evidence_terms(a, tau, m) >= values.max() - 1e-12


def test_optimal_prior_precision_degenerate_cases_raise():
    with pytest.raises(ValueError, match="tau -> inf"):
        optimal_prior_precision(torch.tensor([1.0, 2.0]), 0.0)
    with pytest.raises(ValueError, match="tau -> 0"):
        optimal_prior_precision(torch.tensor([0.0, 0.0]), 1.0)


def test_log_det_ratio_matches_dense():
    U, a = random_subspace()
    tau = torch.tensor(0.3, dtype=torch.float64)
    P = (U * a) @ U.T + tau * torch.eye(U.shape[0], dtype=torch.float64)
    dense = torch.logdet(P) - U.shape[0] * torch.log(tau)
    torch.testing.assert_close(log_det_ratio(a, tau), dense)


@pytest.mark.parametrize("complement", [0.0, 0.25])
def test_subspace_operator_matches_dense(complement):
    U, a = random_subspace()
    D = U.shape[0]
    dense = (U * a) @ U.T + complement * (torch.eye(D, dtype=torch.float64) - U @ U.T)
    op = SubspaceOperator(U, a, complement)
    torch.testing.assert_close(op.to_dense(), dense)
    x = torch.randn(D, 3, dtype=torch.float64)
    torch.testing.assert_close(op @ x, dense @ x)
    torch.testing.assert_close(op @ x[:, 0], dense @ x[:, 0])
    torch.testing.assert_close(op.diagonal(), dense.diagonal())
    assert op.shape == (D, D)


def test_infinite_complement_refuses_to_materialise():
    U, a = random_subspace()
    op = SubspaceOperator(U, a, math.inf)
    with pytest.raises(ValueError, match="infinite outside span"):
        op.to_dense()
    with pytest.raises(ValueError, match="infinite outside span"):
        op @ torch.randn(U.shape[0], dtype=torch.float64)


@pytest.mark.parametrize("complement", [0.0, 0.5])
def test_sample_subspace_covariance(complement):
    U, a = random_subspace(D=6, k=2)
    v = posterior_variances(a, torch.tensor(1.0, dtype=torch.float64))
    n = 200_000
    draws = sample_subspace(U, v, n, complement, torch.Generator().manual_seed(0))
    ref = (U * v) @ U.T + complement * (torch.eye(6, dtype=torch.float64) - U @ U.T)
    sd = ((ref.diagonal()[:, None] * ref.diagonal()[None, :] + ref**2) / n).sqrt()
    assert ((torch.cov(draws.T) - ref).abs() / sd).max() < 6
