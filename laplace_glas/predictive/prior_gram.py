"""The prior's term ``J P_0^{-1} J^T`` of the linearised predictive.

With ``complement='prior'`` the posterior keeps the prior's variance off ``span(U)``,
and the 'glm' covariance gains ``J P_0^{-1} J^T`` (corrected inside ``span(U)`` by the
low-rank factors): ``J J^T / tau`` for a scalar prior, ``J diag(1/p) J^T`` for a
layerwise or diagonal one (:meth:`laplace_glas.posterior.prior.Prior.inverse_gram`).
:class:`PriorGram` is a mixin of
:class:`~laplace_glas.predictive.subspace_predictive.SubspacePredictive`; it reads
``model``, ``_param_names``, ``_param_shapes``, ``dict_key_x`` and ``_prior`` of the
class it is mixed into.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from laplace_glas.predictive.jvp import jacobian_gram, row_chunks

__all__ = ["PriorGram"]


class PriorGram:
    """Jacobian Gram matrices over the weights under inference (a mixin; see the
    module).
    """

    def _prior_gram_diagonal(self, X: Any, theta: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """The diagonal ``(n, C)`` of :meth:`_prior_gram`, ``chunk_size`` inputs at a time
        (the calibration sweeps with ``complement='prior'``).
        """
        return torch.cat(
            [
                self._prior_gram(rows, theta).diagonal(dim1=-2, dim2=-1)
                for rows in row_chunks(X, chunk_size, self.dict_key_x)
            ]
        )

    def _prior_gram(self, X: Any, theta: torch.Tensor, joint: bool = False) -> torch.Tensor:
        """``J J^T`` over the weights under inference, for ``complement='prior'``."""
        return self._jacobian_gram(X, theta, joint)

    def _jacobian_gram(
        self,
        X: Any,
        theta: torch.Tensor,
        joint: bool,
        weights: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``J diag(weights) J^T`` (or ``J B J^T`` for an operator ``B``) over all
        weights (``J J^T`` without ``weights``).
        """
        return jacobian_gram(
            self.model,
            self._param_names,
            self._param_shapes,
            theta,
            X,
            joint=joint,
            dict_key_x=self.dict_key_x,
            weights=weights,
        )

    def _diagonal_gram(
        self,
        X: Any,
        theta: torch.Tensor,
        diagonal: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
        joint: bool = False,
    ) -> torch.Tensor:
        """``J diag(d) J^T`` for the diagonal part ``d`` of the covariance: ``d J J^T``
        (:meth:`_prior_gram`) for a 0-dim ``d``, else over all weights; ``J B J^T`` for
        a base operator ``B`` (KFAC's ``E^{-1}`` of ``complement='kron'``).
        """
        if callable(diagonal):
            return self._jacobian_gram(X, theta, joint, weights=diagonal)
        if diagonal.ndim == 0:
            return self._prior_gram(X, theta, joint=joint) * diagonal
        return self._jacobian_gram(X, theta, joint, weights=diagonal)
