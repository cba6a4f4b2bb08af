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
from scipy.sparse.linalg import ArpackError, ArpackNoConvergence, LinearOperator, eigsh
from torch import nn
from tqdm.auto import tqdm

from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.planner import choose_solver
from laplace_glas.curvature.solvers.block_krylov import block_krylov_eigenpairs
from laplace_glas.curvature.solvers.gram import dual_eigenpairs

__all__ = [
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "NumericalRankWarning",
    "compute_eigenpairs",
    "mean_ggn_operator",
]


class LanczosConvergenceWarning(UserWarning):
    """The eigen-solve stopped before all requested eigenpairs converged, or its final
    residuals exceed the tolerance (e.g. a loader whose data changes between passes).
    """


_ZERO_GGN = (
    "The GGN is zero at these weights: the model's outputs do not depend on the "
    "parameters under inference (or all their gradients vanish, e.g. saturated or dead "
    "units). There is no curvature to build a posterior from."
)


class NumericalRankWarning(UserWarning):
    """Some eigenvalues are below what the operator's precision can resolve."""


@dataclass(frozen=True)
class Eigenpairs:
    """Immutable record of an eigen-solve of a symmetric PSD operator.

    In a fitted ``ActiveSubspaceLaplace`` (``la.lanczos_info``) the operator is the
    unit-noise GGN ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n`` (``Lambda = I`` for
    regression); ``la.eigenvalues`` is ``values / sigma^2``.

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
        Name of the solver (``'lanczos'``, ``'block'`` or ``'dual'``, the Gram solve).
    n_passes : int
        Operator calls, i.e. passes over the data (a ``matmat`` with many columns is
        one pass), including the residual check. The factored operator needs one
        data pass in all, to build its factors; its calls are counted all the same.
    operator : str
        ``'curvlinops'``, ``'factored'``, or ``'curvlinops (not factored: why)'``.

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
    n_passes: int = 0
    operator: str = "curvlinops"

    @property
    def k(self) -> int:
        """Number of eigenpairs held."""
        return int(self.values.numel())

    def __repr__(self) -> str:
        """One line: sizes, eigenvalue range and cost, no tensor contents."""
        if self.k == 0:
            spectrum = "no eigenvalues"
        else:
            spectrum = (
                f"eigenvalues [{float(self.values.min()):.4g}, {float(self.values.max()):.4g}]"
            )
        finite = self.residuals[torch.isfinite(self.residuals)]
        residual = f"{float(finite.max()):.2g}" if finite.numel() else "n/a"
        return (
            f"Eigenpairs(k={self.k}, D={self.vectors.shape[0]}, dtype={self.vectors.dtype}, "
            f"solver={self.solver!r}, {spectrum}, {int(self.below_threshold.sum())} below "
            f"threshold, {self.n_products} products, {self.n_passes} passes, "
            f"max residual {residual}, {self.wall_time:.3g} s)"
        )

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
            "n_passes": int(self.n_passes),
            "operator": str(self.operator),
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


def mean_ggn_operator(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
    progress_bar: bool = False,
) -> GGNLinearOperator:
    """Curvlinops' GGN operator of a loss, without its determinism probe.

    ``reduction='mean'`` gives the GGN of the mean loss over ``num_data`` points;
    ``reduction='sum'`` the GGN of the summed loss, which the caller scales by one
    over the number of likelihood terms (e.g. tokens) to get the mean-loss GGN.
    ``check_deterministic`` is switched off: it costs two gradient passes and two
    products and rejects shuffled loaders; the model must be in eval mode instead.
    """
    if getattr(loss_func, "reduction", None) not in ("mean", "sum"):
        raise ValueError("The loss needs a `reduction` attribute, 'mean' or 'sum'.")
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


def _solve_lanczos(
    operator: GGNLinearOperator | LinearOperator,
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
        values, vectors = eigsh(counting, k=k, which="LA", tol=tol, maxiter=maxiter, ncv=ncv, v0=v0)
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


def _solve_block(
    operator: GGNLinearOperator | LinearOperator,
    k: int,
    scale: float,
    dtype: torch.dtype,
    device: torch.device | str,
    tol: float,
    maxiter: int | None,
    block_size: int | None,
    rank_threshold: float,
    generator: torch.Generator | None,
    pbar: tqdm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Block Krylov with ``block_size`` columns per data pass (basis in the model's dtype)."""

    def matmat(V: torch.Tensor) -> torch.Tensor:
        """``scale * G V`` in the model's precision (the solver stores images in it)."""
        if hasattr(operator, "to_scipy") or hasattr(operator, "matmat_torch"):  # stay in torch
            GV = operator @ V.to(dtype)
        else:
            GV = torch.as_tensor(operator.matmat(V.cpu().numpy().astype(NUMPY_DTYPES[dtype])))
        GV = GV.to(device=V.device, dtype=dtype).mul_(scale)
        pbar.update(V.shape[1])
        if not torch.isfinite(GV).all():
            raise FloatingPointError(
                "A GGN-vector product returned NaN or inf. Check the model's outputs "
                "and the training data for non-finite values."
            )
        return GV

    # the basis is orthogonalised in the products' own precision: float64 would only
    # refine directions the float32 products cannot resolve, at twice the cost
    basis_dtype = dtype
    if tol <= 0:
        tol = 1e-5 if dtype == torch.float32 else 1e-8
    result = block_krylov_eigenpairs(
        matmat,
        operator.shape[0],
        k,
        block_size=block_size,
        tol=tol,
        max_passes=50 if maxiter is None else maxiter,
        rank_threshold=rank_threshold,
        generator=generator,
        dtype=basis_dtype,
        image_dtype=dtype,
        device=device,
    )
    n_converged = int(result.converged.sum())
    if result.values.numel() < k:
        warnings.warn(
            f"The block solver found only {result.values.numel()} of the {k} requested "
            f"eigenpairs in {result.n_passes} data passes ({result.n_products} GGN "
            f"products; {n_converged} of them converged): raise maxiter or block_size.",
            LanczosConvergenceWarning,
            stacklevel=3,
        )
    elif n_converged < k:
        warnings.warn(
            f"The block solver did not converge for {k - n_converged} of the {k} "
            f"requested eigenpairs in {result.n_passes} data passes "
            f"({result.n_products} GGN products); their residuals are reported.",
            LanczosConvergenceWarning,
            stacklevel=3,
        )
    return (
        result.values.to(dtype),
        result.vectors.to(dtype),
        result.images.to(dtype),
        result.n_products,
        n_converged,
        result.n_passes,
    )


