"""Closed forms of the Gaussian posterior restricted to an eigen-subspace.

With eigenpairs ``(lambda_j, u_j)`` of the mean-loss GGN, loss scaling ``s`` (1 for
the mean loss, N for the summed loss), temperature ``T`` and an isotropic prior
``N(mu_0, tau^{-1} I)``, write ``a_j = s * lambda_j / T`` for the curvature the
posterior sees along ``u_j``. Then

* posterior variance along ``u_j``:      ``v_j = 1 / (a_j + tau)``;
* log-determinant ratio:                  ``log det P / det P_0 = sum_j log(1 + a_j / tau)``;
* empirical-Bayes prior precision ``tau*`` maximises
  ``-(tau/2) m - (1/2) sum_j log(1 + a_j / tau)`` with ``m = ||theta* - mu_0||^2``,
  i.e. solves MacKay's fixed point ``tau m = sum_j a_j / (a_j + tau)``.

Nothing here depends on laplace-torch: tensors in, tensors out.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import brentq

__all__ = [
    "FactoredMatrix",
    "ScalarPriorPosterior",
    "SubspaceOperator",
    "log_det_ratio",
    "optimal_prior_precision",
    "posterior_variances",
    "proper_tau",
    "sample_subspace",
]


def posterior_variances(curvature: torch.Tensor, prior_precision: torch.Tensor) -> torch.Tensor:
    """``v_j = 1 / (a_j + tau)`` for curvatures ``a`` (k,) and scalar ``tau``."""
    return 1.0 / (curvature + prior_precision)


def log_det_ratio(curvature: torch.Tensor, prior_precision: torch.Tensor) -> torch.Tensor:
    """``sum_j log(1 + a_j / tau)``: the evidence's Occam term in the subspace.

    Differentiable in ``tau`` and in ``a`` (hence in the observation noise). The ratio
    ``a_j / tau`` is taken in float64: in float32 it overflows where ``a_j`` is large and
    ``tau`` small (``a = 1e30``, ``tau = 1e-10``) although its logarithm is about 90.
    """
    wide = torch.promote_types(curvature.dtype, torch.float64)
    ratio = curvature.to(wide) / torch.as_tensor(prior_precision).to(wide)
    return torch.log1p(ratio).sum().to(curvature.dtype)


def optimal_prior_precision(curvature: torch.Tensor | np.ndarray, square_norm: float) -> float:
    """Maximiser over ``tau`` of the Laplace evidence in the subspace.

    Solves ``tau * m = sum_j a_j / (a_j + tau)`` (``m = ||theta* - mu_0||^2``) for
    its unique positive root with Brent's method on ``log tau``: a 1-D problem in k
    numbers, microseconds rather than log-determinants.

    Parameters
    ----------
    curvature : array (k,)
        ``a_j = s * lambda_j / T >= 0``.
    square_norm : float
        ``m = ||theta* - mu_0||^2``.

    Returns
    -------
    float
        The optimal prior precision ``tau*``.

    Raises
    ------
    ValueError
        If ``m <= 0`` (the optimum is ``tau -> inf``), every ``a_j`` is zero (the
        optimum is ``tau -> 0``), or ``curvature`` is not a finite 1-d array of
        non-negative numbers (rounding below ``1e-6 max |a_j|`` is dropped).

    """
    try:
        a = np.asarray(
            curvature.detach().cpu().double() if isinstance(curvature, torch.Tensor) else curvature,
            dtype=np.float64,
        )
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"curvature must be a 1-d array or tensor of numbers, got {curvature!r} ({err})."
        ) from None
    if a.ndim != 1 or not np.isfinite(a).all():
        raise ValueError(
            f"curvature must be a finite 1-d array (k,), got shape {a.shape} with "
            f"{int((~np.isfinite(a)).sum())} non-finite entries."
        )
    if a.size and a.min() < -1e-6 * max(float(np.abs(a).max()), 1e-300):
        raise ValueError(
            f"curvature must be >= 0 (a GGN's eigenvalues), got a minimum of {a.min():.3g}."
        )
    a = a[a > 0]
    m = float(square_norm)
    if not math.isfinite(m) or m <= 0:
        raise ValueError(
            "The marginal likelihood has no finite optimum in the prior precision: "
            f"||theta* - mu_0||^2 = {m} (the optimum is tau -> inf)."
        )
    if a.size == 0:
        raise ValueError(
            "All curvatures in the subspace are zero: the marginal likelihood is "
            "maximal as tau -> 0."
        )

    def stationarity(log_tau: float) -> float:
        tau = math.exp(log_tau)
        return float(np.sum(a / (a + tau))) - m * tau

    # gamma(tau) <= k gives tau* <= k / m; at tau -> 0 the function tends to k > 0.
    hi = math.log(a.size / m)
    lo = hi - 10.0
    while stationarity(lo) <= 0:
        lo -= 10.0
    if stationarity(hi) >= 0:
        return math.exp(hi)
    return math.exp(brentq(stationarity, lo, hi, xtol=1e-12, rtol=1e-12))


def sample_subspace(
    vectors: torch.Tensor,
    variances: torch.Tensor,
    n_samples: int,
    complement_variance: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Zero-mean draws ``U z + (I - U U^T) e``.

    ``z ~ N(0, diag(variances))`` and ``e ~ N(0, c I)`` with ``c = complement_variance``
    (no complement term when ``c == 0``). Returns ``(n_samples, D)``.
    """
    D, k = vectors.shape
    z = torch.randn(n_samples, k, generator=generator, device=vectors.device, dtype=vectors.dtype)
    draws = (z * variances.sqrt()) @ vectors.T
    c = torch.as_tensor(complement_variance, device=vectors.device, dtype=vectors.dtype)
    if bool(c > 0):
        e = torch.randn(
            n_samples, D, generator=generator, device=vectors.device, dtype=vectors.dtype
        )
        e = e - (e @ vectors) @ vectors.T
        draws = draws + c.sqrt() * e
    return draws


