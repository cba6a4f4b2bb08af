"""A curvature-aware complement: the GGN diagonal's curvature outside ``span(U)``.

With ``complement='diag'`` the posterior keeps the exact curvature ``a_j`` along the
top-``k`` eigenvectors ``U`` and, on the complement ``P = I - U U^T``, the curvature
``c_i`` of the GGN's diagonal (scaled as ``a``: ``c = s diag(G) / T``), under a scalar
prior precision ``tau > 0``:

.. math::

    \\Sigma = U \\,\\mathrm{diag}(v)\\, U^\\top + P \\,\\mathrm{diag}(d)\\, P, \\qquad
    v_j = \\frac{1}{a_j + \\tau}, \\qquad d_i = \\frac{1}{c_i + \\tau}.

Directions the data leave alone keep (about) the prior's variance ``1/tau``; weights
with curvature off the subspace are narrowed by it. The forms below follow from
``P D P = D + [U, DU] [[M, -I], [-I, 0]] [U, DU]^T`` with ``M = U^T D U``, and, with
``E = D^{-1} = diag(c + tau)`` and ``Q`` an orthonormal basis of the complement, from
``Q (Q^T D Q)^{-1} Q^T = E - E U (U^T E U)^{-1} U^T E`` and
``det(Q^T D Q) = det(D) det(U^T E U)``:

.. math::

    \\Sigma^{-1} = U \\,\\mathrm{diag}(a + \\tau)\\, U^\\top + E - E U (U^\\top E U)^{-1}
    U^\\top E, \\qquad
    \\log\\det \\Sigma^{-1} = \\sum_j \\log(a_j + \\tau) + \\sum_i \\log(c_i + \\tau)
    - \\log\\det(U^\\top E U).

The evidence's Occam term ``log det Sigma^{-1} - D log tau`` so counts every one of the
``D`` directions: the subspace through ``a``, the rest through ``c``. With ``c = 0`` all
of this is the ``complement='prior'`` posterior.

The diagonal is that of the residual curvature, the part of the GGN that ``span(U)``
does not already hold (:func:`residual_curvature`):

.. math::

    c_i = \\big(s\\,\\mathrm{diag}(G)/T - \\mathrm{diag}(U \\mathrm{diag}(a) U^\\top)\\big)_i
    = \\mathrm{diag}\\big(s\\,G/T - U \\mathrm{diag}(a) U^\\top\\big)_i \\;\\ge 0 ,

since ``s G / T - U diag(a) U^T`` is the GGN's curvature on the complement (positive
semi-definite; its diagonal is clamped at 0 against round-off). The plain diagonal
would count the top-``k`` curvature twice: a weight's ``diag(G)`` is dominated by the
leading eigen-directions, which the subspace treats exactly, and its complement
variance would shrink by their weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from laplace_glas.posterior.closed_forms import posterior_variances, proper_tau
from laplace_glas.posterior.diagonal_prior import LowRankDiagonalOperator, restricted_precision

__all__ = [
    "DiagonalComplementPosterior",
    "ProjectedComplementPosterior",
    "ProjectedInverse",
    "optimal_complement_prior_precision",
    "residual_curvature",
]


def residual_curvature(curvature: Any, U: torch.Tensor, a: torch.Tensor) -> Any:
    """The complement's curvature less what ``span(U)`` holds: for the GGN diagonal
    ``c`` ``(D,)``, ``max(c - diag(U diag(a) U^T), 0)`` (see the module); for a
    :class:`~laplace_glas.posterior.kron_complement.KronCurvature` its diagonal blocks
    deflated alike (:meth:`KronCurvature.deflated`; KFAC's Kronecker blocks stay as
    they are: ``K - U diag(a) U^T`` has no Kronecker form).
    """
    if isinstance(curvature, torch.Tensor):
        return (curvature - U.square() @ a).clamp_min(0)
    return curvature.deflated(U, a)


class ProjectedInverse:
    """``B = P E^{-1} P`` with ``P = I - U U^T``: the complement's covariance of
    ``complement='diag'`` (``E = diag(c + tau)``) and ``'kron'`` (``E = C + tau I``),
    applied to the last axis of ``W (..., D)``.

    :meth:`root` is ``W P F`` for a factor ``F F^T = E^{-1}`` (``B = R R^T`` with
    ``R = P F``), so that ``J B J^T = (J R)(J R)^T`` is formed as a Gram matrix,
    positive semi-definite in floating point. ``F`` need not be symmetric: KFAC's
    ``F = Q diag((lambda + tau)^{-1/2})`` skips the rotation back by ``Q^T``.

    Parameters
    ----------
    U : torch.Tensor
        ``(D, k)`` orthonormal.
    power_of_E : callable
        ``(W, p) -> W E^p`` on the last axis of ``W`` (``E`` symmetric positive definite).
    factor_of_E : callable
        ``(W, p) -> W F`` with ``F F^T = E^p``
        (:meth:`ProjectedComplementPosterior.factor_of_E`).

    """

    def __init__(
        self,
        U: torch.Tensor,
        power_of_E: Callable[[torch.Tensor, float], torch.Tensor],
        factor_of_E: Callable[[torch.Tensor, float], torch.Tensor],
    ):
        self.U, self.power_of_E, self.factor_of_E = U, power_of_E, factor_of_E

    def _project(self, W: torch.Tensor) -> torch.Tensor:
        return W - (W @ self.U) @ self.U.T

    def root(self, W: torch.Tensor) -> torch.Tensor:
        """``W P F`` with ``F F^T = E^{-1}``, so that ``W B W^T`` is its Gram matrix."""
        return self.factor_of_E(self._project(W), -1.0)

    def __call__(self, W: torch.Tensor) -> torch.Tensor:
        """``W P E^{-1} P`` (``B`` is symmetric: also ``(B W^T)^T``)."""
        return self._project(self.power_of_E(self._project(W), -1.0))


class ProjectedComplementPosterior:
    """The algebra shared by ``complement='diag'`` and ``'kron'``.

    Both are the posterior

    .. math::

        \\Sigma = U \\,\\mathrm{diag}(v)\\, U^\\top + P E^{-1} P, \\qquad
        v_j = \\frac{1}{a_j + \\tau}, \\qquad P = I - U U^\\top,

    for a symmetric positive definite ``E = C + tau I`` known through its powers.
    With ``M = U^T E^{-1} U``, ``P E^{-1} P = E^{-1} + [U, E^{-1}U] [[M, -I], [-I, 0]]
    [U, E^{-1}U]^T``; with ``Q`` an orthonormal basis of the complement,
    ``Q (Q^T E^{-1} Q)^{-1} Q^T = E - E U (U^T E U)^{-1} U^T E`` and
    ``det(Q^T E^{-1} Q) = det(E^{-1}) det(U^T E U)``, so

    .. math::

        \\Sigma^{-1} = U \\,\\mathrm{diag}(a + \\tau)\\, U^\\top + E
        - E U (U^\\top E U)^{-1} U^\\top E, \\qquad
        \\log\\det \\Sigma^{-1} = \\sum_j \\log(a_j + \\tau) + \\log\\det E
        - \\log\\det(U^\\top E U).

    Under a layerwise or per-weight prior ``P_0 = diag(p)`` (``tau`` then holds ``p``,
    ``(D,)``) the same construction holds with ``E = C + P_0`` and the subspace block
    ``diag(a + tau)`` replaced by the restricted precision
    ``A = diag(a) + U^T P_0 U = R diag(mu_A) R^T`` (``k x k``):

    .. math::

        \\Sigma = U A^{-1} U^\\top + P E^{-1} P, \\qquad
        \\log\\det \\Sigma^{-1} = \\log\\det A + \\log\\det E - \\log\\det(U^\\top E U),

    and the Occam term subtracts ``log det P_0 = sum_i log p_i``. For ``p = tau 1`` this
    is the scalar posterior above.

    Subclasses hold ``U`` (``(D, k)``), ``a`` (``(k,)``) and ``tau`` (0-dim, or ``p``
    ``(D,)``) and supply :meth:`power_of_E`, :meth:`log_det_E` and the matrix-free
    operator types of :attr:`covariance` and :attr:`precision`.
    """

    complement: str
    U: torch.Tensor
    a: torch.Tensor
    tau: torch.Tensor
    projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """``(U^T C U, U^T U, m, log det U^T U)`` where the caller has them, ``m`` the
    eigenvalues of ``(U^T U)^{-1/2} U^T C U (U^T U)^{-1/2}``: under a scalar prior the
    projected precision and its log-determinant then take no product with ``E``."""

    def power_of_E(self, W: torch.Tensor, power: float) -> torch.Tensor:
        """``W E^power`` on the last axis of ``W (..., D)``."""
        raise NotImplementedError

    def factor_of_E(self, W: torch.Tensor, power: float) -> torch.Tensor:
        """``W F`` with ``F F^T = E^power`` (default: the symmetric ``F = E^{power/2}``)."""
        return self.power_of_E(W, power / 2)

    def log_det_E(self) -> torch.Tensor:
        """``log det E``."""
        raise NotImplementedError

    def inverse_E_diagonal(self) -> torch.Tensor:
        """``diag(E^{-1})`` ``(D,)``."""
        raise NotImplementedError

    def marginal_variances(self) -> torch.Tensor:
        """``diag(Sigma)`` ``(D,)``: each weight's posterior variance.

        .. math::

            \\mathrm{diag}(U A^{-1} U^\\top) + \\mathrm{diag}(E^{-1})
            - 2\\,\\mathrm{rowsum}(U \\circ E^{-1} U) + \\mathrm{rowsum}((U M) \\circ U),

        ``M = U^T E^{-1} U`` (``diag(P E^{-1} P)`` expanded; ``O(k D)`` besides ``k``
        products with ``E^{-1}``).
        """
        U = self.U
        mu, R = self._subspace_eigen()
        inside = ((U @ R).square() / mu).sum(-1)
        EiU = self.power_of_E(U.T, -1.0).T
        M = U.T @ EiU
        outside = self.inverse_E_diagonal() - 2 * (U * EiU).sum(-1) + ((U @ M) * U).sum(-1)
        return inside + outside.clamp_min(0)

    def _covariance_operator(self, V: torch.Tensor, w: torch.Tensor) -> Any:
        """``E^{-1} + V diag(w) V^T``, matrix-free."""
        raise NotImplementedError

    def _precision_operator(self, V: torch.Tensor, w: torch.Tensor) -> Any:
        """``E + V diag(w) V^T``, matrix-free."""
        raise NotImplementedError

    @property
    def scalar_prior(self) -> bool:
        """Whether the prior is ``tau I`` (``tau`` 0-dim) rather than ``diag(p)``."""
        return self.tau.ndim == 0

    def subspace_precision(self) -> torch.Tensor:
        """``A = diag(a + tau)``, or ``diag(a) + U^T diag(p) U`` ``(k, k)``: the
        posterior precision restricted to ``span(U)``.
        """
        if self.scalar_prior:
            return torch.diag_embed(self.a + self.tau)
        return restricted_precision(self.U, self.a, self.tau)

    def _subspace_eigen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu_A, R)`` with ``A = R diag(mu_A) R^T`` (``R = I`` for a scalar prior)."""
        if self.scalar_prior:
            k = self.a.shape[0]
            return self.a + self.tau, torch.eye(k, dtype=self.U.dtype, device=self.U.device)
        return torch.linalg.eigh(self.subspace_precision())

    @property
    def subspace_variances(self) -> torch.Tensor:
        """``v_j = 1 / (a_j + tau)`` ``(k,)`` (``U^T P = 0``: the complement adds none);
        ``diag(A^{-1})``, the variance along each ``u_j``, under a non-scalar prior.
        """
        if self.scalar_prior:
            return posterior_variances(self.a, self.tau)
        mu, R = self._subspace_eigen()
        return (R.square() / mu).sum(-1)

    def covariance_factors(self) -> tuple[torch.Tensor, torch.Tensor, ProjectedInverse]:
        """``(V, v, B)`` with ``Sigma = V diag(v) V^T + B``, ``V = U R`` and ``v = 1 /
        mu_A`` (``V = U`` for a scalar prior) and ``B = P E^{-1} P``
        (:class:`ProjectedInverse`, whose ``root`` gives ``J P F`` with ``F F^T =
        E^{-1}``): two positive semi-definite terms, so a predictive variance cannot
        round below zero.
        """
        mu, R = self._subspace_eigen()
        return (
            self.U if self.scalar_prior else self.U @ R,
            1.0 / mu,
            ProjectedInverse(self.U, self.power_of_E, self.factor_of_E),
        )

    def _low_rank_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(V, w)`` with ``Sigma = E^{-1} + V diag(w) V^T``: ``V = [U, E^{-1}U] Q`` and
        ``w`` from the eigen-decomposition ``S = Q diag(w) Q^T`` of the ``2k x 2k``
        middle block ``[[diag(v) + M, -I], [-I, 0]]`` (``w`` has ``k`` negative entries;
        the matrix-free :attr:`covariance`, not the predictive).
        """
        U = self.U
        k = U.shape[1]
        eye = torch.eye(k, dtype=U.dtype, device=U.device)
        EiU = self.power_of_E(U.T, -1.0).T
        mu, R = self._subspace_eigen()
        S = torch.cat(
            [
                torch.cat([(R / mu) @ R.T + U.T @ EiU, -eye], dim=1),
                torch.cat([-eye, torch.zeros_like(eye)], dim=1),
            ]
        )
        w, Q = torch.linalg.eigh(S)
        return torch.cat([U, EiU], dim=1) @ Q, w

    @property
    def covariance(self) -> Any:
        """``Sigma`` as ``E^{-1} + V diag(w) V^T`` (matrix-free)."""
        return self._covariance_operator(*self._low_rank_factors())

    def _projected_precision(self) -> torch.Tensor:
        """``U^T E U`` ``(k, k)``: under a scalar prior ``U^T C U + tau U^T U`` from
        :attr:`projected` where the caller cached it (an evidence step of a
        hyperparameter loop is then ``O(k^2)`` plus the blocks' eigenvalues, not ``k``
        products with ``E`` and their backward pass), else ``k`` products with ``E``.
        """
        if self.projected is not None and self.scalar_prior:
            UCU, UU, _, _ = self.projected
            return UCU + self.tau * UU
        return self.U.T @ self.power_of_E(self.U.T, 1.0).T

    def _log_det_projected(self) -> torch.Tensor:
        """``log det(U^T E U)``; under a scalar prior with :attr:`projected`
        ``sum_i log(m_i + tau) + log det(U^T U)``, since ``U^T C U + tau U^T U =
        G^{1/2} (G^{-1/2} U^T C U G^{-1/2} + tau I) G^{1/2}`` (``G = U^T U``): no
        factorisation per evidence step, only ``k`` logarithms.
        """
        if self.projected is not None and self.scalar_prior:
            _, _, values, log_det_UU = self.projected
            return torch.log(values + self.tau).sum() + log_det_UU
        return torch.linalg.slogdet(self._projected_precision())[1]

    @property
    def precision(self) -> Any:
        """``Sigma^{-1} = E + [U, EU R] blockdiag(diag(a + tau), -diag(1/mu))
        [U, EU R]^T`` with ``U^T E U = R diag(mu) R^T`` (matrix-free).
        """
        EU = self.power_of_E(self.U.T, 1.0).T
        mu, R = torch.linalg.eigh(self.U.T @ EU)  # U^T E U, with E U formed once
        mu_A, R_A = self._subspace_eigen()
        V = torch.cat([self.U @ R_A, EU @ R], dim=1)
        return self._precision_operator(V, torch.cat([mu_A, -1.0 / mu]))

    @property
    def log_det_posterior_precision(self) -> torch.Tensor:
        """``log det A + log det E - log det(U^T E U)`` (``log det A = sum_j log(a_j +
        tau)`` for a scalar prior).
        """
        if self.scalar_prior:
            log_det_A = torch.log(self.a + self.tau).sum()
        else:
            log_det_A = torch.linalg.slogdet(self.subspace_precision())[1]
        return log_det_A + self.log_det_E() - self._log_det_projected()

    @property
    def log_det_ratio(self) -> torch.Tensor:
        """``log det Sigma^{-1} - log det P_0`` (``D log tau`` for a scalar prior): the
        Occam term over all ``D`` directions.
        """
        if self.scalar_prior:
            return self.log_det_posterior_precision - self.U.shape[0] * self.tau.log()
        return self.log_det_posterior_precision - self.tau.log().sum()

    def square_norm(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta^T Sigma^{-1} delta`` for ``delta`` ``(D,)`` or ``(n, D)``."""
        z = delta @ self.U
        if self.scalar_prior:
            inside = (z.square() * (self.a + self.tau)).sum(-1)
        else:
            inside = ((z @ self.subspace_precision()) * z).sum(-1)
        Ed = self.power_of_E(delta, 1.0)
        projected = Ed @ self.U
        solved = torch.linalg.solve(self._projected_precision(), projected.unsqueeze(-1))
        outside = (delta * Ed).sum(-1) - (projected * solved.squeeze(-1)).sum(-1)
        return inside + outside

    def log_normaliser(self) -> tuple[int, torch.Tensor]:
        """``(D, log det Sigma^{-1})``: a Gaussian density in ``R^D``."""
        return self.U.shape[0], self.log_det_posterior_precision

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, D)`` zero-mean draws ``U (sqrt(v) z) + P E^{-1/2} e``."""
        D, k = self.U.shape
        options = {"generator": generator, "device": self.U.device, "dtype": self.U.dtype}
        z = torch.randn(n_samples, k, **options)
        e = self.power_of_E(torch.randn(n_samples, D, **options), -0.5)
        mu, R = self._subspace_eigen()
        inside = ((z / mu.sqrt()) @ R.T) @ self.U.T
        return inside + e - (e @ self.U) @ self.U.T


class DiagonalComplementPosterior(ProjectedComplementPosterior):
    """The posterior of ``(U, a)`` with the GGN diagonal's curvature ``c`` off ``span(U)``
    under ``tau I``: :class:`ProjectedComplementPosterior` with ``E = diag(c + tau)``
    (see the module), behind the interface of
    :class:`~laplace_glas.posterior.closed_forms.ScalarPriorPosterior`.

    Parameters
    ----------
    vectors, curvature, tau : torch.Tensor
        As in :class:`~laplace_glas.posterior.closed_forms.ScalarPriorPosterior`, with
        ``tau > 0`` 0-dim or the prior's diagonal ``p > 0`` ``(D,)`` (layerwise or per
        weight).
    complement_curvature : torch.Tensor
        ``(D,)`` ``c >= 0``, scaled as ``curvature``.

    """

    complement = "diag"

    def __init__(
        self,
        vectors: torch.Tensor,
        curvature: torch.Tensor,
        tau: torch.Tensor,
        complement_curvature: torch.Tensor,
    ):
        self.U = vectors
        self.a = curvature
        self.tau = proper_tau(tau, "complement='diag' (the prior outside the GGN's curvature)")
        self.c = complement_curvature

    @property
    def diagonal(self) -> torch.Tensor:
        """``d = 1 / (c + tau)`` ``(D,)``."""
        return 1.0 / (self.c + self.tau)

    @property
    def complement_variance(self) -> torch.Tensor:
        """``d`` ``(D,)``: the variance of each weight's complement part."""
        return self.diagonal

    def power_of_E(self, W: torch.Tensor, power: float) -> torch.Tensor:
        """``W diag(c + tau)^power``."""
        return W * (self.c + self.tau).pow(power)

    def log_det_E(self) -> torch.Tensor:
        """``sum_i log(c_i + tau)``."""
        return torch.log(self.c + self.tau).sum()

    def inverse_E_diagonal(self) -> torch.Tensor:
        """``1 / (c + tau)``."""
        return self.diagonal

    def _covariance_operator(self, V: torch.Tensor, w: torch.Tensor) -> LowRankDiagonalOperator:
        return LowRankDiagonalOperator(self.diagonal, V, w)

    def _precision_operator(self, V: torch.Tensor, w: torch.Tensor) -> LowRankDiagonalOperator:
        return LowRankDiagonalOperator(self.c + self.tau, V, w)


