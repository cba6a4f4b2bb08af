"""Posterior algebra of a rank-k curvature under a layerwise or diagonal prior precision.

Notation: ``U`` ``(D, k)`` orthonormal eigenvectors, ``a`` ``(k,)`` curvatures
``a_j = s lambda_j / T >= 0``, ``P_0 = diag(p)`` the prior precision with ``p > 0``
``(D,)`` (a scalar, one value per parameter group, or one per weight, expanded to
``D`` entries), and ``W = U diag(sqrt(a))``. Nothing here forms a ``D x D`` matrix:
every quantity costs ``O(k^2 D)`` or less.

Restricted posterior (``complement='zero'``): ``theta = theta* + U z`` with the
``k x k`` precision of ``z``

.. math::

    A = \\mathrm{diag}(a) + U^\\top P_0 U = E\\,\\mathrm{diag}(\\mu)\\,E^\\top, \\qquad
    \\Sigma = U A^{-1} U^\\top = V \\mathrm{diag}(1/\\mu) V^\\top, \\quad V = U E,

``V`` orthonormal.

Prior complement (``complement='prior'``, laplace-torch's ``LowRankLaplace``): the
precision ``P = P_0 + W W^T`` in ``R^D``. With the capacitance matrix

.. math::

    C = I_k + W^\\top P_0^{-1} W = R\\,\\mathrm{diag}(c)\\,R^\\top,

Woodbury's identity and the matrix determinant lemma give

.. math::

    \\Sigma = P_0^{-1} - P_0^{-1} W C^{-1} W^\\top P_0^{-1}
           = \\mathrm{diag}(1/p) - V \\mathrm{diag}(1/c) V^\\top, \\quad V = P_0^{-1} W R,
    \\qquad \\log\\det P - \\log\\det P_0 = \\log\\det C.

Samples are ``P_0^{-1/2} (I + B R diag(g) R^T B^T) e`` with ``B = P_0^{-1/2} W``,
``e ~ N(0, I_D)`` and ``g_j = -1 / (sqrt(c_j) (1 + sqrt(c_j)))``, which squares to
``(I + B B^T)^{-1}``.

The evidence's Occam term is ``log det C`` for both complements: the Laplace evidence
of the curvature ``U diag(a) U^T`` in ``R^D`` (for a scalar prior ``tau`` it is
``sum_j log(1 + a_j / tau)``, and it equals laplace-torch's ``FullLaplace`` when
``span(U)`` holds all the curvature).
"""

from __future__ import annotations

import math
from functools import cached_property

import torch

from laplace_glas.posterior.closed_forms import FactoredMatrix, SubspaceOperator

__all__ = [
    "DiagonalPriorPosterior",
    "LowRankDiagonalOperator",
    "capacitance",
    "layer_grams",
    "log_det_capacitance",
    "restricted_precision",
]


