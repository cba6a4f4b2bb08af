"""A curvature-aware complement from KFAC: the Kronecker-factored GGN outside ``span(U)``.

With ``complement='kron'`` the posterior keeps the exact curvature ``a_j`` along the
top-``k`` eigenvectors ``U`` and, on the complement ``P = I - U U^T``, the curvature of
KFAC's block-diagonal ``C = s K / T`` (``K`` the Kronecker-factored summed GGN of
:func:`laplace_glas.curvature.complement.kron.ggn_kron`, scaled as ``a``), under a scalar prior
precision ``tau > 0``. With ``E = C + tau I``:

.. math::

    \\Sigma = U \\,\\mathrm{diag}(v)\\, U^\\top + P E^{-1} P, \\qquad
    v_j = \\frac{1}{a_j + \\tau}.

This is the 'diag' complement of :mod:`laplace_glas.posterior.complement` with
``diag(c + tau)`` replaced by ``E``; the same identities give, with ``Q`` an
orthonormal basis of the complement,
``Q (Q^T E^{-1} Q)^{-1} Q^T = E - E U (U^T E U)^{-1} U^T E`` and
``det(Q^T E^{-1} Q) = det(E^{-1}) det(U^T E U)``:

.. math::

    \\Sigma^{-1} = U \\,\\mathrm{diag}(a + \\tau)\\, U^\\top + E - E U (U^\\top E U)^{-1}
    U^\\top E, \\qquad
    \\log\\det \\Sigma^{-1} = \\sum_j \\log(a_j + \\tau) + \\log\\det E
    - \\log\\det(U^\\top E U),

``P E^{-1} P = E^{-1} + [U, E^{-1} U] [[M, -I], [-I, 0]] [U, E^{-1} U]^T`` with
``M = U^T E^{-1} U``, and draws ``U (sqrt(v) z) + P E^{-1/2} e``. ``log det E`` is the
sum of ``log(s lambda_B lambda_A / T + tau)`` over the factors' eigenvalues, and
``U^T E U = U^T C U + tau I`` is ``k x k``: the evidence's Occam term
``log det Sigma^{-1} - D log tau`` is exact for this ``Sigma`` and counts every one of
the ``D`` directions, the subspace through ``a`` and the complement through
KFAC's curvature restricted to it (the Schur complement of ``E`` on ``P``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from laplace.utils.matrix import Kron

from laplace_glas.curvature.solvers.threads import eigh_threads
from laplace_glas.posterior.closed_forms import FactoredMatrix, proper_tau
from laplace_glas.posterior.complement import (
    DiagonalComplementPosterior,
    ProjectedComplementPosterior,
    residual_curvature,
)

__all__ = [
    "KronComplementPosterior",
    "KronCurvature",
    "KronLowRankOperator",
    "curvature_complement_posterior",
    "projected_residual",
]


class KronCurvature:
    """``C = s K`` from the eigen-decomposed Kronecker factors of ``K``, shifted by
    ``tau``: ``E = C + tau I`` (block-diagonal, one block per parameter tensor).

    Parameters
    ----------
    blocks : list
        Per parameter tensor ``([Q_B, Q_A], [l_B, l_A])`` or ``([Q_B], [l_B])``: the
        factors' eigenvectors and (non-negative) eigenvalues; or ``([], [c])``, a
        diagonal block (``complement='kron_diag'``: the GGN diagonal ``c`` of a parameter
        KFAC does not cover, its own eigenvalues in the identity's eigenbasis).
    scale : torch.Tensor
        0-dim ``s >= 0`` (differentiable).

    """

    def __init__(self, blocks: list, scale: torch.Tensor) -> None:
        self.blocks = blocks
        self.scale = scale

    @classmethod
    def decompose(
        cls,
        kron: Kron,
        dtype: torch.dtype,
        device: torch.device,
        diagonals: list[torch.Tensor] | None = None,
    ) -> list:
        """The ``blocks`` of :class:`KronCurvature` from laplace-torch's ``Kron``
        (eigenvalues of round-off sign clamped to 0); its empty blocks take the next of
        ``diagonals`` (flat, one per empty block: ``complement='kron_diag'``).
        """
        blocks, pending = [], iter(diagonals or [])
        for factors in kron.kfacs:
            if not factors:
                diagonal = next(pending, None)
                if diagonal is None:
                    raise ValueError("An empty Kronecker block needs its GGN diagonal.")
                blocks.append(([], [diagonal.to(device, dtype).reshape(-1).clamp(min=0)]))
                continue
            Qs, ls = [], []
            for F in factors:
                with eigh_threads(F.shape[0]):  # small: threads only synchronise
                    values, vectors = torch.linalg.eigh(F.to(device, dtype))
                Qs.append(vectors)
                ls.append(values.clamp(min=0))
            blocks.append((Qs, ls))
        return blocks

    @property
    def n_params(self) -> int:
        """``D``."""
        return sum(size for _, size, _, _ in self._spans())

    def _spans(self) -> Iterator[tuple[int, int, list, list]]:
        """``(start, size, Qs, ls)`` of each block: its rows among the ``D`` weights."""
        start = 0
        for Qs, ls in self.blocks:
            size = math.prod(len(v) for v in ls)
            yield start, size, Qs, ls
            start += size

    def _shifted(self, tau: torch.Tensor) -> Iterator[tuple[int, list, torch.Tensor]]:
        """``(start, Qs, s lambda + tau)`` of each block, on its eigenvalues' grid
        (``tau`` 0-dim, or a ``(D,)`` prior diagonal: constant over a Kronecker block,
        entry by entry on a diagonal one).
        """
        for start, size, Qs, ls in self._spans():
            shift = tau
            if tau.ndim:
                shift = tau[start : start + size]
                shift = shift[0] if Qs else shift
            yield start, Qs, self._block_values(ls) + shift

    def _block_values(self, ls: list[torch.Tensor]) -> torch.Tensor:
        """``s`` times the block's eigenvalues, laid out as its ``(d_B, d_A)`` grid."""
        values = ls[0] if len(ls) == 1 else torch.outer(ls[0], ls[1])
        return self.scale * values

    @property
    def eigenvalues(self) -> torch.Tensor:
        """``(D,)`` eigenvalues of ``C`` (block by block)."""
        return torch.cat([self._block_values(ls).reshape(-1) for _, ls in self.blocks])

    def logdet(self, tau: torch.Tensor) -> torch.Tensor:
        """``log det(C + tau I)`` (``tau``: 0-dim, or a ``(D,)`` prior diagonal constant
        over each Kronecker block, see :meth:`check_prior`).
        """
        return torch.log(self.eigenvalues + tau).sum()

    def deflated(self, U: torch.Tensor, a: torch.Tensor) -> KronCurvature:
        """The curvature with each diagonal block ``c`` (``complement='kron_diag'``)
        replaced by ``max(c - diag(U diag(a) U^T) / s, 0)`` on its rows (the residual
        curvature, see :func:`~laplace_glas.posterior.complement.residual_curvature`);
        Kronecker blocks are kept. ``self`` where there is no diagonal block.
        """
        if all(Qs for Qs, _ in self.blocks):
            return self
        scale = self.scale.detach()
        if not bool(scale > 0):
            return self
        # diag(U diag(a) U^T) / s at unit scale: a = s lambda, so the residual blocks do
        # not depend on s (only C's own factor s carries its gradient)
        held = U.square() @ (a.detach() / scale)
        blocks = []
        for start, size, Qs, ls in self._spans():
            if not Qs:
                c = (ls[0] - held[start : start + size]).clamp_min(0)
                blocks.append(([], [c]))
            else:
                blocks.append((Qs, ls))
        return KronCurvature(blocks, self.scale)

    def check_prior(self, prior: torch.Tensor, complement: str) -> None:
        """``prior`` ``(D,)`` must be constant over each Kronecker block (one value per
        parameter tensor: a layerwise prior), so that ``C + diag(prior)`` keeps the
        blocks' eigenvectors; diagonal blocks take any positive values.
        """
        for start, size, Qs, _ in self._spans():
            block = prior[start : start + size]
            if Qs and bool((block != block[0]).any()):
                raise ValueError(
                    f"complement={complement!r} takes a scalar or layerwise prior precision "
                    "(one value per parameter tensor) on its Kronecker blocks; a per-weight "
                    "prior needs complement='diag'."
                )

    def apply(self, W: torch.Tensor, tau: torch.Tensor, exponent: float = 1.0) -> torch.Tensor:
        """``(C + tau I)^exponent`` applied to the last axis of ``W`` ``(..., D)``."""
        return self._blockwise(W, tau, exponent, rotate_back=True)

    def factor(self, W: torch.Tensor, tau: torch.Tensor, exponent: float = 1.0) -> torch.Tensor:
        """``W F`` for the factor ``F = Q diag((s lambda + tau)^(exponent / 2))`` of
        ``(C + tau I)^exponent = F F^T`` (``Q`` the blocks' Kronecker eigenvectors).

        Half the work of :meth:`apply` with ``exponent / 2``: ``(W F)(W F)^T`` equals
        ``W (C + tau I)^exponent W^T`` without rotating back to the weights' basis
        (``F`` is not symmetric, so ``W F`` is not ``W (C + tau I)^(exponent / 2)``).
        """
        return self._blockwise(W, tau, exponent / 2, rotate_back=False)

    def _blockwise(
        self, W: torch.Tensor, tau: torch.Tensor, exponent: float, rotate_back: bool
    ) -> torch.Tensor:
        """``W Q diag((s lambda + tau)^exponent)``, times ``Q^T`` if ``rotate_back``
        (``s lambda``: the blocks' scaled eigenvalues).
        """
        lead, D = W.shape[:-1], W.shape[-1]
        W = W.reshape(-1, D)
        out = []
        for start, Qs, shifted in self._shifted(tau):
            scaled = shifted.pow(exponent)
            part = W[:, start : start + scaled.numel()]
            if not Qs:  # a diagonal block: its own eigenbasis
                out.append(part * scaled)
            elif len(Qs) == 1:
                (Q,) = Qs
                rotated = (part @ Q) * scaled
                out.append(rotated @ Q.T if rotate_back else rotated)
            else:
                QB, QA = Qs
                part = part.reshape(-1, *scaled.shape)
                rotated = (QB.T @ part @ QA) * scaled
                if rotate_back:
                    rotated = QB @ rotated @ QA.T
                out.append(rotated.reshape(part.shape[0], -1))
        return torch.cat(out, dim=1).reshape(*lead, D)

    def power_diagonal(self, tau: torch.Tensor, exponent: float = -1.0) -> torch.Tensor:
        """``diag((C + tau I)^exponent)`` ``(D,)`` without forming a block: for ``Q = Q_B
        (x) Q_A`` and ``g = (s l_B l_A^T + tau)^exponent`` on the ``(d_B, d_A)`` grid the
        block's diagonal is ``(Q_B o Q_B) g (Q_A o Q_A)^T``.
        """
        out = []
        for _, Qs, shifted in self._shifted(tau):
            g = shifted.pow(exponent)
            if not Qs:
                out.append(g)
            elif len(Qs) == 1:
                out.append(Qs[0].square() @ g)
            else:
                out.append((Qs[0].square() @ g @ Qs[1].square().T).reshape(-1))
        return torch.cat(out)

    def to_dense(self, tau: torch.Tensor, exponent: float = 1.0) -> torch.Tensor:
        """The ``D x D`` matrix ``(C + tau I)^exponent`` (for tests and small models)."""
        l0 = self.blocks[0][1][0]
        eye = torch.eye(self.n_params, dtype=l0.dtype, device=l0.device)
        return self.apply(eye, tau, exponent)


class KronLowRankOperator(FactoredMatrix):
    """The symmetric matrix ``M = E^e + V diag(w) V^T`` with ``E = C + tau I`` a
    :class:`KronCurvature`, never formed (``e = -1``: the covariance, ``e = 1``: the
    precision).
    """

    def __init__(
        self,
        curvature: KronCurvature,
        tau: torch.Tensor,
        exponent: float,
        vectors: torch.Tensor,
        weights: torch.Tensor,
    ) -> None:
        self.curvature, self.tau, self.exponent = curvature, tau, exponent
        self.vectors, self.weights = vectors, weights

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``M @ x`` for ``x`` of shape ``(D,)`` or ``(D, m)``."""
        base = self.curvature.apply(x.T, self.tau, self.exponent).T
        V = self.vectors
        coeffs = self.weights.reshape(-1, *([1] * (x.ndim - 1))) * (V.T @ x)
        return base + V @ coeffs

    def diagonal(self) -> torch.Tensor:
        """``diag(M)``, the base's by :meth:`KronCurvature.power_diagonal` (no ``D x D``
        matrix).
        """
        base = self.curvature.power_diagonal(self.tau, self.exponent)
        return base + self.vectors.square() @ self.weights

    def to_dense(self) -> torch.Tensor:
        """Materialise the ``D x D`` matrix (only when explicitly asked for)."""
        V = self.vectors
        return self.curvature.to_dense(self.tau, self.exponent) + (V * self.weights) @ V.T

    def logdet(self) -> torch.Tensor:
        """``e log det E + log det(I_k + diag(w) V^T E^{-e} V)`` (determinant lemma)."""
        V = self.vectors
        eye = torch.eye(V.shape[1], dtype=V.dtype, device=V.device)
        inner = V.T @ self.curvature.apply(V.T, self.tau, -self.exponent).T
        sign, log_abs = torch.linalg.slogdet(eye + self.weights[:, None] * inner)
        if bool(sign <= 0):
            return torch.full_like(log_abs, -math.inf if bool(sign == 0) else math.nan)
        return self.exponent * self.curvature.logdet(self.tau) + log_abs

    def clone(self) -> KronLowRankOperator:
        """A copy with cloned low-rank factors (the Kronecker factors are shared: they
        are never modified in place).
        """
        return KronLowRankOperator(
            self.curvature, self.tau.clone(), self.exponent, self.vectors.clone(),
            self.weights.clone(),
        )  # fmt: skip

    def __repr__(self) -> str:
        D, k = self.vectors.shape
        return f"KronLowRankOperator(D={D}, k={k}, exponent={self.exponent:g})"


class KronComplementPosterior(ProjectedComplementPosterior):
    """The posterior of ``(U, a)`` with KFAC's curvature ``C`` off ``span(U)`` under
    ``tau I``: :class:`~laplace_glas.posterior.complement.ProjectedComplementPosterior`
    with ``E = C + tau I`` (see the module), behind the interface of
    :class:`~laplace_glas.posterior.complement.DiagonalComplementPosterior`.

    Parameters
    ----------
    vectors, curvature, tau : torch.Tensor
        As in :class:`~laplace_glas.posterior.complement.DiagonalComplementPosterior`; a
        ``(D,)`` ``tau`` is constant over each Kronecker block (a layerwise prior).
    complement_curvature : KronCurvature
        ``C``, scaled as ``curvature``.
    complement : {'kron', 'kron_diag'}
        Its name: ``'kron_diag'`` where ``C`` has diagonal blocks (the GGN diagonal of
        the parameters KFAC does not cover).

    """

    complement = "kron"

    def __init__(
        self,
        vectors: torch.Tensor,
        curvature: torch.Tensor,
        tau: torch.Tensor,
        complement_curvature: KronCurvature,
        complement: str = "kron",
    ):
        self.U = vectors
        self.a = curvature
        self.complement = complement
        self.tau = proper_tau(
            tau, f"complement={complement!r} (the prior outside the complement's curvature)"
        )
        self.C = complement_curvature
        if self.tau.ndim:
            self.C.check_prior(self.tau, complement)

    def power_of_E(self, W: torch.Tensor, power: float) -> torch.Tensor:
        """``W (C + tau I)^power`` through the factors' eigen-decompositions."""
        return self.C.apply(W, self.tau, power)

    def factor_of_E(self, W: torch.Tensor, power: float) -> torch.Tensor:
        """``W F`` with ``F F^T = (C + tau I)^power``, in the factors' eigenbasis
        (:meth:`KronCurvature.factor`: half the work of the symmetric root).
        """
        return self.C.factor(W, self.tau, power)

    def log_det_E(self) -> torch.Tensor:
        """``sum log(s lambda_B lambda_A / T + tau)`` over the factors' eigenvalues."""
        return self.C.logdet(self.tau)

    def inverse_E_diagonal(self) -> torch.Tensor:
        """``diag((C + tau I)^{-1})`` (:meth:`KronCurvature.power_diagonal`)."""
        return self.C.power_diagonal(self.tau)

    def _covariance_operator(self, V: torch.Tensor, w: torch.Tensor) -> KronLowRankOperator:
        return KronLowRankOperator(self.C, self.tau, -1.0, V, w)

    def _precision_operator(self, V: torch.Tensor, w: torch.Tensor) -> KronLowRankOperator:
        return KronLowRankOperator(self.C, self.tau, 1.0, V, w)