def optimal_complement_prior_precision(
    vectors: torch.Tensor,
    curvature: torch.Tensor,
    complement_curvature: Any,
    square_norm: float,
) -> float:
    """The ``tau > 0`` that maximises the evidence of the ``complement='diag'`` or
    ``'kron'`` posterior.

    Up to terms free of ``tau`` the negative log evidence is

    .. math::

        g(\\tau) = \\frac{\\tau m}{2} + \\frac12 \\Big[\\sum_j \\log(a_j + \\tau)
        + \\sum_i \\log(c_i + \\tau) - \\sum_j \\log(\\beta_j + \\tau)
        - D \\log \\tau\\Big],

    with ``m = ||theta* - mu_0||^2``, ``c`` the eigenvalues of the complement's
    curvature ``C`` (the residual diagonal ``c`` itself for 'diag', KFAC's ``s lambda_B
    lambda_A / T`` for 'kron': a
    :class:`~laplace_glas.posterior.kron_complement.KronCurvature`; the curvature is
    passed as fitted and deflated here, :func:`residual_curvature`)
    and ``beta`` the eigenvalues of ``U^T C U`` (so ``log det(U^T E U) = sum_j
    log(beta_j + tau)``). Each evaluation is ``O(D)``: the minimum is bracketed on a
    log-spaced grid over ``[1e-8, 1e8]``, widened by ``1e8`` at the end it lies on (up
    to ``[1e-40, 1e40]``), and refined by Brent's method in ``log tau``.

    Raises
    ------
    ValueError
        If ``m <= 0`` (the optimum is ``tau -> inf``, as for the subspace alone), or the
        minimum still lies on an end of ``[1e-40, 1e40]``.

    """
    if not math.isfinite(square_norm) or square_norm <= 0:
        raise ValueError(
            "The marginal likelihood has no finite optimum in the prior precision: "
            f"||theta* - mu_0||^2 = {square_norm} (the optimum is tau -> inf)."
        )
    U = vectors.detach().to(torch.float64)
    complement_curvature = residual_curvature(complement_curvature, vectors, curvature)
    if isinstance(complement_curvature, torch.Tensor):
        c = complement_curvature.detach().to(U)
        projected = U.T @ (c[:, None] * U)
    else:  # KFAC's curvature: its eigenvalues and U^T C U from products with C
        zero = torch.zeros((), dtype=vectors.dtype, device=vectors.device)
        CU = complement_curvature.apply(vectors.detach().T, zero, 1.0).T
        c = complement_curvature.eigenvalues.detach().to(U)
        projected = U.T @ CU.detach().to(U)
    # the k-sized terms go to the host; the D curvatures c stay on their device
    a = curvature.detach().to(torch.float64).cpu().numpy()
    beta = torch.linalg.eigvalsh(projected).clamp(min=0).cpu().numpy()
    D = c.numel()

    def g(log_tau: float) -> float:
        tau = float(np.exp(log_tau))
        log_c = float(torch.log(c + tau).sum())
        logdet = (np.log(a + tau).sum() + log_c - np.log(beta + tau).sum()) - D * log_tau
        return 0.5 * tau * square_norm + 0.5 * logdet

    low_end, high_end = np.log(1e-8), np.log(1e8)
    while True:
        grid = np.linspace(low_end, high_end, round((high_end - low_end) / 0.23) + 1)
        values = np.array([g(x) for x in grid])
        best = int(np.argmin(values))
        if 0 < best < grid.size - 1:
            break
        if low_end <= np.log(1e-40) or high_end >= np.log(1e40):
            end = "1e-40" if best == 0 else "1e40"
            raise ValueError(
                "The marginal likelihood's optimum in the prior precision lies beyond "
                f"{end} (the evidence still rises at that end): no finite optimum to take."
            )
        if best == 0:
            low_end -= np.log(1e8)
        else:
            high_end += np.log(1e8)
    low, high = grid[best - 1], grid[best + 1]
    result = minimize_scalar(g, bounds=(low, high), method="bounded", options={"xatol": 1e-10})
    return float(np.exp(result.x))
