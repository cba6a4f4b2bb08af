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
cost no further products. Reading the whole basis and its images for them on every pass
cost more than the products of a one-column solve on a stored operator; the Krylov
relation estimates them from the newest block alone (``||W s_j||``, ``W`` its images
less their basis components, the next block's first orthogonalisation round), and the
exact residuals are computed where the estimates come within a small factor of the
test. The solve stops when the top-k relative residuals are below
``tol``, or when they have stopped halving for two basis' worth of passes below the
products' round-off level ``max(tol, sqrt(eps)) theta_1`` (float32 products of a deep
linearised model can sit above ``tol``: an LSTM tagger's stalled at 6e-5 relative,
where float64 reached 1e-8 in 53 products; the solver used to run on to its pass
limit, 400 products, at the same residuals); when the basis would exceed
``max_basis`` columns it is thick-restarted from the leading Ritz vectors (with one
column a pass, half way between ``k + 1`` of them and a full basis, so that restarts
come every few passes).
The basis is stored column-major, each vector contiguous, which the products with a
few columns read two to three times faster.
Rank-deficient operators are fine: directions that vanish in the orthogonalisation
(measured against their norm before it) are dropped, a space that closes before the
top k are found goes on from a random block, and a residual below
``rank_threshold * theta_1`` (the products' own round-off scale) counts as converged
whatever the eigenvalue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from laplace_glas.curvature.solvers.krylov_basis import (
    KrylovBasis,
    estimated_residuals,
    unit_strides,
    upcast_product,
)
from laplace_glas.curvature.solvers.threads import single_threaded_torch
from laplace_glas.validation import positive_int

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


_FRESH_PASSES = 3  # passes a random block grows before the top k are compared again
_CHECK_MARGIN = 4.0  # estimated residuals within this factor of the test: check exactly
_ONE_ROUND = 0.5**0.5  # a column keeping this share of its norm needs no second round


def _orthonormalize(
    block: torch.Tensor,
    basis: torch.Tensor | None,
    drop: float,
    norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Columns of ``block`` made orthonormal to ``basis`` and to each other.

    One round of classical Gram-Schmidt against the basis, a QR whose numerically
    dependent columns (``|R_ii| <= drop * max_j ||b_j||``, the block's largest column
    norm before the projection) are dropped, then, where a column was dropped or lost
    more than ``1 - 1/sqrt(2)`` of its norm to the first round, a second round ("twice is
    enough": it removes what the first left through cancellation; a first round that
    cancelled less leaves the column orthogonal to round-off, the criterion of ARPACK's
    DGKS step), in which a column that loses more than half its norm is dropped too, and
    a QR. A column in the basis' span leaves only round-off after the first round;
    measured against its own remainder it would pass, and normalised it would return
    the basis' directions, so that the basis stops being orthonormal and the Rayleigh
    quotients exceed the operator's norm (a float32 GRU on 4 examples, whose Krylov
    space ends after 4 directions, gave 338 for an eigenvalue of 9.6 after 400
    products). ``block`` is overwritten. ``norms`` given: ``block`` has had its first
    round already (see :meth:`KrylovBasis.project_newest`), ``norms`` are its column
    norms before it.
    """
    if block.shape[1] == 0:
        return block
    if norms is None:
        norms = torch.linalg.vector_norm(block, dim=0)
        if basis is not None and basis.shape[1]:
            block.addmm_(basis, basis.T @ block, alpha=-1)
    scale = norms.max().clamp(min=torch.finfo(block.dtype).tiny)
    # MKL's threaded geqrf is no faster on blocks of up to 250 columns (see threads)
    with single_threaded_torch():
        Q, R = torch.linalg.qr(unit_strides(block))
    del block
    left = R.diagonal().abs()
    keep = left > drop * scale
    Q = Q[:, keep]
    # a dropped column's Householder direction (round-off, largely in the basis) enters
    # the kept ones after it: any drop, like any cancellation, calls for the second round
    cancelled = not bool(keep.all()) or bool((left < _ONE_ROUND * norms).any())
    if basis is not None and basis.shape[1] and Q.shape[1] and cancelled:
        Q.addmm_(basis, basis.T @ Q, alpha=-1)
        Q = Q[:, torch.linalg.vector_norm(Q, dim=0) > 0.5]  # unit before the round
        with single_threaded_torch():
            Q, _ = torch.linalg.qr(unit_strides(Q))
    return unit_strides(Q)


def _restart_size(available: int, k: int, p: int, most: int) -> int:
    """Ritz vectors a thick restart keeps: ``most`` (the most that leave room for the
    next block); with one column a pass, half way between ``k + 1`` and ``most``, as
    ARPACK keeps up to half of its basis beyond ``k``: keeping ``most`` restarted on every
    pass once the basis was full (two products of the whole basis per product). Blocks
    keep ``most``: half way failed on clusters wider than the Ritz vectors kept.
    """
    if p > 1:
        return min(available, max(k + p, most))
    return min(available, max(k + p, (k + p + most) // 2))


def _new_directions(
    block: torch.Tensor,
    basis: torch.Tensor,
    drop: float,
    random_block: Callable[[], torch.Tensor],
    norms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """:func:`_orthonormalize` of ``block`` against ``basis``; where nothing is left
    (the Krylov space is exhausted: an invariant subspace, which need not hold the top
    k, for a start without components along some of them or a rank below k), that of
    ``random_block()``, to go on in the rest of the space (empty only where the basis
    spans it all); and whether the random block was taken (``norms``: see
    :func:`_orthonormalize`).
    """
    new = _orthonormalize(block, basis, drop, norms)
    if new.shape[1] == 0:
        return _orthonormalize(random_block(), basis, drop), True
    return new, False


def _needs_fresh_block(
    top: torch.Tensor, verified: torch.Tensor | None, p: int, tol: float, floor: torch.Tensor
) -> bool:
    """Whether converged Ritz values ``top`` call for one more pass with a random block.

    A block Krylov space of block size ``p`` holds at most ``p`` copies of an eigenvalue
    in exact arithmetic (round-off lets a few more in, slowly), so an eigenvalue with
    more copies than were found could be missing although every residual is small.
    That is possible only if some value repeats (neighbours equal to ``tol``) at least
    ``p`` times among ``top``; values at or below ``floor`` (round-off of a rank-deficient
    operator) do not count. After a random block (``verified`` = the top values then),
    another is needed only if the top values moved by more than ``tol * top[0]``.
    """
    if p >= top.numel():
        return False
    if verified is not None:
        return bool(((top - verified).abs() > tol * top[0].abs()).any())
    repeats = ((top[:-1] - top[1:]).abs() <= tol * top[:-1].abs()) & (top[1:] > floor)
    run = longest = 1
    for same in repeats.tolist():
        run = run + 1 if same else 1
        longest = max(longest, run)
    return longest >= p


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
        Memory is ``max_basis * dim`` numbers for the basis (in ``dtype``) plus as many
        for its images (in ``image_dtype``), both preallocated; the products with small
        matrices (Rayleigh-Ritz, residuals, restarts) run over row chunks, so the
        temporaries beyond that are one block and its QR.
    tol : float
        Relative residual ``||G x - theta x|| / theta`` at which a pair is converged.
    max_passes : int
        Maximum number of ``matmat`` calls.
    rank_threshold : float
        Absolute residual floor ``rank_threshold * theta_1``: the products' own
        round-off (about ``eps * theta_1``) allows no better, so a pair also counts
        as converged once ``||r|| <= rank_threshold * theta_1``. Where the top-k
        residuals have not halved for ``max(3, 2 max_basis / p)`` passes, the floor is
        ``max(tol, sqrt(eps)) theta_1`` (``eps`` of ``image_dtype``): round-off of
        products that accumulate more than ``eps``.
    generator : torch.Generator, optional
        Source of the random starting block.
    dtype, device :
        Precision and device of the basis, in which it is orthogonalised. For the
        GGN's own products the operator's precision suffices (GLAS uses it there): a
        float64 basis for float32 products doubles the orthogonalisation's cost (half
        of a solve at D ~ 1e5) for directions the products cannot resolve. The dual
        solve's small Gram matrix keeps float64 (see
        :mod:`~laplace_glas.curvature.solvers.gram`), where it is cheap.
    image_dtype : torch.dtype, optional
        Precision in which the images ``G Q`` are stored (default ``dtype``); the
        operator's own precision halves their memory without losing accuracy.

    """
    p, max_basis, max_passes = _block_sizes(dim, k, block_size, max_basis, max_passes)
    drop = 100 * torch.finfo(dtype).eps
    # the basis and its images live in two preallocated buffers (no copies as they grow)
    space = KrylovBasis(dim, max_basis, dtype, image_dtype or dtype, device)

    def random_block() -> torch.Tensor:
        block = torch.randn(dim, p, generator=generator, dtype=torch.float64)
        return block.to(device, dtype)

    Q = _orthonormalize(random_block(), None, drop)
    space.append(Q, matmat(Q))
    newest = n_products = Q.shape[1]
    n_passes = 1
    del Q
    verified: torch.Tensor | None = None  # top-k Ritz values when a fresh block was added
    fresh_at: int | None = None  # the pass that added it
    test = _ResidualTest(k, tol, rank_threshold, image_dtype or dtype, max_basis, p)
    relation = True  # the Krylov relation holds (see estimated_residuals)
    while True:
        theta, S = space.ritz()
        kk = min(k, theta.numel())
        estimate = relation and n_passes < max_passes
        converged, exact, floor, seed, seed_norms = test(
            space, theta, S, newest, n_passes, estimate
        )
        if n_passes >= max_passes:
            break
        fresh = False
        settling = fresh_at is not None and n_passes - fresh_at < _FRESH_PASSES
        if kk == k and not settling and bool(converged.all()):
            if not _needs_fresh_block(theta[:k], verified, p, tol, floor):
                break
            # a block Krylov space holds at most p copies of an eigenvalue (exact
            # arithmetic): missing copies pass every residual test. Add a random block,
            # grow it a few passes; if the top k change, iterate on.
            verified, fresh, fresh_at = theta[:k].clone(), True, n_passes
        # next block: the newest images (fresh: a random block beside them); an exhausted
        # space goes on from a random block (a converged solve has stopped or is settling)
        if fresh or seed is None:
            seed, seed_norms = space.newest_images(newest), None
            seed = torch.cat([seed, random_block()], 1) if fresh else seed
        new, restarted = _new_directions(seed, space.Q, drop, random_block, seed_norms)
        del seed
        relation = relation and not (fresh or restarted)  # a random block breaks it
        if new.shape[1] == 0:  # the basis spans the whole space
            break
        if space.m + new.shape[1] > max_basis:  # thick restart from the leading Ritz vectors
            keep = _restart_size(theta.numel(), k, p, max_basis - new.shape[1])
            space.restart(S[:, :keep])
            # the basis now holds the Ritz vectors themselves
            theta, S = theta[:keep], torch.eye(keep, dtype=dtype, device=device)
            new = _orthonormalize(new, space.Q, drop)
            if new.shape[1] == 0:
                break
        # short of a block only where the basis may hold the whole space (max_basis =
        # dim < k + 2 p), and round-off kept more directions than remain
        room = max_basis - space.m
        if room == 0:
            break
        Q = new[:, :room]  # p columns, or 2 p with a fresh block
        relation = relation and Q.shape[1] == new.shape[1]  # a cut block leaves images out
        del new
        space.append(Q, matmat(Q))
        newest, n_passes = Q.shape[1], n_passes + 1
        n_products += newest
        del Q
    if not exact:  # the loop ended on estimates: the returned test is the exact one
        converged = test.exact(space, theta, S, kk, floor)[1]
    return BlockKrylovResult(
        values=theta[:kk],
        vectors=upcast_product(space.Q, S[:, :kk], dtype),
        images=upcast_product(space.GQ, S[:, :kk], dtype),
        n_products=n_products,
        n_passes=n_passes,
        converged=converged,
    )


class _ResidualTest:
    """The convergence test of a solve's top ``k`` Ritz pairs, pass by pass: a residual
    below ``tol`` relative, or below the floor ``rank_threshold * theta_1``, raised to
    the products' round-off ``max(tol, sqrt(eps)) theta_1`` (the residual warning's
    level) once the residuals have not halved for ``max(3, 2 max_basis / p)`` passes.
    """

    def __init__(self, k, tol, rank_threshold, image_dtype, max_basis, p):
        self.k, self.tol, self.rank_threshold = k, tol, rank_threshold
        self.precision = max(tol, torch.finfo(image_dtype).eps ** 0.5)
        self.stall_passes = max(_FRESH_PASSES, 2 * -(-max_basis // p))
        self.best, self.improved_at = float("inf"), 0

    def _stalled(self, n_passes: int, kk: int) -> bool:
        return kk == self.k and n_passes - self.improved_at >= self.stall_passes

    def exact(self, space, theta, S, kk, floor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact residuals (from the basis and its images) and the test on them."""
        residual = space.residual_norms(S[:, :kk], theta[:kk])
        return residual, residual <= torch.maximum(self.tol * theta[:kk].abs(), floor)

    def __call__(self, space, theta, S, newest, n_passes, estimate) -> tuple:
        """``(converged, exact, floor, seed, norms)`` of this pass. ``estimate``: the
        Krylov relation holds, so the residuals are estimated first and computed exactly
        only where the estimates come within ``_CHECK_MARGIN`` of the test (they differ
        by round-off; the exact ones decide); ``seed`` and ``norms`` are then the next
        block's first round (:meth:`KrylovBasis.project_newest`), else None.
        """
        kk, top = min(self.k, theta.numel()), theta[0].clamp(min=0)
        floor = self.rank_threshold * top
        seed = norms = None
        exact = not estimate
        if estimate:
            loose = (
                torch.maximum(floor, self.precision * top) if self._stalled(n_passes, kk) else floor
            )
            limit = torch.maximum(self.tol * theta[:kk].abs(), loose)
            seed, norms = space.project_newest(newest)
            residual = estimated_residuals(seed, S[space.m - newest : space.m, :kk])
            exact = kk == self.k and bool((residual <= _CHECK_MARGIN * limit).all())
        if exact:
            residual = space.residual_norms(S[:, :kk], theta[:kk])
        worst = float(residual.max())
        if worst < self.best / 2:
            self.best, self.improved_at = worst, n_passes
        if self._stalled(n_passes, kk):  # at the products' round-off?
            floor = torch.maximum(floor, self.precision * top)
        converged = residual <= torch.maximum(self.tol * theta[:kk].abs(), floor)
        if not exact and kk == self.k and bool(converged.all()):  # the stall raised the floor
            exact, converged = True, self.exact(space, theta, S, kk, floor)[1]
        return converged, exact, floor, seed, norms


def _block_sizes(
    dim: int, k: int, block_size: int | None, max_basis: int | None, max_passes: int
) -> tuple[int, int, int]:
    """The checked block size ``p``, basis size and pass limit."""
    if not 1 <= k < dim:
        raise ValueError(f"Need 1 <= k < dim = {dim}, got k = {k}.")
    block_size = positive_int("block_size", block_size)
    max_passes = positive_int("max_passes", max_passes, allow_none=False)
    p = min(block_size or max(k, 8), dim)
    if max_basis is not None and max_basis < min(dim, k + 2 * p):
        # a thick restart keeps k + p Ritz vectors and then needs room for a new block
        raise ValueError(
            f"max_basis={max_basis} is too small for k={k} and block_size={p}: it must be "
            f"at least k + 2 * block_size = {k + 2 * p} (or dim)."
        )
    return p, min(dim, max_basis or max(2 * k + p, 3 * p)), max_passes
