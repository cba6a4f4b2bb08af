"""ARPACK's implicitly restarted Lanczos (``scipy.sparse.linalg.eigsh``) on an operator.

The reference solver: one operator-vector product per Lanczos step, ``which='LA'``
(largest algebraic eigenvalues), with a random start drawn from the caller's
generator. The operator is wrapped so that every product is counted, scaled by
``scale`` and checked for non-finite values:

.. math::

    (s A)\\, u_j = \\lambda_j u_j , \\qquad j = 1, \\dots, k .

The residual check needs the images ``s A U`` of the Ritz vectors. ARPACK forms
``U = V S`` from its basis ``V``, and every basis vector is a combination of vectors
it multiplied, so for an operator whose products are a fixed function of stored data
(``record_bytes > 0``: the factored and Jacobian operators) the products are
recorded, ``X`` and ``Y = s A X``, and the images recombined from them,

.. math::

    U = X C + \\Delta , \\qquad s A U \\approx Y C ,

with ``C`` the least-squares coefficients, at no further product. Where the
recombination cannot vouch for its accuracy (``||Delta||`` or the amplification
``||C||`` too large, see :meth:`_ProductRecord.images`), where the record
would exceed ``record_bytes``, or for an operator that passes over the data per
product (curvlinops, streaming; data-parallel), the images are one fresh product
with ``k`` columns: only a fresh product sees products that change between passes
(a loader with random augmentation), which the large-residual warning reports.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigsh
from tqdm.auto import tqdm

from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.solvers.eigenpairs import ZERO_GGN, LanczosConvergenceWarning
from laplace_glas.curvature.solvers.threads import single_threaded_openblas

__all__ = ["solve_lanczos"]

_ROWS = 1 << 15  # rows per chunk of the record's tall-skinny products


class _ProductRecord:
    """The products ``y_i = s A x_i`` of a solve, kept up to ``limit_bytes``, and the
    images ``s A U`` recombined from them for ``U`` in the span of the ``x_i``.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self.inputs: list[np.ndarray] = []  # the x_i, (D,) each
        self.images_: list[np.ndarray] = []  # the y_i
        self.nbytes = 0
        self.active = self.limit_bytes > 0

    def add(self, X: np.ndarray, Y: np.ndarray) -> None:
        """Keep copies of the inputs ``X (D, m)`` and their images ``Y``, or stop
        (and free them) once the record would pass ``limit_bytes``.
        """
        if not self.active:
            return
        self.nbytes += X.nbytes + Y.nbytes
        if self.nbytes > self.limit_bytes:
            self.active, self.inputs, self.images_ = False, [], []
            return
        # rows of copies: ARPACK reuses its arrays
        self.inputs.extend(np.array(X.reshape(X.shape[0], -1).T))
        self.images_.extend(np.array(Y.reshape(Y.shape[0], -1).T))

    def _chunks(self, arrays: list[np.ndarray]):
        """``(start, rows (P, chunk))`` over row chunks of the recorded vectors."""
        D = arrays[0].shape[0]
        for start in range(0, D, _ROWS):
            yield start, torch.from_numpy(np.stack([a[start : start + _ROWS] for a in arrays]))

    def images(self, vectors: np.ndarray) -> np.ndarray | None:
        """``s A U`` for ``U = vectors (D, k)`` from the record, or ``None`` where the
        recombination's error could reach the residuals' scale.

        The least-squares coefficients ``C`` of ``U ~ X C`` come from the normal
        equations in float64 (``X^T X`` and ``X^T U`` accumulated over row chunks; a
        float32 record multiplies exactly in float64), solved through the eigenvectors
        of ``X^T X`` (directions below ``P eps`` of the largest singular value left
        out). Float32 products: the small float64 matrices give the miss
        ``||U - X C||^2 = ||U||^2 - 2 C^T X^T U + C^T X^T X C`` to about ``1e-16``, far
        below ``(100 eps)^2``; float64 products: ``C`` is refined once with the residual
        ``U - X C``, which is then measured row chunk by row chunk. Accepted when every
        column has ``||U - X C|| <= 100 eps`` (``eps`` of the products' dtype) and
        ``||C||_2 <= 100`` (the rounding of the recorded products, about
        ``eps ||s A||`` per column, grows at most that much), so that the images carry
        errors of the order of a fresh product's.
        """
        if not self.active or not self.inputs:
            return None
        P, (D, k) = len(self.inputs), vectors.shape
        U = torch.from_numpy(vectors)
        eps = float(torch.finfo(U.dtype).eps)
        gram = torch.zeros(P, P, dtype=torch.float64)
        B = torch.zeros(P, k, dtype=torch.float64)
        for start, Xc in self._chunks(self.inputs):
            Xc = Xc.double()
            gram += Xc @ Xc.T
            B += Xc @ U[start : start + _ROWS].double()
        values, Z = torch.linalg.eigh(gram)
        keep = values > values[-1] * (P * eps) ** 2
        values, Z = values[keep], Z[:, keep]
        solve = lambda rhs: Z @ ((Z.T @ rhs) / values[:, None])  # noqa: E731
        C = solve(B)
        if U.dtype == torch.float32:  # float64 resolves ||U - X C||^2 from the small matrices
            miss = (U.double() ** 2).sum(0) - 2 * (C * B).sum(0) + (C * (gram @ C)).sum(0)
        else:  # float64 products: refine once, then measure the miss row chunk by row chunk
            for refine in (True, False):
                correction = torch.zeros_like(C)
                miss = torch.zeros(k, dtype=torch.float64)
                for start, Xc in self._chunks(self.inputs):
                    E = U[start : start + _ROWS] - Xc.T @ C
                    correction += Xc @ E
                    miss += (E * E).sum(0)
                if refine:
                    C = C + solve(correction)
        if not (miss.max() <= (100 * eps) ** 2 and torch.linalg.matrix_norm(C, 2) <= 100):
            return None
        C = C.to(U.dtype)
        out = torch.empty(D, k, dtype=U.dtype)
        for start, Yc in self._chunks(self.images_):
            out[start : start + _ROWS] = Yc.T @ C
        return out.numpy()


