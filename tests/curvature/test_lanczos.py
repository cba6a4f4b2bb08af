"""The ARPACK solve runs its own vector work on one OpenBLAS thread and restores it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import LinearOperator
from tqdm.auto import tqdm

from laplace_glas.curvature.solvers.gram import _openblas_thread_controls
from laplace_glas.curvature.solvers.lanczos import solve_lanczos


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