def curvature_complement_posterior(
    complement: str,
    vectors: torch.Tensor,
    curvature: torch.Tensor,
    prior: torch.Tensor,
    complement_curvature: torch.Tensor | KronCurvature,
    projected: tuple[torch.Tensor, ...] | None = None,
) -> ProjectedComplementPosterior:
    """The posterior of a curvature-aware complement (``'diag'``, ``'kron'``,
    ``'kron_diag'``): ``(U, a)`` under ``prior`` (0-dim ``tau`` or a ``(D,)`` diagonal),
    and off ``span(U)`` the fitted complement curvature less what ``span(U)`` holds
    (:func:`~laplace_glas.posterior.complement.residual_curvature`); ``projected``:
    :func:`projected_residual`'s four at the curvature's scale where the caller has them.
    """
    residual = residual_curvature(complement_curvature, vectors, curvature)
    if complement == "diag":
        posterior = DiagonalComplementPosterior(vectors, curvature, prior, residual)
    else:
        posterior = KronComplementPosterior(vectors, curvature, prior, residual, complement)
    posterior.projected = projected
    return posterior


def projected_residual(
    complement_curvature: torch.Tensor | KronCurvature, U: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U^T C_r U, G, m, log det G)`` for the residual ``C_r`` of
    ``complement_curvature`` (:func:`~laplace_glas.posterior.complement.residual_curvature`),
    detached, with ``G = U^T U`` and ``m`` the eigenvalues of ``G^{-1/2} U^T C_r U
    G^{-1/2}``. At unit scale (``C`` and ``a`` given with ``s = 1``) ``C_r`` scales with
    ``s``: ``s U^T C_r U + tau G`` is ``U^T E U`` and ``sum log(s m + tau) + log det G``
    its log-determinant, for every ``s`` and ``tau``.
    """
    with torch.no_grad():
        residual = residual_curvature(complement_curvature, U, a)
        if isinstance(residual, torch.Tensor):
            UCU = U.T @ (residual[:, None] * U)
        else:
            zero = torch.zeros((), dtype=U.dtype, device=U.device)
            UCU = U.T @ residual.apply(U.T, zero, 1.0).T
        UCU, G = (UCU + UCU.T) / 2, U.T @ U
        g, V = torch.linalg.eigh(G)
        root = V @ torch.diag(g.rsqrt()) @ V.T  # G^{-1/2}
        m = torch.linalg.eigvalsh(root @ UCU @ root).clamp_min(0)
        return UCU, G, m, torch.log(g).sum()
