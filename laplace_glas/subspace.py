"""Leading eigenpairs of the mean-loss GGN, found matrix-free by Lanczos.

The operator is curvlinops' :class:`~curvlinops.GGNLinearOperator` of the *mean*
loss, wrapped as a SciPy ``LinearOperator``; ``scipy.sparse.linalg.eigsh``
(implicitly restarted Lanczos, ARPACK) finds its top-k eigenpairs

.. math::

    G u_j = \\lambda_j u_j, \\qquad
    G = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

without ever forming the D x D matrix. This module knows nothing of
laplace-torch; it takes a model, a loss and an iterable of ``(X, y)`` batches.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from curvlinops import GGNLinearOperator
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
from torch import nn
from tqdm.auto import tqdm

__all__ = [
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "NumericalRankWarning",
    "compute_eigenpairs",
    "mean_ggn_operator",
]

_TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


class LanczosConvergenceWarning(UserWarning):
    """Lanczos (ARPACK) stopped before all requested eigenpairs converged."""


class NumericalRankWarning(UserWarning):
    """Some eigenvalues are below what the operator's precision can resolve."""


@dataclass(frozen=True)
class Eigenpairs:
    """Immutable record of an eigen-solve of a symmetric PSD operator.

    Attributes
    ----------
    values : torch.Tensor
        ``(k,)`` eigenvalues, descending. Values below ``rank_threshold`` are set to
        zero (they are round-off, not curvature); see ``below_threshold``.
    vectors : torch.Tensor
        ``(D, k)`` orthonormal eigenvectors, column ``j`` belongs to ``values[j]``.
    residuals : torch.Tensor
        ``(k,)`` relative residuals ``||G u_j - lambda_j u_j|| / lambda_j`` of the raw
        Ritz pairs (``inf`` where ``lambda_j`` is zero).
    below_threshold : torch.Tensor
        ``(k,)`` bool mask of the eigenpairs whose raw eigenvalue fell below
        ``rank_threshold * lambda_1``.
    raw_values : torch.Tensor
        ``(k,)`` the Ritz values as returned by the solver (descending).
    n_products : int
        Operator-vector products spent (a matrix product with m columns counts m),
        including the ``k`` products of the residual check.
    n_requested : int
        The number of eigenpairs asked for.
    n_converged : int
        The number of eigenpairs the solver reported as converged.
    wall_time : float
        Seconds spent in the solve and the residual check.
    n_data : int
        Number of data points the operator averaged over.
    rank_threshold : float
        Relative threshold used for ``below_threshold``.
    solver : str
        Name of the solver (``'lanczos'``).

    """

    values: torch.Tensor
    vectors: torch.Tensor
    residuals: torch.Tensor
    below_threshold: torch.Tensor
    raw_values: torch.Tensor
    n_products: int
    n_requested: int
    n_converged: int
    wall_time: float
    n_data: int
    rank_threshold: float
    solver: str = "lanczos"

    @property
    def k(self) -> int:
        """Number of eigenpairs held."""
        return int(self.values.numel())

    def truncate(self, k: int) -> Eigenpairs:
        """The leading ``k`` eigenpairs, without recomputing anything."""
        if not 1 <= k <= self.k:
            raise ValueError(f"Cannot truncate {self.k} eigenpairs to k={k}.")
        return replace(
            self,
            values=self.values[:k],
            vectors=self.vectors[:, :k],
            residuals=self.residuals[:k],
            below_threshold=self.below_threshold[:k],
            raw_values=self.raw_values[:k],
        )

    def to(self, device: torch.device | str | None = None, dtype=None) -> Eigenpairs:
        """Move the tensors (mask excluded from the dtype change)."""
        return replace(
            self,
            values=self.values.to(device=device, dtype=dtype),
            vectors=self.vectors.to(device=device, dtype=dtype),
            residuals=self.residuals.to(device=device, dtype=dtype),
            raw_values=self.raw_values.to(device=device, dtype=dtype),
            below_threshold=self.below_threshold.to(device=device),
        )

    def to_dict(self) -> dict:
        """Plain-dict form (tensors and Python scalars only; safe for
        ``torch.load(weights_only=True)``).
        """
        return {
            "values": self.values,
            "vectors": self.vectors,
            "residuals": self.residuals,
            "below_threshold": self.below_threshold,
            "raw_values": self.raw_values,
            "n_products": int(self.n_products),
            "n_requested": int(self.n_requested),
            "n_converged": int(self.n_converged),
            "wall_time": float(self.wall_time),
            "n_data": int(self.n_data),
            "rank_threshold": float(self.rank_threshold),
            "solver": str(self.solver),
        }

    @classmethod
    def from_dict(cls, state: dict) -> Eigenpairs:
        """Inverse of :meth:`to_dict`."""
        return cls(**state)


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

    def _record(self, result: np.ndarray, n_columns: int) -> np.ndarray:
        self.n_products += n_columns
        if self._on_product is not None:
            self._on_product(n_columns)
        if not np.all(np.isfinite(result)):
            raise FloatingPointError(
                "A GGN-vector product returned NaN or inf. Check the model's outputs "
                "and the training data for non-finite values."
            )
        return self._scale * result

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._record(self._operator.matvec(x), 1)

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        return self._record(self._operator.matmat(X), X.shape[1])

    def _adjoint(self) -> _CountingOperator:
        return self


