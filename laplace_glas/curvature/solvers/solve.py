"""Leading eigenpairs of the mean-loss GGN, found matrix-free by Lanczos.

The operator is curvlinops' :class:`~curvlinops.GGNLinearOperator` of the *mean*
loss (:mod:`~laplace_glas.curvature.operators.curvlinops`) or one of GLAS's faster
operators; :func:`compute_eigenpairs` finds its top-k eigenpairs with ARPACK's Lanczos
(:mod:`~laplace_glas.curvature.solvers.lanczos`), block Krylov or the dual Gram solve

.. math::

    G u_j = \\lambda_j u_j, \\qquad
    G = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

without ever forming the D x D matrix. This module knows nothing of
laplace-torch. The record it returns,
:class:`~laplace_glas.curvature.solvers.eigenpairs.Eigenpairs`, and its warnings live in
:mod:`~laplace_glas.curvature.solvers.eigenpairs`.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
from curvlinops import GGNLinearOperator
from scipy.sparse.linalg import LinearOperator
from tqdm.auto import tqdm

from laplace_glas.curvature.memory.planner import choose_solver
from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.solvers.block_krylov import block_krylov_eigenpairs
from laplace_glas.curvature.solvers.eigenpairs import (
    ZERO_GGN,
    Eigenpairs,
    LanczosConvergenceWarning,
)
from laplace_glas.curvature.solvers.gram import dual_eigenpairs
from laplace_glas.curvature.solvers.lanczos import solve_lanczos

__all__ = ["compute_eigenpairs"]

FLOAT32_TOL = 1e-4
"""The default relative residual ``||G u - theta u|| <= tol theta`` of a float32 solve.

