"""Block Krylov eigen-solver with Rayleigh-Ritz: many GGN columns per data pass.

ARPACK's Lanczos (``eigsh``) multiplies one vector at a time, so every product is a
full pass over the data. curvlinops' ``matmat`` pushes ``p`` columns through one pass
for little more than the cost of one (vmap over columns), so a block method that asks
for ``p`` columns at once needs far fewer passes. This module builds the block Krylov
space ``span{Q_0, G Q_0, G^2 Q_0, ...}`` with full re-orthogonalisation, keeping each
block's image ``G Q_i``; after every pass the Rayleigh-Ritz problem

.. math::

    T = Q^\\top (G Q), \\qquad T s_j = \\theta_j s_j, \\qquad x_j = Q s_j,

gives Ritz pairs whose residuals ``||G x_j - theta_j x_j|| = ||(G Q) s_j - theta_j Q s_j||``
cost no further products. The solve stops when the top-k relative residuals are below
``tol``; when the basis would exceed ``max_basis`` columns it is thick-restarted from the
leading Ritz vectors. Rank-deficient operators are fine: directions that vanish in the
orthogonalisation are dropped, and a residual below ``rank_threshold * theta_1`` (the
products' own round-off scale) counts as converged whatever the eigenvalue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BlockKrylovResult", "block_krylov_eigenpairs"]


@dataclass(frozen=True)
class BlockKrylovResult:
    """Leading Ritz pairs, their images and the cost of the solve."""

    values: torch.Tensor
    vectors: torch.Tensor
    images: torch.Tensor
    n_products: int
    n_passes: int
    converged: torch.Tensor


def _left_matmul(
    A: torch.Tensor, images: torch.Tensor, dtype: torch.dtype, step: int
) -> torch.Tensor:
    """``A @ images`` with ``images`` upcast to ``dtype`` one column block at a time."""
    return torch.cat(
        [A @ images[:, j : j + step].to(dtype) for j in range(0, images.shape[1], step)], dim=1
    )


def _right_matmul(
    images: torch.Tensor, S: torch.Tensor, dtype: torch.dtype, step: int
) -> torch.Tensor:
    """``images @ S`` with ``images`` upcast to ``dtype`` one column block at a time."""
    out = None
    for j in range(0, images.shape[1], step):
        part = images[:, j : j + step].to(dtype) @ S[j : j + step]
        out = part if out is None else out + part
    return out


def _orthonormalize(block: torch.Tensor, basis: torch.Tensor | None, drop: float) -> torch.Tensor:
    """Columns of ``block`` made orthonormal to ``basis`` and to each other.

    Two rounds of classical Gram-Schmidt against the basis, then a QR whose
    numerically dependent columns (``|R_ii| <= drop * max|R_ii|``) are dropped.
    """
    for _ in range(2):
        if basis is not None and basis.shape[1]:
            block = block - basis @ (basis.T @ block)
    if block.shape[1] == 0:
        return block
    Q, R = torch.linalg.qr(block)
    diag = R.diagonal().abs()
    scale = torch.linalg.vector_norm(block, dim=0).max().clamp(min=torch.finfo(block.dtype).tiny)
    keep = diag > drop * scale
    Q = Q[:, keep]
    if basis is not None and basis.shape[1] and Q.shape[1]:
        Q = Q - basis @ (basis.T @ Q)
        Q, _ = torch.linalg.qr(Q)
    return Q


def block_krylov_eigenpairs(
    matmat: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    k: int,
    *,
    block_size: int | None = None,
    max_basis: int | None = None,
    tol: float = 1e-5,
    max_passes: int = 50,
    rank_threshold: float = 1e-6,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    image_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> BlockKrylovResult:
    """Top-``k`` eigenpairs of a symmetric PSD operator given by ``matmat``.

    Parameters
    ----------
    matmat : callable
        ``V (dim, p) -> G V (dim, p)``; one call is one data pass.
    dim, k : int
        Operator size and number of eigenpairs (``1 <= k < dim``).
    block_size : int, optional
        Columns per pass ``p`` (default ``max(k, 8)``).
    max_basis : int, optional
        Largest basis before a thick restart (default ``max(2 k + p, 3 p)``, at most dim).
        Memory is about ``max_basis * dim`` numbers for the basis (in ``dtype``) plus as
        many for its images (in ``image_dtype``).
    tol : float
        Relative residual ``||G x - theta x|| / theta`` at which a pair is converged.
    max_passes : int
        Maximum number of ``matmat`` calls.
    rank_threshold : float
        Absolute residual floor ``rank_threshold * theta_1``: the products' own
        round-off (about ``eps * theta_1``) allows no better, so a pair also counts
        as converged once ``||r|| <= rank_threshold * theta_1``.
    generator : torch.Generator, optional
        Source of the random starting block.
    dtype, device :
        Precision and device of the basis (float64 is recommended: the basis is
        orthogonalised in it while products run in the operator's own precision).
    image_dtype : torch.dtype, optional
        Precision in which the images ``G Q`` are stored (default ``dtype``); the
        operator's own precision halves their memory without losing accuracy.

    """
    if not 1 <= k < dim:
        raise ValueError(f"Need 1 <= k < dim = {dim}, got k = {k}.")
    p = block_size or max(k, 8)
    p = min(p, dim)
    max_basis = min(dim, max_basis or max(2 * k + p, 3 * p))
    if max_basis < k + p:
        max_basis = min(dim, k + p)
    drop = 100 * torch.finfo(dtype).eps

    image_dtype = image_dtype or dtype
    start = torch.randn(dim, p, generator=generator, dtype=torch.float64).to(device, dtype)
    Q = _orthonormalize(start, None, drop)
    GQ = matmat(Q).to(image_dtype)
    n_products, n_passes = Q.shape[1], 1
    basis, images = Q, GQ
    while True:
        T = _left_matmul(basis.T, images, dtype, p)
        T = (T + T.T) / 2
        theta, S = torch.linalg.eigh(T)
        theta, S = theta.flip(0), S.flip(1)
        kk = min(k, theta.numel())
        X = basis @ S[:, :kk]
        GX = _right_matmul(images, S[:, :kk], dtype, p)
        residual = torch.linalg.vector_norm(GX - X * theta[:kk], dim=0)
        floor = rank_threshold * theta[0].clamp(min=0)
        converged = residual <= torch.maximum(tol * theta[:kk].abs(), floor)
        if (kk == k and bool(converged.all())) or n_passes >= max_passes:
            break
        # next block: the images of the newest block, orthogonalised against the basis
        new = _orthonormalize(images[:, -Q.shape[1] :].to(dtype), basis, drop)
        if new.shape[1] == 0:  # Krylov space exhausted (invariant subspace found)
            break
        if basis.shape[1] + new.shape[1] > max_basis:
            keep = min(theta.numel(), max(k + p, max_basis - new.shape[1]))
            basis = basis @ S[:, :keep]
            images = _right_matmul(images, S[:, :keep], dtype, p).to(image_dtype)
            new = _orthonormalize(new, basis, drop)
            if new.shape[1] == 0:
                break
        Q = new[:, :p]
        GQ = matmat(Q).to(image_dtype)
        n_products += Q.shape[1]
        n_passes += 1
        basis = torch.cat([basis, Q], dim=1)
        images = torch.cat([images, GQ], dim=1)
    return BlockKrylovResult(
        values=theta[:kk],
        vectors=X,
        images=GX,
        n_products=n_products,
        n_passes=n_passes,
        converged=converged,
    )
