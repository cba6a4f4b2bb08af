"""The Krylov basis of the block solver: its vectors and their images in preallocated,
column-major buffers, and the tall-skinny products on them.

``KrylovBasis`` keeps ``Q`` (orthonormal columns), ``G Q`` and the projected
operator ``T = Q^T G Q``; the products with small matrices (Rayleigh-Ritz, the
residuals, a thick restart) run over row chunks of the buffers (in ``dtype``, upcast
chunk by chunk where the images are stored in a lower precision), so that their
temporaries are a few MB. ``estimated_residuals`` gives the residuals of the Ritz
pairs from the newest block alone, through the Krylov relation
(:mod:`~laplace_glas.curvature.solvers.block_krylov` uses it between its exact checks).
"""

from __future__ import annotations

import torch

from laplace_glas.curvature.solvers.threads import eigh_threads

__all__ = ["KrylovBasis", "estimated_residuals", "unit_strides", "upcast_product"]

_ROWS = 1 << 15  # rows per chunk of the tall-skinny products: temporaries of ~MBs


def _cross(A: torch.Tensor, B: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``A^T B`` accumulated in ``dtype`` over row chunks (both upcast chunk by chunk;
    one product where neither needs it).
    """
    if A.dtype == B.dtype == dtype:
        return A.T @ B
    out = torch.zeros(A.shape[1], B.shape[1], dtype=dtype, device=A.device)
    for r in range(0, A.shape[0], _ROWS):
        out.addmm_(A[r : r + _ROWS].to(dtype).T, B[r : r + _ROWS].to(dtype))
    return out


def upcast_product(
    A: torch.Tensor, S: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``A @ S`` with ``A`` upcast to ``dtype`` row chunk by row chunk.

    ``out`` may overlap ``A``'s leading columns (``out = A[:, :S.shape[1]]``, the thick
    restart): each row chunk is read completely before it is written. A column-major
    ``out`` (the basis' buffers) gets each chunk as the rows of its transpose, so that
    the writes run along its vectors.
    """
    if out is None:
        if A.dtype == dtype:
            return A @ S
        out = torch.empty(A.shape[0], S.shape[1], dtype=dtype, device=A.device)
    column_major = out.shape[1] > 1 and out.stride(0) == 1
    for r in range(0, A.shape[0], _ROWS):
        if column_major:
            out.T[:, r : r + _ROWS] = S.T @ A[r : r + _ROWS].to(dtype).T
        else:
            out[r : r + _ROWS] = A[r : r + _ROWS].to(dtype) @ S
    return out


def _residual_norms(
    basis: torch.Tensor, images: torch.Tensor, S: torch.Tensor, theta: torch.Tensor
) -> torch.Tensor:
    """``||G x_j - theta_j x_j||`` for the Ritz pairs ``x_j = basis s_j``, accumulated
    over row chunks (the Ritz vectors are never formed here).
    """
    squares = torch.zeros(S.shape[1], dtype=S.dtype, device=S.device)
    for r in range(0, basis.shape[0], _ROWS):
        x = basis[r : r + _ROWS].to(S.dtype) @ S
        gx = images[r : r + _ROWS].to(S.dtype) @ S
        squares += gx.sub_(x.mul_(theta)).square_().sum(0)
    return squares.sqrt()


def estimated_residuals(W: torch.Tensor, S_newest: torch.Tensor) -> torch.Tensor:
    """``||W s_j||`` for ``W = (I - Q Q^T) G Q_new``, the newest block's images less
    their components in the basis, and ``s_j`` the Ritz coefficients of that block
    (``S_newest``, its rows of ``S``).

    Every older image lies in the basis' span (each was the seed of a later block, or,
    after a thick restart, ``G X = X Theta + W_old s^T`` with ``W_old``'s directions
    appended), so ``G x_j - theta_j x_j = (I - Q Q^T) G Q s_j = W s_j``: the Krylov
    relation, as ARPACK's residual estimates, to round-off and without reading the basis.
    """
    S_newest = S_newest.to(torch.float64)
    # an estimate: the products' dtype suffices (torch's (1 x D) @ (D x 1) is a slow GEMM)
    gram = (W * W).sum(0, keepdim=True) if W.shape[1] == 1 else W.T @ W
    gram = gram.to(torch.float64)
    return (S_newest * (gram @ S_newest)).sum(0).clamp(min=0).sqrt().to(W.dtype)


def unit_strides(block: torch.Tensor) -> torch.Tensor:
    """``block``; a single column ``(D, 1)`` as a view strided as a contiguous one (torch's
    copy and QR take a slow path on a column strided as in a column-major matrix, as
    LAPACK's ``Q`` is: 96,610 x 1 float32, a copy 417 against 13 us, a QR 463 against 35).
    """
    return block.reshape(-1).unsqueeze(1) if block.shape[1] == 1 else block


class KrylovBasis:
    """The basis ``Q``, its images ``G Q`` and ``T = Q^T G Q`` in preallocated buffers
    of ``max_basis`` columns; ``m`` columns are in use.
    """

    def __init__(
        self,
        dim: int,
        max_basis: int,
        dtype: torch.dtype,
        image_dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.dtype, self.image_dtype = dtype, image_dtype
        # column-major, each vector contiguous: products with a few columns read them
        # 2-3x faster (96,610 x 21 float32 on 2 cores: Q^T x 121 against 364 us)
        self.basis = torch.empty(max_basis, dim, dtype=dtype, device=device).T
        self.images = torch.empty(max_basis, dim, dtype=image_dtype, device=device).T
        self.T = torch.zeros(max_basis, max_basis, dtype=dtype, device=device)
        self.m = 0
        self.newest_column = self.T[:0, :0]  # Q^T G Q_new of the last block appended

    @property
    def Q(self) -> torch.Tensor:
        """``(D, m)``: the basis vectors so far (a view of the buffer)."""
        return self.basis[:, : self.m]

    @property
    def GQ(self) -> torch.Tensor:
        """``(D, m)``: their images ``G Q`` (a view of the buffer)."""
        return self.images[:, : self.m]

    def append(self, Q: torch.Tensor, GQ: torch.Tensor) -> None:
        """Add the block and its image at column ``m``; extend ``T = basis^T images``."""
        m, q, T, dtype = self.m, Q.shape[1], self.T, self.dtype
        self.basis[:, m : m + q] = Q
        self.images[:, m : m + q] = unit_strides(GQ.to(self.image_dtype))
        column = _cross(self.basis[:, : m + q], self.images[:, m : m + q], dtype)  # (m + q, q)
        self.newest_column = column  # the basis' components of the new images
        row = _cross(self.images[:, :m], Q, dtype)  # (m, q): the transposed product
        T[:m, m : m + q] = (column[:m] + row) / 2
        T[m : m + q, :m] = T[:m, m : m + q].T
        T[m : m + q, m : m + q] = (column[m:] + column[m:].T) / 2
        self.m = m + q

    def ritz(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ritz values (descending) and the coefficients of the Ritz vectors."""
        with eigh_threads(self.m):  # a small eigen-problem: threads only synchronise
            theta, S = torch.linalg.eigh(self.T[: self.m, : self.m])
        return theta.flip(0), S.flip(1)

    def residual_norms(self, S: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """``||G Q s_j - theta_j Q s_j||`` of the Ritz pairs ``(theta_j, Q s_j)``."""
        return _residual_norms(self.Q, self.GQ, S, theta)

    def project_newest(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The images of the last ``q`` columns less their components in the basis
        (:func:`_orthonormalize`'s first round, in the basis' dtype), and their column
        norms before.
        """
        block = self.newest_images(q)
        norms = torch.linalg.vector_norm(block, dim=0)
        block.addmm_(self.Q, self.newest_column, alpha=-1)  # Q^T G Q_new: from append
        return block, norms

    def newest_images(self, q: int) -> torch.Tensor:
        """A copy of the images of the last ``q`` columns, in the basis' dtype."""
        rows = self.images.T[self.m - q : self.m]  # contiguous: the buffer is column-major
        return unit_strides(rows.to(self.dtype, copy=True).T)

    def restart(self, S: torch.Tensor) -> None:
        """Thick restart: the basis becomes the Ritz vectors ``Q S``."""
        keep, dtype = S.shape[1], self.dtype
        upcast_product(self.Q, S, dtype, out=self.basis[:, :keep])
        upcast_product(self.GQ, S, dtype, out=self.images[:, :keep])
        self.m = keep
        T = self.T
        T[:keep, :keep] = _cross(self.Q, self.GQ, dtype)
        T[:keep, :keep] = (T[:keep, :keep] + T[:keep, :keep].T) / 2