def _warn_large_residuals(
    residuals: torch.Tensor, below: torch.Tensor, tol: float, dtype: torch.dtype
) -> None:
    """Warn when pairs the solver called converged have ``||G u - lambda u|| / lambda_1``
    above ``max(tol, sqrt(eps))``.

    Measured against ``lambda_1`` so that round-off of small eigenvalues (relative
    error ``eps * lambda_1 / lambda_j``) does not trigger it; a converged solve of a
    fixed operator stays orders of magnitude below. Large residuals mean the operator
    changed between products: a loader that reshuffles with ``drop_last``, draws
    random augmentations, or a model with randomness in eval mode.
    """
    limit = max(tol, float(torch.finfo(dtype).eps) ** 0.5)
    worst = torch.where(below, torch.zeros_like(residuals), residuals)
    if bool((worst > limit).any()):
        j = int(worst.argmax())
        warnings.warn(
            f"The eigen-solve's final residuals ||G u_j - lambda_j u_j|| / lambda_1 reach "
            f"{float(worst[j]):.2g} (pair {j + 1}), above the tolerance {limit:.1g}, although "
            "the solver reported convergence: the GGN products were not reproducible. "
            "Check that the loader yields the same data on every pass (no random "
            "augmentation or reshuffling with drop_last) and that the model is "
            "deterministic in eval mode.",
            LanczosConvergenceWarning,
            stacklevel=3,
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
    solver: str = "lanczos",
    block_size: int | None = None,
    operator_name: str | None = None,
) -> Eigenpairs:
    """Top-``k`` eigenpairs of ``scale * operator``.

    Parameters
    ----------
    operator : GGNLinearOperator, FactoredGGN, LinearizedGGN or scipy LinearOperator
        Symmetric PSD operator of size ``D``; a curvlinops operator is converted with
        ``to_scipy(dtype)`` so that ARPACK runs in the model's precision. A
        :class:`~laplace_glas.curvature.operators.factored.FactoredGGN` also serves the dual solve.
    k : int
        Number of eigenpairs, ``1 <= k < D`` (ARPACK's limit).
    scale : float
        Factor applied to every product (e.g. ``C / 2`` turns the GGN of
        ``MSELoss(reduction='mean')`` into the unit-noise Gaussian GGN).
    dtype, device : torch.dtype, torch.device
        Precision of the products and of the returned tensors, and their device.
    tol : float
        Relative accuracy; ``0`` means machine precision of ``dtype`` for Lanczos
        and ``1e-5`` (float32) / ``1e-8`` (float64) for the block solver.
    maxiter : int, optional
        Lanczos: ARPACK's maximum number of restarts (default ``10 * D``); block:
        maximum number of data passes (default 50).
    ncv : int, optional
        Lanczos basis size (default ``min(D, max(2k + 1, 20))``).
    generator : torch.Generator, optional
        Source of the random start vector(s); the solve is deterministic given it.
    rank_threshold : float, optional
        Eigenvalues below ``rank_threshold * lambda_1`` are reported in
        ``below_threshold`` and set to zero. Default ``100 * eps(dtype)``.
    n_data : int
        Recorded in the result (the number of points the operator averages over).
    progress_bar : bool
        Show a ``tqdm`` counter of operator products.
    solver : {'lanczos', 'block', 'dual', 'auto'}
        ``'lanczos'``: ARPACK's implicitly restarted Lanczos (``eigsh``), one vector
        per product, the reference. ``'block'``: block Krylov with Rayleigh-Ritz
        (:mod:`laplace_glas.curvature.solvers.block_krylov`), ``block_size`` vectors per data pass.
        ``'dual'``: eigen-solve of the Gram matrix ``K = S S^T`` of a factored
        operator (:mod:`laplace_glas.curvature.solvers.gram`). ``'auto'``: dual or Lanczos
        by :func:`laplace_glas.curvature.planner.choose_solver`.
    block_size : int, optional
        Columns per pass of the block solver (default ``max(k, 8)``).
    operator_name : str, optional
        Recorded as ``Eigenpairs.operator`` (default: ``'factored'`` or
        ``'curvlinops'`` from the operator's type).

    Returns
    -------
    Eigenpairs

    Raises
    ------
    ValueError
        If ``k`` is outside ``[1, D - 1]`` or the solver is unknown.
    FloatingPointError
        If a product is not finite.
    RuntimeError
        If Lanczos converged for not a single eigenpair.

    """
    D = operator.shape[0]
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}.")
    if k < 1 or k >= D:
        raise ValueError(
            f"k={k} eigenpairs requested from a {D}-dimensional operator: Lanczos "
            f"(scipy eigsh) needs 1 <= k < D = {D}."
        )
    if solver not in ("lanczos", "block", "dual", "auto"):
        raise ValueError(f"solver must be 'lanczos', 'block', 'dual' or 'auto', got {solver!r}.")
    if solver == "auto":
        solver = choose_solver(operator, k)
    if solver == "dual" and not isinstance(operator, FactoredGGN):
        raise ValueError("solver='dual' needs a FactoredGGN operator.")
    if operator_name is None:
        operator_name = {"FactoredGGN": "factored", "LinearizedGGN": "linearised"}.get(
            type(operator).__name__, "curvlinops"
        )
    if rank_threshold is None:
        rank_threshold = 100.0 * torch.finfo(dtype).eps
    pbar = tqdm(desc="[GLAS] GGN products", unit="prod", disable=not progress_bar)
    start = time.perf_counter()
    try:
        if solver == "dual":
            raw, U, residual_norms, n_products, n_converged, n_passes = dual_eigenpairs(
                operator,
                k,
                dtype=dtype,
                device=device,
                tol=tol,
                generator=generator,
                rank_threshold=rank_threshold,
            )
            pbar.update(n_products)
        elif solver == "lanczos":
            raw, U, GU, n_products, n_converged, n_passes = _solve_lanczos(
                operator, k, scale, dtype, tol, maxiter, ncv, generator, pbar
            )
        else:
            raw, U, GU, n_products, n_converged, n_passes = _solve_block(
                operator,
                k,
                scale,
                dtype,
                device,
                tol,
                maxiter,
                block_size,
                rank_threshold,
                generator,
                pbar,
            )
    finally:
        pbar.close()
    wall_time = time.perf_counter() - start
    if solver != "dual":  # the dual solve returns its residuals (no D-space product)
        # Lanczos results arrive on the host (ARPACK); the block solver's stay on ``device``
        raw, U, GU = (t.to(device) for t in (raw, U, GU))
    if not raw[0] > 0:
        raise ValueError(_ZERO_GGN)
    if solver != "dual":
        residual_norms = torch.linalg.vector_norm(GU - U * raw, dim=0)
    residuals = residual_norms / raw.abs()
    residuals = torch.where(raw.abs() > 0, residuals, torch.full_like(raw, float("inf")))
    top = raw[0].clamp(min=0)
    below = raw <= rank_threshold * top
    cleaned = torch.where(below, torch.zeros_like(raw), raw)
    if n_converged == k:
        _warn_large_residuals(residual_norms / top, below, tol, dtype)
    return Eigenpairs(
        values=cleaned,
        vectors=U,
        residuals=residuals,
        below_threshold=below,
        raw_values=raw,
        n_products=int(n_products),
        n_requested=int(k),
        n_converged=int(n_converged),
        wall_time=float(wall_time),
        n_data=int(n_data),
        rank_threshold=float(rank_threshold),
        solver=solver,
        n_passes=int(n_passes),
        operator=operator_name,
    )
