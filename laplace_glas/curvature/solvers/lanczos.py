"""ARPACK's implicitly restarted Lanczos (``scipy.sparse.linalg.eigsh``) on an operator.

The reference solver: one operator-vector product per Lanczos step, ``which='LA'``
(largest algebraic eigenvalues), with a random start drawn from the caller's
generator. The operator is wrapped so that every product is counted, scaled by
``scale`` and checked for non-finite values:

.. math::

    (s A)\\, u_j = \\lambda_j u_j , \\qquad j = 1, \\dots, k .
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigsh
from tqdm.auto import tqdm

from laplace_glas.curvature.eigenpairs import _ZERO_GGN, LanczosConvergenceWarning
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.solvers.gram import _single_threaded_openblas

__all__ = ["solve_lanczos"]


class _CountingOperator(LinearOperator):
    """``scale * A`` for a SciPy operator ``A``, counting products and rejecting
    non-finite results.
    """

    def __init__(
        self,
        operator: LinearOperator,
        scale: float,
        on_product: Callable[[int], None] | None = None,
    ):
        super().__init__(dtype=operator.dtype, shape=operator.shape)
        self._operator = operator
        self._scale = scale
        self._on_product = on_product
        self.n_products = 0
        self.n_calls = 0
        self.all_zero = True  # every product so far was exactly zero

    def _record(self, result: np.ndarray, n_columns: int) -> np.ndarray:
        self.n_products += n_columns
        self.n_calls += 1
        if self._on_product is not None:
            self._on_product(n_columns)
        if not np.all(np.isfinite(result)):
            raise FloatingPointError(
                "A GGN-vector product returned NaN or inf. Check the model's outputs "
                "and the training data for non-finite values."
            )
        self.all_zero = self.all_zero and not np.any(result)
        return self._scale * result

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._record(self._operator.matvec(x), 1)

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        return self._record(self._operator.matmat(X), X.shape[1])

    def _adjoint(self) -> _CountingOperator:
        return self


def solve_lanczos(
    operator: LinearOperator,
    k: int,
    scale: float,
    dtype: torch.dtype,
    tol: float,
    maxiter: int | None,
    ncv: int | None,
    generator: torch.Generator | None,
    pbar: tqdm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """ARPACK on the SciPy operator; returns values, vectors, their images, products,
    converged count (descending order).
    """
    D = operator.shape[0]
    np_dtype = NUMPY_DTYPES[dtype]
    scipy_operator = (
        operator.to_scipy(dtype=np_dtype) if hasattr(operator, "to_scipy") else operator
    )
    counting = _CountingOperator(scipy_operator, scale, on_product=pbar.update)
    v0 = torch.randn(D, generator=generator, dtype=torch.float64).numpy().astype(np_dtype)
    try:
        # ARPACK's own vector work (dots, axpys, re-orthogonalisation on D-vectors) on one
        # OpenBLAS thread: idle OpenBLAS workers spin between its many small calls and
        # take the cores from torch's threads computing the products (on 2 busy cores a
        # Lanczos fit ran 3x slower with two OpenBLAS threads).
        with _single_threaded_openblas():
            values, vectors = eigsh(
                counting, k=k, which="LA", tol=tol, maxiter=maxiter, ncv=ncv, v0=v0
            )
        n_converged = k
    except ArpackNoConvergence as err:
        values, vectors = err.eigenvalues, err.eigenvectors
        n_converged = len(values)
        if n_converged == 0:
            raise RuntimeError(
                f"Lanczos did not converge for any of the {k} requested eigenpairs "
                f"after {counting.n_products} GGN products; raise maxiter or tol."
            ) from None
        warnings.warn(
            f"Lanczos did not converge for {k - n_converged} of the {k} requested "
            f"eigenpairs ({counting.n_products} GGN products); keeping the "
            f"{n_converged} converged ones.",
            LanczosConvergenceWarning,
            stacklevel=3,
        )
    except ArpackError as err:
        if counting.all_zero:
            raise ValueError(_ZERO_GGN) from None
        raise RuntimeError(f"ARPACK failed on the GGN operator: {err}") from err
    order = np.argsort(values)[::-1]
    values = np.ascontiguousarray(values[order])
    vectors = np.ascontiguousarray(vectors[:, order])
    images = counting.matmat(vectors)  # residual check: one product with k columns
    as_torch = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    return (
        as_torch(values),
        as_torch(vectors),
        as_torch(images),
        counting.n_products,
        n_converged,
        counting.n_calls,
    )