class FactoredMatrix:
    """A ``D x D`` matrix held as factors around a ``(D, k)`` matrix ``vectors``: its
    shape, dtype and device are those of ``vectors`` (base of the posterior operators).
    """

    vectors: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(D, D)``."""
        D = self.vectors.shape[0]
        return (D, D)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the factors."""
        return self.vectors.dtype

    @property
    def device(self) -> torch.device:
        """Device of the factors."""
        return self.vectors.device

    def to_dense(self) -> torch.Tensor:
        """The ``D x D`` matrix (subclasses)."""
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.allclose``, ``torch.equal`` and ``torch.einsum`` accept the operators
        (laplace-torch's code and tests apply them to posterior precisions and
        covariances) through their ``D x D`` matrices, like the dense computations they
        replace. Other torch functions are refused.
        """
        if func not in (torch.einsum, torch.allclose, torch.equal):
            return NotImplemented
        dense = (a.to_dense() if isinstance(a, FactoredMatrix) else a for a in args)
        return func(*dense, **(kwargs or {}))


class SubspaceOperator(FactoredMatrix):
    """The symmetric matrix ``A = U diag(d) U^T + c (I - U U^T)``, never formed.

    Used for the posterior covariance (``d = v``, ``c = 0`` or ``1/tau``) and the
    posterior precision (``d = a + tau``, ``c = tau``, or ``c = inf`` for the
    restricted GLAS posterior, which has no variance outside ``span(U)``).

    Parameters
    ----------
    vectors : torch.Tensor
        ``(D, k)`` orthonormal columns ``U``.
    values : torch.Tensor
        ``(k,)`` the eigenvalues ``d`` of ``A`` on ``span(U)``.
    complement : float or torch.Tensor
        The eigenvalue ``c`` on the orthogonal complement (may be ``inf``).

    """

    def __init__(
        self, vectors: torch.Tensor, values: torch.Tensor, complement: float | torch.Tensor
    ):
        self.vectors = vectors
        self.values = values
        self.complement = torch.as_tensor(complement, dtype=vectors.dtype, device=vectors.device)

    def _check_finite(self) -> None:
        if not torch.isfinite(self.complement):
            raise ValueError(
                "This matrix is infinite outside span(U): the restricted GLAS "
                "posterior (complement='zero') has no variance there. Use the "
                "covariance, or complement='prior' for a finite precision."
            )

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``A @ x`` for ``x`` of shape ``(D,)`` or ``(D, m)``."""
        U = self.vectors
        coeffs = U.T @ x
        inside = U @ (self.values.reshape(-1, *([1] * (x.ndim - 1))) * coeffs)
        if self.complement == 0:
            return inside
        self._check_finite()
        return inside + self.complement * (x - U @ coeffs)

    def diagonal(self) -> torch.Tensor:
        """``diag(A)`` in O(D k)."""
        U2 = self.vectors.square()
        diag = U2 @ self.values
        if self.complement == 0:
            return diag
        self._check_finite()
        return diag + self.complement * (1 - U2.sum(dim=1))

    def to_dense(self) -> torch.Tensor:
        """Materialise the ``D x D`` matrix (only when explicitly asked for)."""
        U = self.vectors
        dense = (U * self.values) @ U.T
        if self.complement == 0:
            return dense
        self._check_finite()
        eye = torch.eye(U.shape[0], dtype=U.dtype, device=U.device)
        return dense + self.complement * (eye - U @ U.T)

    def logdet(self) -> torch.Tensor:
        """``log det A = sum_j log d_j + (D - k) log c`` in O(k).

        ``-inf`` for a singular matrix (``c = 0`` with ``k < D``, as ``torch.logdet``
        returns); refused for ``c = inf`` (complement='zero' precision), whose
        determinant is infinite: the evidence uses
        ``ActiveSubspaceLaplace.log_det_posterior_precision`` instead.
        """
        self._check_finite()
        D, k = self.vectors.shape
        logdet = self.values.log().sum()
        if D > k:
            logdet = logdet + (D - k) * self.complement.log()
        return logdet

    def clone(self) -> SubspaceOperator:
        """A copy with cloned factors (``torch.Tensor.clone``'s contract)."""
        return SubspaceOperator(self.vectors.clone(), self.values.clone(), self.complement.clone())

    def dense_or_low_rank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U diag(d) U^T + c (I - U U^T), c)`` with the complement term left out when
        ``c`` is infinite (then two operators are equal when their ``c`` and this
        part are).
        """
        if torch.isfinite(self.complement):
            return self.to_dense(), self.complement
        U = self.vectors
        return (U * self.values) @ U.T, self.complement

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.allclose``, ``torch.equal`` and ``torch.einsum`` accept operators
        (laplace-torch's code and tests apply them to posterior precisions and
        covariances); they form the ``D x D`` matrices, like the dense computations they
        replace. Other torch functions are refused.
        """
        kwargs = kwargs or {}
        if func is torch.einsum:  # e.g. J Sigma J^T written with a dense covariance
            return func(*(a.to_dense() if isinstance(a, SubspaceOperator) else a for a in args))
        if func in (torch.allclose, torch.equal):
            a, b = args[:2]
            (a, ca), (b, cb) = _comparable(a), _comparable(b)
            if torch.isinf(ca) or torch.isinf(cb):
                if not bool(torch.equal(ca, cb)):
                    return False
            return func(a, b, *args[2:], **kwargs)
        return NotImplemented

    def __repr__(self) -> str:
        D, k = self.vectors.shape
        return f"SubspaceOperator(D={D}, k={k}, complement={float(self.complement):.3g})"


