"""The ARPACK solve: its own vector work on one OpenBLAS thread (restored after), its
residual check (fresh, or recombined from the recorded products of the factored
operator) against the dense GGN, and the float32 default tolerance.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import loader
from scipy.sparse.linalg import LinearOperator
from scipy.sparse.linalg import eigsh as real_eigsh
from torch import nn
from tqdm.auto import tqdm

from laplace_glas.curvature.operators.factored import FactoredGGN, build_factored_ggn
from laplace_glas.curvature.solvers import lanczos
from laplace_glas.curvature.solvers import solve as eigensolve
from laplace_glas.curvature.solvers.lanczos import solve_lanczos
from laplace_glas.curvature.solvers.solve import compute_eigenpairs
from laplace_glas.curvature.solvers.threads import _openblas_thread_controls


def test_lanczos_runs_on_one_openblas_thread_and_restores_the_count():
    controls = _openblas_thread_controls()
    if not controls:
        pytest.skip("no OpenBLAS found in this process (its threads cannot be observed)")
    get = [g for g, _ in controls]
    original = [g() for g in get]
    for _, put in controls:  # two threads, whatever the environment set
        put(2)
    try:
        _check_solve(get)
    finally:
        for (_, put), n in zip(controls, original):
            put(n)


def _check_solve(get):
    before = [g() for g in get]
    rng = np.random.default_rng(0)
    B = rng.standard_normal((60, 60))
    A = B @ B.T
    seen = []

    def matvec(x):
        seen.append(tuple(g() for g in get))
        return A @ x

    op = LinearOperator(A.shape, matvec=matvec, dtype=np.float64)
    values, *_ = solve_lanczos(
        op, 4, 1.0, torch.float64, 0.0, None, None, torch.Generator().manual_seed(0),
        tqdm(disable=True),
    )  # fmt: skip
    # every product of the iteration ran on one thread (the residual check after it, its
    # last four matvecs, on two)
    assert len(seen) > 4 and all(c == (1,) * len(get) for c in seen[:-4])
    assert all(c == (2,) * len(get) for c in seen[-4:])
    assert [g() for g in get] == before == [2] * len(get)
    reference = np.linalg.eigvalsh(A)[::-1][:4]
    np.testing.assert_allclose(values.numpy(), reference, rtol=1e-10)


# ---------------------------------------------------------------------- residual check
def _factored_mlp(dtype=torch.float64):
    """A scalar-output tanh MLP's factored GGN and its dense GGN from ``jacrev``
    (``G_1 = J^T J / N``, the independent reference).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 30), nn.Tanh(), nn.Linear(30, 1)).to(dtype).eval()
    X = torch.randn(100, 3, dtype=torch.float64).to(dtype)
    y = torch.randn(100, 1, dtype=torch.float64).to(dtype)
    params = list(model.parameters())
    op = build_factored_ggn(model, params, loader(X, y, 16), "regression", len(X))
    assert isinstance(op, FactoredGGN), op
    names = [n for n, _ in model.named_parameters()]
    jac = torch.func.jacrev(
        lambda *ps: torch.func.functional_call(model, dict(zip(names, ps)), (X,)),
        argnums=tuple(range(len(params))),
    )(*(p.detach() for p in params))
    J = torch.cat([j.reshape(len(X), -1) for j in jac], 1)
    return op, J.T @ J / len(X)


def _reference_residuals(G, eig):
    raw = eig.raw_values.to(G.dtype)
    U = eig.vectors.to(G.dtype)
    return torch.linalg.vector_norm(G @ U - U * raw, dim=0) / raw