def layer_grams(U: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``G_l = U_l^T U_l`` ``(L, k, k)`` for the row blocks ``U_l`` of ``sizes`` rows.

    With a layerwise prior ``p_l``, ``U^T P_0^{+-1} U = sum_l p_l^{+-1} G_l``: computed
    once (``O(k^2 D)``), every later prior costs ``O(L k^2)``.
    """
    return torch.stack([block.T @ block for block in U.split(sizes)])


def restricted_precision(
    U: torch.Tensor, a: torch.Tensor, p: torch.Tensor, gram: torch.Tensor | None = None
) -> torch.Tensor:
    """``A = diag(a) + U^T diag(p) U``: the ``(k, k)`` precision of ``z`` (``O(k^2 D)``;
    ``gram`` = ``U^T diag(p) U`` when known).
    """
    return torch.diag_embed(a) + ((U.T * p) @ U if gram is None else gram)


def capacitance(
    U: torch.Tensor, a: torch.Tensor, p: torch.Tensor, gram_inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``C = I + diag(sqrt a) U^T diag(1/p) U diag(sqrt a)`` ``(k, k)``, symmetric
    positive definite (``O(k^2 D)``; ``gram_inverse`` = ``U^T diag(1/p) U`` when known).
    """
    root = a.clamp(min=0).sqrt()
    inner = (U.T / p) @ U if gram_inverse is None else gram_inverse
    eye = torch.eye(U.shape[1], dtype=U.dtype, device=U.device)
    return eye + root[:, None] * inner * root[None, :]


def log_det_capacitance(
    U: torch.Tensor, a: torch.Tensor, p: torch.Tensor, gram_inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``log det C = log det(P_0 + W W^T) - log det P_0`` by Cholesky.

    Differentiable in ``p`` and ``a`` (the gradient of the evidence in a layerwise or
    diagonal prior precision).
    """
    chol = torch.linalg.cholesky(capacitance(U, a, p, gram_inverse))
    return 2 * chol.diagonal().log().sum()


class LowRankDiagonalOperator(FactoredMatrix):
    """The symmetric matrix ``M = diag(d) + V diag(w) V^T``, never formed.

    The posterior precision (``d = p``, ``V = U``, ``w = a``) and covariance
    (``d = 1/p``, ``V = P_0^{-1} W R``, ``w = -1/c``) of the prior-complement
    posterior under a diagonal prior.

    Parameters
    ----------
    diagonal : torch.Tensor
        ``(D,)`` the diagonal part ``d``.
    vectors : torch.Tensor
        ``(D, k)`` the low-rank factor ``V`` (not necessarily orthonormal).
    weights : torch.Tensor
        ``(k,)`` the weights ``w`` (may be negative).

    """

    def __init__(self, diagonal: torch.Tensor, vectors: torch.Tensor, weights: torch.Tensor):
        self.diagonal_part = diagonal
        self.vectors = vectors
        self.weights = weights

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``M @ x`` for ``x`` of shape ``(D,)`` or ``(D, m)`` in ``O(D k m)``."""
        V = self.vectors
        coeffs = self.weights.reshape(-1, *([1] * (x.ndim - 1))) * (V.T @ x)
        d = self.diagonal_part.reshape(-1, *([1] * (x.ndim - 1)))
        return d * x + V @ coeffs

    def diagonal(self) -> torch.Tensor:
        """``diag(M)`` in ``O(D k)``."""
        return self.diagonal_part + self.vectors.square() @ self.weights

    def to_dense(self) -> torch.Tensor:
        """Materialise the ``D x D`` matrix (only when explicitly asked for)."""
        V = self.vectors
        return torch.diag(self.diagonal_part) + (V * self.weights) @ V.T

    def logdet(self) -> torch.Tensor:
        """``log det M = sum log d + log det(I_k + diag(w) V^T diag(1/d) V)`` (matrix
        determinant lemma, ``O(k^2 D)``); ``-inf`` for a singular and NaN for a negative
        determinant, as ``torch.logdet`` returns.
        """
        V, d = self.vectors, self.diagonal_part
        eye = torch.eye(V.shape[1], dtype=V.dtype, device=V.device)
        sign, log_abs = torch.linalg.slogdet(eye + self.weights[:, None] * ((V.T / d) @ V))
        if bool(sign == 0):
            return torch.full_like(log_abs, -math.inf)
        if bool(sign < 0):
            return torch.full_like(log_abs, math.nan)
        return d.log().sum() + log_abs

    def clone(self) -> LowRankDiagonalOperator:
        """A copy with cloned factors (``torch.Tensor.clone``'s contract)."""
        return LowRankDiagonalOperator(
            self.diagonal_part.clone(), self.vectors.clone(), self.weights.clone()
        )

    def __repr__(self) -> str:
        D, k = self.vectors.shape
        return f"LowRankDiagonalOperator(D={D}, k={k})"


class DiagonalPriorPosterior:
    """The GLAS posterior of ``(U, a)`` under the diagonal prior precision ``diag(p)``.

    See the module docstring for the formulas. Built per call (``O(k^2 D)``); the
    eigen-decompositions are computed on first use.

    Parameters
    ----------
    vectors : torch.Tensor
        ``(D, k)`` orthonormal ``U``.
    curvature : torch.Tensor
        ``(k,)`` ``a >= 0``.
    prior_precision : torch.Tensor
        ``(D,)`` ``p > 0``.
    complement : {'zero', 'prior'}
        No variance off ``span(U)``, or the prior's.
    grams : tuple of torch.Tensor, optional
        ``(U^T P_0 U, U^T P_0^{-1} U)`` when known (e.g. from :func:`layer_grams` for a
        layerwise prior); otherwise computed in ``O(k^2 D)``.

    """

    def __init__(
        self,
        vectors: torch.Tensor,
        curvature: torch.Tensor,
        prior_precision: torch.Tensor,
        complement: str,
        grams: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if complement not in ("zero", "prior"):
            raise ValueError(f"complement must be 'zero' or 'prior', got {complement!r}.")
        self.U = vectors
        self.a = curvature
        self.p = prior_precision
        self.complement = complement
        self.gram, self.gram_inverse = (None, None) if grams is None else grams

    # -------------------------------------------------------------- factorisations
    @cached_property
    def _restricted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, E)``: eigen-decomposition of ``A``."""
        return torch.linalg.eigh(restricted_precision(self.U, self.a, self.p, self.gram))

    @cached_property
    def _capacitance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, R)``: eigen-decomposition of ``C``."""
        return torch.linalg.eigh(capacitance(self.U, self.a, self.p, self.gram_inverse))

    @property
    def _root_factor(self) -> torch.Tensor:
        """``W = U diag(sqrt a)``."""
        return self.U * self.a.clamp(min=0).sqrt()

    # -------------------------------------------------------------- evidence
    @property
    def log_det_ratio(self) -> torch.Tensor:
        """``log det C`` (both complements; differentiable in ``p`` and ``a``)."""
        return log_det_capacitance(self.U, self.a, self.p, self.gram_inverse)

    @property
    def log_det_posterior_precision(self) -> torch.Tensor:
        """``sum log p + log det C`` (``log det(P_0 + W W^T)``)."""
        return self.p.log().sum() + self.log_det_ratio

    # -------------------------------------------------------------- operators
    @property
    def precision(self) -> SubspaceOperator | LowRankDiagonalOperator:
        """``P_0 + W W^T`` ('prior'), or ``V diag(mu) V^T`` with ``inf`` off ``span(U)``."""
        if self.complement == "prior":
            return LowRankDiagonalOperator(self.p, self.U, self.a)
        mu, E = self._restricted
        return SubspaceOperator(self.U @ E, mu, math.inf)

    @property
    def covariance(self) -> SubspaceOperator | LowRankDiagonalOperator:
        """``Sigma``: Woodbury's form ('prior') or ``V diag(1/mu) V^T`` ('zero')."""
        V, weights, diagonal = self.covariance_factors()
        if diagonal is None:
            return SubspaceOperator(V, weights, 0.0)
        return LowRankDiagonalOperator(diagonal, V, weights)

    def covariance_factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(V, w, d)`` with ``Sigma = V diag(w) V^T + diag(d)`` (``d`` None for 'zero').

        The linearised predictive is then ``(J V) diag(w) (J V)^T + J diag(d) J^T``.
        """
        if self.complement == "zero":
            mu, E = self._restricted
            return self.U @ E, 1.0 / mu, None
        c, R = self._capacitance
        V = (self._root_factor / self.p[:, None]) @ R
        return V, -1.0 / c, 1.0 / self.p

    @property
    def subspace_variances(self) -> torch.Tensor:
        """``diag(U^T Sigma U)``: the posterior variance along each ``u_j`` ``(k,)``."""
        V, weights, diagonal = self.covariance_factors()
        UV = self.U.T @ V
        variances = UV.square() @ weights
        if diagonal is not None:
            variances = variances + self.U.square().T @ diagonal
        return variances

    # -------------------------------------------------------------- densities
    def square_norm(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta^T P delta`` for ``delta`` ``(D,)`` or ``(n, D)``; for 'zero' only the
        component in ``span(U)`` counts (``z^T A z``, ``z = U^T delta``).
        """
        z = delta @ self.U
        if self.complement == "zero":
            A = restricted_precision(self.U, self.a, self.p, self.gram)
            return ((z @ A) * z).sum(-1)
        return (delta.square() * self.p).sum(-1) + (z.square() * self.a).sum(-1)

    def log_normaliser(self) -> tuple[int, torch.Tensor]:
        """``(dim, log det)`` of the Gaussian density: ``(D, log det P)`` for 'prior',
        ``(k, log det A)`` for 'zero' (the density of ``z`` on the subspace).
        """
        if self.complement == "prior":
            return self.U.shape[0], self.log_det_posterior_precision
        return self.U.shape[1], self._restricted[0].log().sum()

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, D)`` zero-mean draws with covariance ``Sigma`` (``O(n D k)``)."""
        U = self.U
        D, k = U.shape
        if self.complement == "zero":
            mu, E = self._restricted
            z = torch.randn(n_samples, k, generator=generator, device=U.device, dtype=U.dtype)
            return (z * mu.rsqrt()) @ (U @ E).T
        c, R = self._capacitance
        root_c = c.sqrt()
        g = -1.0 / (root_c * (1.0 + root_c))
        BR = (self._root_factor * self.p.rsqrt()[:, None]) @ R  # (D, k)
        e = torch.randn(n_samples, D, generator=generator, device=U.device, dtype=U.dtype)
        y = e + ((e @ BR) * g) @ BR.T
        return y * self.p.rsqrt()