def _comparable(x: SubspaceOperator | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(x, SubspaceOperator):
        return x.dense_or_low_rank()
    x = torch.as_tensor(x)
    return x, torch.zeros((), dtype=x.dtype, device=x.device)


class ScalarPriorPosterior:
    """The GLAS posterior of ``(U, a)`` under the isotropic prior precision ``tau I``.

    The closed forms of this module behind the interface of
    :class:`~laplace_glas.posterior.diagonal_prior.DiagonalPriorPosterior`:
    ``v_j = 1 / (a_j + tau)``, ``Sigma = U diag(v) U^T + c (I - U U^T)`` with ``c = 0``
    (``complement='zero'``) or ``c = 1/tau`` ('prior'). ``tau = 0`` (a flat prior) is
    accepted; what needs a proper prior refuses it when asked for.

    Parameters
    ----------
    vectors, curvature : torch.Tensor
        ``U`` and ``a``, as in
        :class:`~laplace_glas.posterior.diagonal_prior.DiagonalPriorPosterior`.
    tau : torch.Tensor
        0-dim ``tau >= 0``.
    complement : {'zero', 'prior'}
        No variance off ``span(U)``, or the prior's.

    """

    def __init__(
        self, vectors: torch.Tensor, curvature: torch.Tensor, tau: torch.Tensor, complement: str
    ):
        self.U = vectors
        self.a = curvature
        self.tau = tau
        self.complement = complement

    def proper_tau(self, what: str) -> torch.Tensor:
        """``tau``, refused where ``what`` needs a proper prior (``tau > 0``)."""
        return proper_tau(self.tau, what)

    @property
    def subspace_variances(self) -> torch.Tensor:
        """``v_j = 1 / (a_j + tau)`` ``(k,)``; every ``a_j > 0`` needed when ``tau = 0``."""
        curvature, tau = self.a, self.tau
        if tau == 0 and bool((curvature <= 0).any()):
            raise ValueError(
                "With prior_precision = 0 the posterior is improper: "
                f"{int((curvature <= 0).sum())} of the {curvature.numel()} kept directions "
                "have zero curvature (infinite variance). Set a positive prior_precision "
                "or use fewer components."
            )
        return posterior_variances(curvature, tau)

    @property
    def complement_variance(self) -> torch.Tensor:
        """``c``: ``1/tau`` for ``complement='prior'`` (needs ``tau > 0``), else 0."""
        if self.complement == "prior":
            return 1.0 / self.proper_tau("complement='prior' (the prior's variance off U)")
        return torch.zeros((), device=self.U.device, dtype=self.U.dtype)

    @property
    def precision(self) -> SubspaceOperator:
        """``U diag(a + tau) U^T + c (I - U U^T)``, ``c = tau`` ('prior') or ``inf``."""
        complement = self.tau if self.complement == "prior" else math.inf
        return SubspaceOperator(self.U, self.a + self.tau, complement)

    @property
    def covariance(self) -> SubspaceOperator:
        """``U diag(v) U^T + c (I - U U^T)``."""
        return SubspaceOperator(self.U, self.subspace_variances, self.complement_variance)

    def covariance_factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(V, w, d)`` with ``Sigma = V diag(w) V^T + d I``: ``(U, v, None)`` ('zero')
        or ``(U, v - 1/tau, 1/tau)`` ('prior'; ``d`` 0-dim).
        """
        v = self.subspace_variances
        if self.complement == "prior":
            c = self.complement_variance
            return self.U, v - c, c
        return self.U, v, None

    @property
    def log_det_posterior_precision(self) -> torch.Tensor:
        """``sum_j log(a_j + tau) + (D - k) log tau`` (needs ``tau > 0``)."""
        tau = self.proper_tau("log_det_posterior_precision")
        D, k = self.U.shape
        return torch.log(self.a + tau).sum() + (D - k) * tau.log()

    @property
    def log_det_ratio(self) -> torch.Tensor:
        """``sum_j log(1 + a_j / tau)`` (both complements; needs ``tau > 0``)."""
        return log_det_ratio(self.a, self.proper_tau("The evidence"))

    def square_norm(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta^T P delta`` for ``delta`` ``(D,)`` or ``(n, D)``: ``sum_j (a_j + tau)
        z_j^2`` (``z = U^T delta``) plus ``tau |delta - U z|^2`` for 'prior'.
        """
        z = delta @ self.U
        inside = (z.square() * (self.a + self.tau)).sum(-1)
        if self.complement == "zero":
            return inside
        outside = delta.square().sum(-1) - z.square().sum(-1)
        return inside + self.tau * outside

    def log_normaliser(self) -> tuple[int, torch.Tensor]:
        """``(D, log det P)`` for 'prior', ``(k, -sum_j log v_j)`` for 'zero'."""
        if self.complement == "prior":
            return self.U.shape[0], self.log_det_posterior_precision
        return self.U.shape[1], -torch.log(self.subspace_variances).sum()

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, D)`` zero-mean draws ``U z + (I - U U^T) e`` (:func:`sample_subspace`)."""
        return sample_subspace(
            self.U, self.subspace_variances, n_samples, self.complement_variance, generator
        )


def proper_tau(tau: torch.Tensor, what: str) -> torch.Tensor:
    """``tau`` (0-dim, or a per-weight ``(D,)`` prior diagonal), refused with a
    ``ValueError`` where ``what`` needs a proper prior.
    """
    if bool((tau == 0).any()):
        raise ValueError(
            f"{what} needs a proper prior: prior_precision is 0. Set a positive "
            "prior_precision (e.g. with optimize_prior_precision())."
        )
    return tau
