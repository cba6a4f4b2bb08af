"""The prior precision ``P_0`` as one object: scalar, layerwise or diagonal.

laplace-torch's ``prior_precision`` is a ``(1,)`` tensor ``tau`` (``P_0 = tau I``), one
value per parameter tensor ``(n_layers,)`` (``P_0 = diag(p)`` with ``p_l`` repeated over
layer ``l``'s weights) or one per weight ``(D,)``. :meth:`Prior.of` turns it into a
:class:`ScalarPrior`, :class:`LayerwisePrior` or :class:`DiagonalPrior`; the subspace
posterior then asks the object for what it needs instead of branching on the shape:

* :meth:`Prior.diagonal`: the per-weight diagonal ``p`` ``(D,)``;
* :meth:`Prior.projected_gram`: ``U^T P_0 U`` ``(k, k)`` (and ``U^T P_0^{-1} U``);
* :meth:`Prior.complement_variance`: ``(I - U U^T) P_0^{-1} (I - U U^T)``;
* :meth:`Prior.log_det`: ``log det P_0``; :meth:`Prior.scatter`: ``delta^T P_0 delta``;
* :meth:`Prior.inverse_gram`: ``J P_0^{-1} J^T`` from a weighted Jacobian Gram;
* :meth:`Prior.posterior`: the posterior of ``(U, a)`` under this prior, the closed
  forms of :class:`~laplace_glas.posterior.closed_forms.ScalarPriorPosterior` for a
  scalar prior, the ``O(k^2 D)`` algebra of
  :class:`~laplace_glas.posterior.diagonal_prior.DiagonalPriorPosterior` otherwise.

The algebra of :mod:`laplace_glas.posterior.diagonal_prior` is importable from here as
well (its former home).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from laplace_glas.posterior.closed_forms import ScalarPriorPosterior, SubspaceOperator, proper_tau
from laplace_glas.posterior.diagonal_prior import DiagonalPriorPosterior as DiagonalPriorPosterior
from laplace_glas.posterior.diagonal_prior import (
    LowRankDiagonalOperator as LowRankDiagonalOperator,
)
from laplace_glas.posterior.diagonal_prior import capacitance as capacitance
from laplace_glas.posterior.diagonal_prior import layer_grams as layer_grams
from laplace_glas.posterior.diagonal_prior import log_det_capacitance as log_det_capacitance
from laplace_glas.posterior.diagonal_prior import restricted_precision as restricted_precision

__all__ = ["DiagonalPrior", "LayerwisePrior", "Prior", "ScalarPrior"]

#: ``gram(w)`` returns ``J diag(w) J^T``; ``gram(None)`` the unweighted ``J J^T``.
Gram = Callable[[torch.Tensor | None], torch.Tensor]


class Prior(ABC):
    """A Gaussian prior precision ``P_0 = diag(p)`` over ``D`` weights, ``p > 0``.

    Build one with :meth:`of`. Subclasses store ``values`` (laplace-torch's
    ``prior_precision``) and the parameter ``sizes`` it is laid out over.

    Attributes
    ----------
    values : torch.Tensor
        The prior precision as given: ``(1,)``, ``(n_layers,)`` or ``(D,)``.
    sizes : tuple of int
        The number of weights of each parameter tensor (``n_layers`` entries).
    n_params : int
        ``D``.

    """

    def __init__(
        self,
        values: torch.Tensor,
        sizes: Sequence[int],
        n_params: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        self.values = values
        self.sizes = tuple(int(n) for n in sizes)
        self.n_params = sum(self.sizes) if n_params is None else int(n_params)
        self.dtype = values.dtype if dtype is None else dtype
        self.device = values.device if device is None else torch.device(device)

    @staticmethod
    def of(
        prior_precision: float | torch.Tensor,
        sizes: Sequence[int],
        n_params: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        allow_flat: bool = False,
        check: bool = True,
    ) -> Prior:
        """The :class:`Prior` of a laplace-torch ``prior_precision``.

        Parameters
        ----------
        prior_precision : float or torch.Tensor
            A number or a tensor of shape ``()`` or ``(1,)`` (:class:`ScalarPrior`),
            ``(D,)`` (:class:`DiagonalPrior`; wins when ``D == n_layers``, as in
            laplace-torch) or ``(n_layers,)`` (:class:`LayerwisePrior`).
        sizes : sequence of int
            Weights per parameter tensor, in the order of ``model.parameters()``.
        n_params : int, optional
            ``D`` (default ``sum(sizes)``; a subnetwork's ``D_S`` differs).
        dtype, device : optional
            Of the expanded diagonal (default: those of ``prior_precision``).
        allow_flat : bool
            Accept a scalar ``tau = 0`` (a flat prior; the operations that need a proper
            prior refuse it when asked for). Layerwise and diagonal values must be > 0.
        check : bool
            Validate shape and values (the ``ValueError`` names the problem); ``False``
            for a value validated before (no device synchronisation).

        """
        if isinstance(prior_precision, torch.Tensor):
            values = prior_precision.to(dtype=dtype or prior_precision.dtype, device=device)
        else:
            values = torch.as_tensor(
                prior_precision, dtype=dtype or torch.get_default_dtype(), device=device
            )
        sizes = [int(n) for n in sizes]
        D = sum(sizes) if n_params is None else int(n_params)
        if check:
            _check_values(values, len(sizes), D, allow_flat)
        values = values.reshape(-1)
        if values.numel() == 1:
            cls: type[Prior] = ScalarPrior
        elif values.numel() == D:
            cls = DiagonalPrior
        elif values.numel() == len(sizes):
            cls = LayerwisePrior
        else:
            raise ValueError(
                "prior_precision must be one number, one value per parameter tensor "
                f"(n_layers={len(sizes)}) or one per weight (D={D}); got one of shape "
                f"{tuple(values.shape)}."
            )
        return cls(values, sizes, D, dtype, device)

    # ------------------------------------------------------------------ algebra
    @property
    def tau(self) -> torch.Tensor | None:
        """The isotropic precision ``tau`` (0-dim), None when ``P_0`` is not ``tau I``."""
        return None

    @abstractmethod
    def diagonal(self) -> torch.Tensor:
        """``p`` ``(D,)``: the per-weight prior precision (``diag(P_0)``)."""

    def projected_gram(self, U: torch.Tensor) -> torch.Tensor:
        """``U^T P_0 U = U^T diag(p) U`` ``(k, k)`` for ``U`` ``(D, k)`` (``O(k^2 D)``)."""
        return (U.T * self.diagonal()) @ U

    def inverse_projected_gram(self, U: torch.Tensor) -> torch.Tensor:
        """``U^T P_0^{-1} U = U^T diag(1/p) U`` ``(k, k)`` (``O(k^2 D)``)."""
        return (U.T / self.diagonal()) @ U

    def complement_variance(self, U: torch.Tensor) -> SubspaceOperator | LowRankDiagonalOperator:
        """The prior's covariance off ``span(U)``: ``(I - U U^T) P_0^{-1} (I - U U^T)``.

        A matrix-free ``D x D`` operator for ``U`` ``(D, k)`` orthonormal. With
        ``s = 1/p``, ``G = U^T diag(s) U`` and ``F = [U, diag(s) U]`` ``(D, 2k)`` it is
        ``diag(s) + F S F^T``, ``S = [[G, -I], [-I, 0]]`` (``O(k^2 D)``). For a scalar
        prior, ``(1/tau) (I - U U^T)``: the variance ``complement='prior'`` adds off
        ``span(U)``. (Under a layerwise or diagonal prior the posterior's covariance
        off ``span(U)`` is Woodbury's, which also couples to ``span(U)``.)
        """
        s = 1.0 / self.diagonal()
        k = U.shape[1]
        eye = torch.eye(k, dtype=U.dtype, device=U.device)
        inner = torch.cat(
            [
                torch.cat([(U.T * s) @ U, -eye], dim=1),
                torch.cat([-eye, torch.zeros_like(eye)], dim=1),
            ]
        )
        weights, Q = torch.linalg.eigh(inner)
        F = torch.cat([U, s[:, None] * U], dim=1)
        return LowRankDiagonalOperator(s, F @ Q, weights)

    def log_det(self) -> torch.Tensor:
        """``log det P_0 = sum_i log p_i`` over the ``D`` weights."""
        return self.diagonal().log().sum()

    def scatter(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta^T P_0 delta = sum_i p_i delta_i^2`` for ``delta = theta - mu_0``
        ``(D,)`` or ``(n, D)``.
        """
        return (delta.square() * self.diagonal()).sum(-1)

    def inverse_gram(self, gram: Gram) -> torch.Tensor:
        """``J P_0^{-1} J^T = gram(1/p)`` for ``gram(w) = J diag(w) J^T``."""
        return gram(1.0 / self.diagonal())

    def check_embedded(self, owner: str) -> None:
        """Refuse a posterior whose directions are embedded in a larger network
        (``owner``, e.g. a subnetwork's): only a scalar prior is implemented there.
        """
        raise ValueError(
            f"A layerwise or diagonal prior_precision is not implemented for "
            f"{owner} (its directions are embedded in the network); "
            "use a scalar prior_precision."
        )

    def posterior(
        self,
        U: torch.Tensor,
        curvature: torch.Tensor,
        complement: str,
        layer_grams: Callable[[], torch.Tensor] | None = None,
    ) -> ScalarPriorPosterior | DiagonalPriorPosterior:
        """The posterior of ``(U, a)`` under this prior.

        Parameters
        ----------
        U : torch.Tensor
            ``(D, k)`` orthonormal eigenvectors.
        curvature : torch.Tensor
            ``(k,)`` ``a >= 0``.
        complement : {'zero', 'prior'}
            No variance off ``span(U)``, or the prior's.
        layer_grams : callable, optional
            Returns the cached ``(n_layers, k, k)`` blocks ``U_l^T U_l`` (used by a
            layerwise prior only).

        """
        return DiagonalPriorPosterior(U, curvature, self.diagonal(), complement)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(D={self.n_params}, n_layers={len(self.sizes)})"


class ScalarPrior(Prior):
    """``P_0 = tau I``: one precision ``tau`` for all ``D`` weights (``tau = 0`` is a
    flat prior, refused where a proper one is needed).
    """

    @property
    def tau(self) -> torch.Tensor:
        """``tau`` (0-dim)."""
        return self.values.reshape(())

    def diagonal(self) -> torch.Tensor:
        """``tau 1_D`` (laplace-torch's ``prior_precision_diag``)."""
        return self.values * torch.ones(self.n_params, device=self.device, dtype=self.dtype)

    def projected_gram(self, U: torch.Tensor) -> torch.Tensor:
        """``U^T (tau I) U = tau I_k`` (``U`` orthonormal)."""
        return self.tau * torch.eye(U.shape[1], dtype=U.dtype, device=U.device)

    def inverse_projected_gram(self, U: torch.Tensor) -> torch.Tensor:
        """``I_k / tau`` (``U`` orthonormal; needs ``tau > 0``)."""
        tau = proper_tau(self.tau, "U^T P_0^{-1} U")
        return torch.eye(U.shape[1], dtype=U.dtype, device=U.device) / tau

    def complement_variance(self, U: torch.Tensor) -> SubspaceOperator:
        """``(1/tau) (I - U U^T)`` (needs ``tau > 0``)."""
        tau = proper_tau(self.tau, "complement='prior' (the prior's variance off U)")
        return SubspaceOperator(U, U.new_zeros(U.shape[1]), 1.0 / tau)

    def log_det(self) -> torch.Tensor:
        """``D log tau`` (needs ``tau > 0``)."""
        return self.n_params * proper_tau(self.tau, "log_det_prior_precision").log()

    def scatter(self, delta: torch.Tensor) -> torch.Tensor:
        """``tau |delta|^2``."""
        return self.tau * delta.square().sum(-1)

    def inverse_gram(self, gram: Gram) -> torch.Tensor:
        """``J J^T / tau``: one unweighted Gram ``gram(None)``, then a scale."""
        return gram(None) * (1.0 / self.tau)

    def check_embedded(self, owner: str) -> None:
        """A scalar prior applies to embedded directions too: nothing to refuse."""

    def posterior(
        self,
        U: torch.Tensor,
        curvature: torch.Tensor,
        complement: str,
        layer_grams: Callable[[], torch.Tensor] | None = None,
    ) -> ScalarPriorPosterior:
        """The closed forms: :class:`~laplace_glas.posterior.closed_forms.ScalarPriorPosterior`."""
        return ScalarPriorPosterior(U, curvature, self.tau, complement)


class LayerwisePrior(Prior):
    """``P_0 = diag(p)`` with one ``p_l > 0`` per parameter tensor, repeated over its
    ``sizes[l]`` weights.

    With the blocks ``G_l = U_l^T U_l`` (:func:`layer_grams`), ``U^T P_0^{+-1} U =
    sum_l p_l^{+-1} G_l``: ``O(L k^2)`` per prior once the blocks are known.
    """

    def diagonal(self) -> torch.Tensor:
        """``(p_1 1_{n_1}, ..., p_L 1_{n_L})`` (laplace-torch's ``prior_precision_diag``)."""
        return torch.cat(
            [
                p * torch.ones(n, device=self.device, dtype=self.dtype)
                for p, n in zip(self.values, self.sizes, strict=True)
            ]
        )

    def projected_gram(self, U: torch.Tensor, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_l p_l U_l^T U_l`` (``blocks``: the ``(L, k, k)`` ``U_l^T U_l`` if known)."""
        blocks = layer_grams(U, list(self.sizes)) if blocks is None else blocks
        return torch.einsum("lij,l->ij", blocks, self.values)

    def inverse_projected_gram(
        self, U: torch.Tensor, blocks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``sum_l U_l^T U_l / p_l``."""
        blocks = layer_grams(U, list(self.sizes)) if blocks is None else blocks
        return torch.einsum("lij,l->ij", blocks, 1.0 / self.values)

    def posterior(
        self,
        U: torch.Tensor,
        curvature: torch.Tensor,
        complement: str,
        layer_grams: Callable[[], torch.Tensor] | None = None,
    ) -> DiagonalPriorPosterior:
        """:class:`DiagonalPriorPosterior` with both projected Grams from the blocks."""
        blocks = None if layer_grams is None else layer_grams()
        grams = (self.projected_gram(U, blocks), self.inverse_projected_gram(U, blocks))
        return DiagonalPriorPosterior(U, curvature, self.diagonal(), complement, grams)


class DiagonalPrior(Prior):
    """``P_0 = diag(p)`` with one ``p_i > 0`` per weight."""

    def diagonal(self) -> torch.Tensor:
        """``p`` as given."""
        return self.values


def _check_values(values: torch.Tensor, n_layers: int, D: int, allow_flat: bool) -> None:
    """Shape ``()``, ``(1,)``, ``(n_layers,)`` or ``(D,)``; finite; ``> 0`` (``>= 0``
    for a scalar with ``allow_flat``).
    """
    if values.ndim > 1 or (values.ndim == 1 and values.numel() not in (1, n_layers, D)):
        raise ValueError(
            "prior_precision must be one number, one value per parameter tensor "
            f"(n_layers={n_layers}) or one per weight (D={D}); got one of shape "
            f"{tuple(values.shape)}."
        )
    if not values.is_floating_point():
        raise ValueError(f"prior_precision must be floating point, got {values.dtype}.")
    values = values.detach()
    scalar = values.numel() == 1
    if not bool(torch.isfinite(values).all()):
        raise ValueError("prior_precision must be finite; got NaN or inf.")
    smallest = float(values.min())
    if smallest < 0 or (smallest == 0 and not (scalar and allow_flat)):
        bound = ">= 0" if scalar and allow_flat else "> 0"
        raise ValueError(f"prior_precision must be {bound} in every entry; got min {smallest:.3g}.")