def mean_ggn_operator(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
    progress_bar: bool = False,
) -> GGNLinearOperator:
    """Curvlinops' GGN operator of the mean loss, without its determinism probe.

    ``check_deterministic`` is switched off: it costs two gradient passes and two
    products and rejects shuffled loaders; the model must be in eval mode instead.
    """
    if getattr(loss_func, "reduction", None) != "mean":
        raise ValueError("The GLAS operator is the GGN of the MEAN loss.")
    return GGNLinearOperator(
        model,
        loss_func,
        list(params),
        data,
        progressbar=progress_bar,
        check_deterministic=False,
        num_data=num_data,
        batch_size_fn=batch_size_fn,
    )


def compute_eigenpairs(
    operator: GGNLinearOperator | LinearOperator,
    k: int,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tol: float = 0.0,
    maxiter: int | None = None,
    ncv: int | None = None,
    generator: torch.Generator | None = None,
    rank_threshold: float | None = None,
    n_data: int = 0,
    progress_bar: bool = False,
) -> Eigenpairs:
    """Top-``k`` eigenpairs of ``scale * operator`` by ``eigsh(which='LA')``.

    Parameters
    ----------
    operator : GGNLinearOperator or scipy.sparse.linalg.LinearOperator
        Symmetric PSD operator of size ``D``; a curvlinops operator is converted with
        ``to_scipy(dtype)`` so that ARPACK runs in the model's precision.
    k : int
        Number of eigenpairs, ``1 <= k < D`` (ARPACK's limit).
    scale : float
        Factor applied to every product (e.g. ``C / 2`` turns the GGN of
        ``MSELoss(reduction='mean')`` into the unit-noise Gaussian GGN).
    dtype, device : torch.dtype, torch.device
        Precision of the solve and of the returned tensors, and their device.
    tol : float
        ARPACK's relative accuracy; ``0`` means machine precision of ``dtype``.
    maxiter : int, optional
        ARPACK's maximum number of restarts (default ``10 * D``).
    ncv : int, optional
        Lanczos basis size (default ``min(D, max(2k + 1, 20))``).
    generator : torch.Generator, optional
        Source of the random start vector; the solve is deterministic given it.
    rank_threshold : float, optional
        Eigenvalues below ``rank_threshold * lambda_1`` are reported in
        ``below_threshold`` and set to zero. Default ``100 * eps(dtype)``.
    n_data : int
        Recorded in the result (the number of points the operator averages over).
    progress_bar : bool
        Show a ``tqdm`` counter of operator products.

    Returns
    -------
    Eigenpairs

    Raises
    ------
    ValueError
        If ``k`` is outside ``[1, D - 1]``.
    FloatingPointError
        If a product is not finite.
    RuntimeError
        If not a single eigenpair converged.

    """
    D = operator.shape[0]
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}.")
    if k < 1 or k >= D:
        raise ValueError(
            f"k={k} eigenpairs requested from a {D}-dimensional operator: Lanczos "
            f"(scipy eigsh) needs 1 <= k < D = {D}."
        )
    np_dtype = _TORCH_TO_NUMPY[dtype]
    scipy_operator = (
        operator.to_scipy(dtype=np_dtype) if hasattr(operator, "to_scipy") else operator
    )
    pbar = tqdm(desc="[GLAS] GGN products", unit="prod", disable=not progress_bar)
    counting = _CountingOperator(scipy_operator, scale, on_product=pbar.update)

    v0 = torch.randn(D, generator=generator, dtype=torch.float64).numpy()
    start = time.perf_counter()
    try:
        values, vectors = eigsh(
            counting, k=k, which="LA", tol=tol, maxiter=maxiter, ncv=ncv, v0=v0.astype(np_dtype)
        )
        n_converged = k
    except ArpackNoConvergence as err:
        values, vectors = err.eigenvalues, err.eigenvectors
        n_converged = len(values)
        if n_converged == 0:
            pbar.close()
            raise RuntimeError(
                f"Lanczos did not converge for any of the {k} requested eigenpairs "
                f"after {counting.n_products} GGN products; raise maxiter or tol."
            ) from None
        warnings.warn(
            f"Lanczos did not converge for {k - n_converged} of the {k} requested "
            f"eigenpairs ({counting.n_products} GGN products); keeping the "
            f"{n_converged} converged ones.",
            LanczosConvergenceWarning,
            stacklevel=2,
        )
    order = np.argsort(values)[::-1]
    values = np.ascontiguousarray(values[order])
    vectors = np.ascontiguousarray(vectors[:, order])

    # residual check: one product with all k columns
    products = counting.matmat(vectors)
    pbar.close()
    wall_time = time.perf_counter() - start

    raw = torch.as_tensor(values, dtype=dtype)
    U = torch.as_tensor(vectors, dtype=dtype)
    GU = torch.as_tensor(products, dtype=dtype)
    residual_norms = torch.linalg.vector_norm(GU - U * raw, dim=0)
    residuals = residual_norms / raw.abs()
    residuals = torch.where(raw.abs() > 0, residuals, torch.full_like(raw, float("inf")))

    if rank_threshold is None:
        rank_threshold = 100.0 * torch.finfo(dtype).eps
    top = raw[0].clamp(min=0)
    below = raw <= rank_threshold * top
    cleaned = torch.where(below, torch.zeros_like(raw), raw)
    return Eigenpairs(
        values=cleaned.to(device),
        vectors=U.to(device),
        residuals=residuals.to(device),
        below_threshold=below.to(device),
        raw_values=raw.to(device),
        n_products=int(counting.n_products),
        n_requested=int(k),
        n_converged=int(n_converged),
        wall_time=float(wall_time),
        n_data=int(n_data),
        rank_threshold=float(rank_threshold),
    )