class _CountingOperator(LinearOperator):
    """``scale * A`` for a SciPy operator ``A``, counting products and rejecting
    non-finite results.
    """

    def __init__(
        self,
        operator: LinearOperator,
        scale: float,
        on_product: Callable[[int], None] | None = None,
        record: _ProductRecord | None = None,
    ):
        super().__init__(dtype=operator.dtype, shape=operator.shape)
        self._operator = operator
        self._scale = scale
        self._on_product = on_product
        self.record = record
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
        return self._kept(x, self._record(self._operator.matvec(x), 1))

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        return self._kept(X, self._record(self._operator.matmat(X), X.shape[1]))

    def _kept(self, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        if self.record is not None:
            self.record.add(X, Y)
        return Y

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
    record_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """ARPACK on the SciPy operator; returns values, vectors, their images, products,
    converged count and operator calls (descending order). ``record_bytes > 0``: the
    images come from the solve's recorded products where they can (see the module),
    else from one fresh product with ``k`` columns.
    """
    D = operator.shape[0]
    np_dtype = NUMPY_DTYPES[dtype]
    scipy_operator = (
        operator.to_scipy(dtype=np_dtype) if hasattr(operator, "to_scipy") else operator
    )
    record = _ProductRecord(record_bytes) if record_bytes > 0 else None
    counting = _CountingOperator(scipy_operator, scale, on_product=pbar.update, record=record)
    v0 = torch.randn(D, generator=generator, dtype=torch.float64).numpy().astype(np_dtype)
    try:
        # ARPACK's own vector work (dots, axpys, re-orthogonalisation on D-vectors) on one
        # OpenBLAS thread: idle OpenBLAS workers spin between its many small calls and
        # take the cores from torch's threads computing the products (on 2 busy cores a
        # Lanczos fit ran 3x slower with two OpenBLAS threads).
        with single_threaded_openblas():
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
            raise ValueError(ZERO_GGN) from None
        raise RuntimeError(f"ARPACK failed on the GGN operator: {err}") from err
    order = np.argsort(values)[::-1]
    values = np.ascontiguousarray(values[order])
    vectors = np.ascontiguousarray(vectors[:, order])
    images = None if record is None else record.images(vectors)
    counting.record = record = None  # freed before a fresh product
    if images is None:  # residual check: one fresh product with k columns
        images = counting.matmat(vectors)
    as_torch = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    return (
        as_torch(values),
        as_torch(vectors),
        as_torch(images),
        counting.n_products,
        n_converged,
        counting.n_calls,
    )