Below it the eigenvectors are limited by the float32 products' own rounding, not by
the solver: against a float64 fit of the fit-cost benchmark's classifier (10-300-300-10,
N = 2,000, k = 10) the float32 eigenvectors' span lay ``6e-4`` (sine) from the true one
at ``tol = 1e-7``, ``5e-4`` at ``1e-5`` and ``8e-4`` at ``1e-4``; the eigenvalues within
``7e-7`` and the 'glm' variances within ``7e-5`` at all three, while the products fell
from 60 through 44 to 36. It lies below the residual warning's level ``sqrt(eps)``.
"""


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
    ncv: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Block Krylov with ``block_size`` columns per data pass (basis in the model's dtype).

    One column per pass is Lanczos with full re-orthogonalisation that keeps every
    image ``G q_j``: its basis is ARPACK's (``ncv``, default ``max(2 k + 1, 20)``); it
    stops at the first pass whose top-``k`` residuals (from the kept images, no further
    product) are below ``tol``, or have stopped falling below the products' round-off
    (:func:`~laplace_glas.curvature.solvers.block_krylov.block_krylov_eigenpairs`).
    """

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
        tol = FLOAT32_TOL if dtype == torch.float32 else 1e-8
    D, max_basis = operator.shape[0], None
    if block_size == 1:  # Lanczos: ARPACK's basis (at least k + 2: a restart adds one)
        max_basis = min(D, max(ncv or max(2 * k + 1, 20), k + 2))
    result = block_krylov_eigenpairs(
        matmat,
        D,
        k,
        block_size=block_size,
        max_basis=max_basis,
        tol=tol,
        # default: as many products as 50 passes of the default block (one-column
        # passes, the linearised operator's Lanczos, get 50 * max(k, 8) passes)
        max_passes=50 * -(-max(k, 8) // (block_size or max(k, 8))) if maxiter is None else maxiter,
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


def _lanczos_tol(tol: float, dtype: torch.dtype) -> float:
    """ARPACK's ``tol`` for the requested one: ``0`` is machine precision in float64 and
    :data:`FLOAT32_TOL` in float32, where the products' own rounding (about
    ``1e-6 lambda_1``) lies above machine precision and a tighter target only buys
    restarts that cannot improve the pairs (the eigenvalues' error is about the squared
    residual over the gap; the mlp16k benchmark's 10 pairs took 28 products at ARPACK's
    float32 machine precision, 22 at ``1e-5``, with the same eigenvalues to 3e-7).
    """
    if tol > 0:
        return tol
    return FLOAT32_TOL if dtype == torch.float32 else 0.0


def _record_bytes(operator: GGNLinearOperator | LinearOperator, dtype: torch.dtype) -> int:
    """Bytes Lanczos may keep of its products to recombine the residual check's images
    from them (:mod:`~laplace_glas.curvature.solvers.lanczos`): for the factored and
    Jacobian operators, whose products are fixed functions of their stored factors,
    the temporaries the budget allows a product (``2 s chunk_elements``);
    0 (a fresh product) for operators that pass over the data per product.
    """
    if not isinstance(operator, FactoredGGN):
        return 0
    return 2 * torch.finfo(dtype).bits // 8 * int(operator.chunk_elements)


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


def _checked_solver(operator: GGNLinearOperator | LinearOperator, k: int, solver: str) -> str:
    """The solver for ``k`` pairs of ``operator`` (``'auto'`` resolved), after checking
    ``k`` and the solver.
    """
    shape = getattr(operator, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != shape[1]:
        raise TypeError(
            "operator must be a square linear operator (a curvlinops / SciPy operator, "
            f"FactoredGGN, LinearizedGGN or a square tensor), got {type(operator).__name__}."
        )
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
    return solver


def _thresholded(
    raw: torch.Tensor, residual_norms: torch.Tensor, rank_threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Relative residuals (``inf`` at zero), the mask below ``rank_threshold * lambda_1``,
    the eigenvalues with those set to zero, and ``lambda_1`` (clamped at zero).
    """
    residuals = residual_norms / raw.abs()
    residuals = torch.where(raw.abs() > 0, residuals, torch.full_like(raw, float("inf")))
    top = raw[0].clamp(min=0)
    below = raw <= rank_threshold * top
    cleaned = torch.where(below, torch.zeros_like(raw), raw)
    return residuals, below, cleaned, top


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
        Relative accuracy; ``0`` means :data:`FLOAT32_TOL` (``1e-4``) in float32, and in
        float64 machine precision for Lanczos, ``1e-8`` for the block solver.
    maxiter : int, optional
        Lanczos: ARPACK's maximum number of restarts (default ``10 * D``); block:
        maximum number of data passes (default 50 passes of ``max(k, 8)`` columns,
        ``50 * ceil(max(k, 8) / block_size)``).
    ncv : int, optional
        Lanczos basis size (default ``min(D, max(2k + 1, 20))``); also the basis of the
        block solver with ``block_size=1``.
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
        by :func:`laplace_glas.curvature.memory.planner.choose_solver`.
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
    solver = _checked_solver(operator, k, solver)
    if operator_name is None:
        operator_name = {
            "FactoredGGN": "factored",
            "JacobianGGN": "jacobian",
            "LinearizedGGN": "linearised",
        }.get(type(operator).__name__, "curvlinops")
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
            raw, U, GU, n_products, n_converged, n_passes = solve_lanczos(
                operator, k, scale, dtype, _lanczos_tol(tol, dtype), maxiter, ncv, generator, pbar,
                record_bytes=_record_bytes(operator, dtype),
            )  # fmt: skip
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
                ncv,
            )
    finally:
        pbar.close()
    wall_time = time.perf_counter() - start
    if solver != "dual":  # the dual solve returns its residuals (no D-space product)
        # Lanczos results arrive on the host (ARPACK); the block solver's stay on ``device``
        raw, U, GU = (t.to(device) for t in (raw, U, GU))
    if not raw[0] > 0:
        raise ValueError(ZERO_GGN)
    if solver != "dual":
        residual_norms = torch.linalg.vector_norm(GU - U * raw, dim=0)
    residuals, below, cleaned, top = _thresholded(raw, residual_norms, rank_threshold)
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