def test_factored_residuals_come_from_the_recorded_products():
    """On the factored operator the residual check takes no product of its own, and
    its residuals are those of the dense GGN (a loose ``tol`` and a small basis leave
    them large enough, up to ~1e-3, to compare digit by digit).
    """
    op, G = _factored_mlp()
    eig = compute_eigenpairs(op, 4, dtype=torch.float64, tol=1e-2, ncv=6, solver="lanczos")
    assert eig.n_products == eig.n_passes  # one column per call: no k-column check
    reference = _reference_residuals(G, eig)
    assert reference.max() > 1e-6  # the comparison below is not one of round-off
    torch.testing.assert_close(eig.residuals, reference, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(
        eig.values.numpy(), torch.linalg.eigvalsh(G).flip(0)[:4].numpy(), rtol=1e-2
    )


def test_residual_check_multiplies_afresh_for_other_operators():
    """A plain SciPy operator (as curvlinops' or a data-parallel one: products that
    may change between passes) gets one fresh product with ``k`` columns.
    """
    _, G = _factored_mlp()
    dense = LinearOperator(G.shape, matvec=lambda x: G.numpy() @ x, dtype=np.float64)
    eig = compute_eigenpairs(dense, 4, dtype=torch.float64, tol=1e-2, ncv=6, solver="lanczos")
    assert eig.n_products == eig.n_passes - 1 + 4
    torch.testing.assert_close(eig.residuals, _reference_residuals(G, eig), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("limit", ["tiny", "outside"])
def test_record_falls_back_to_a_fresh_product(limit, monkeypatch):
    """A record above its byte limit, or vectors it cannot recombine, take the fresh
    ``k``-column product: same residuals, ``k`` more products.
    """
    op, G = _factored_mlp()
    if limit == "tiny":
        monkeypatch.setattr(eigensolve, "_record_bytes", lambda operator, dtype: 8 * G.shape[0])
    else:
        monkeypatch.setattr(lanczos._ProductRecord, "images", lambda self, vectors: None)
    eig = compute_eigenpairs(op, 4, dtype=torch.float64, tol=1e-2, ncv=6, solver="lanczos")
    assert eig.n_products == eig.n_passes - 1 + 4
    torch.testing.assert_close(eig.residuals, _reference_residuals(G, eig), rtol=1e-6, atol=1e-12)


def test_record_refuses_vectors_outside_the_recorded_span():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((50, 50))
    A = A @ A.T
    X = np.linalg.qr(rng.standard_normal((50, 6)))[0]
    record = lanczos._ProductRecord(10**9)
    for j in range(6):
        record.add(X[:, j].copy(), A @ X[:, j])
    inside = X[:, :2] @ np.linalg.qr(rng.standard_normal((2, 2)))[0]
    np.testing.assert_allclose(record.images(inside), A @ inside, atol=1e-10)
    outside = inside.copy()
    outside[:, 1] = rng.standard_normal(50)
    outside[:, 1] /= np.linalg.norm(outside[:, 1])
    assert record.images(outside) is None
    small = lanczos._ProductRecord(3 * 2 * 50 * 8)  # three pairs of float64 columns
    for j in range(6):
        small.add(X[:, j].copy(), A @ X[:, j])
    assert small.images(inside) is None and not small.inputs  # stopped and freed


def test_float32_default_tolerance_keeps_the_dense_eigenvalues():
    """``tol=0`` asks ARPACK for 1e-4 in float32: the eigenvalues stay those of the
    dense float64 GGN to float32 accuracy, the residual check (recombined from the
    float32 record) gives the dense GGN's residuals and does not warn.
    """
    _, G = _factored_mlp()
    op, _ = _factored_mlp(torch.float32)
    reference = torch.linalg.eigvalsh(G).flip(0)[:5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eig = compute_eigenpairs(op, 5, dtype=torch.float32, solver="lanczos")
    np.testing.assert_allclose(eig.values.double().numpy(), reference.numpy(), rtol=1e-5)
    assert eig.n_products == eig.n_passes  # the float32 record served the check
    residuals = _reference_residuals(G, eig)
    torch.testing.assert_close(eig.residuals.double(), residuals, rtol=0, atol=1e-5)


def _classifier_ggn(dtype):
    """A 5-40-40-6 tanh classifier's factored GGN (N = 300, D = 2,126)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 6)
    ).to(dtype)
    X = torch.randn(300, 5, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 6, (300,))
    op = build_factored_ggn(
        model.eval(), list(model.parameters()), loader(X, y, 50), "classification", 300
    )
    assert isinstance(op, FactoredGGN), op
    return op


def test_float32_default_tolerance_is_at_the_products_rounding_floor(monkeypatch):
    """The float32 default (:data:`~eigensolve.FLOAT32_TOL`, ARPACK's ``tol``) leaves the
    top-10 eigenvectors as close to the float64 GGN's as a solve to ``tol=1e-7``: the
    float32 products' rounding, not the tolerance, limits them (the largest principal
    angle's sine, about 7e-4 either way), for fewer products.
    """
    G = _classifier_ggn(torch.float64).matmat_torch(torch.eye(2126, dtype=torch.float64))
    exact = torch.linalg.eigh((G + G.T) / 2).eigenvectors.flip(1)[:, :10]
    op = _classifier_ggn(torch.float32)
    asked = []
    monkeypatch.setattr(
        lanczos, "eigsh", lambda *a, **kw: asked.append(kw["tol"]) or real_eigsh(*a, **kw)
    )

    def span_sine(tol):
        eig = compute_eigenpairs(
            op, 10, dtype=torch.float32, solver="lanczos", tol=tol,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        overlap = torch.linalg.svdvals(exact.T @ eig.vectors.double())
        return float((1 - overlap.min() ** 2).sqrt()), eig.n_products

    default, tight = span_sine(0.0), span_sine(1e-7)
    assert asked == [eigensolve.FLOAT32_TOL, 1e-7] and eigensolve.FLOAT32_TOL == 1e-4
    assert tight[0] < 2e-3  # the float32 floor itself
    assert default[0] <= 1.5 * tight[0]
    assert default[1] < tight[1]
