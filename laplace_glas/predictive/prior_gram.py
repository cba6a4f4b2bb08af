"""The prior's term ``J P_0^{-1} J^T`` of the linearised predictive.

With ``complement='prior'`` the posterior keeps the prior's variance off ``span(U)``,
and the 'glm' covariance gains ``J P_0^{-1} J^T`` (corrected inside ``span(U)`` by the
low-rank factors): ``J J^T / tau`` for a scalar prior, ``J diag(1/p) J^T`` for a
layerwise or diagonal one (:meth:`laplace_glas.posterior.prior.Prior.inverse_gram`).
:class:`PriorGram` is a mixin of
:class:`~laplace_glas.predictive.subspace_predictive.SubspacePredictive`; it reads
``model``, ``_param_names``, ``_param_shapes``, ``dict_key_x``, ``enable_backprop``,
``_out_shape``, ``_prior``, ``_to_device`` and ``_network_weights`` of the class it is
mixed into.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from laplace_glas.curvature.operators.factored import factored_jacobian
from laplace_glas.predictive.jvp import jacobian_gram, jacobian_rows, row_chunks, weighted_gram

__all__ = ["GRAM_ELEMENTS", "PriorGram"]

GRAM_ELEMENTS = 2**22
"""Jacobian entries a chunk of the factored Jacobian holds at most (4 Mi numbers: 32 MiB
in float64), beside reverse mode's chunks of 32 inputs."""


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
        weights (``J J^T`` without ``weights``): ``J`` from the factors where the model
        qualifies (:meth:`_factored_jacobian`), else by reverse mode over the weights.
        """
        J = self._factored_jacobian(X, theta, joint)
        if J is not None:
            return weighted_gram(J, weights)
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

    def output_jacobians(self, X: Any) -> torch.Tensor:
        """``J(x)`` ``(n, C, D)``: the Jacobians of the outputs of ``X`` (one row per
        output position) over the weights under inference, at the fitted weights: the
        ``Js`` of :meth:`functional_variance` for a posterior over the whole network.
        From each chunk's layer factors where the model allows
        (:func:`~laplace_glas.curvature.operators.factored.factored_jacobian`), else by
        reverse mode, 32 inputs at a time.
        """
        X = self._to_device(X)
        theta = self._network_weights().detach()
        J = self._factored_jacobian(X, theta, joint=False)
        if J is not None:
            return J
        names, shapes = self._param_names, self._param_shapes
        return torch.cat(
            [
                jacobian_rows(self.model, names, shapes, theta, rows)
                for rows in row_chunks(X, 32, self.dict_key_x)
            ]
        ).detach()

    def _factored_jacobian(self, X: Any, theta: torch.Tensor, joint: bool) -> torch.Tensor | None:
        """The Jacobian rows ``(n, C, D)`` (``(n C, D)`` if ``joint``) over the weights
        under inference, formed from each chunk's factors
        (:func:`~laplace_glas.curvature.operators.factored.factored_jacobian`), or None
        where that does not apply: backpropagation through the predictive, the model's
        weights not ``theta``, or a model the factors do not cover. Chunks hold at most
        about :data:`GRAM_ELEMENTS` Jacobian entries (at least 32 inputs, as many as
        reverse mode's chunks).
        """
        if self.enable_backprop or theta.requires_grad:
            return None
        named = dict(self.model.named_parameters())
        params = [named[name] for name in self._param_names]
        offset = 0
        for param in params:
            n = param.numel()
            fitted = theta[offset : offset + n]
            offset += n
            if fitted.device != param.device or not torch.equal(param.detach().reshape(-1), fitted):
                return None
        out_shape = getattr(self, "_out_shape", None)
        per_input = offset * (out_shape.numel() if out_shape else 1)
        chunk = max(32, GRAM_ELEMENTS // max(per_input, 1))
        parts = []
        with torch.no_grad():
            for rows in row_chunks(X, chunk, self.dict_key_x):
                result = factored_jacobian(self.model, params, rows, dict_key_x=self.dict_key_x)
                if isinstance(result, str):
                    return None
                out, J = result
                parts.append(J.reshape(-1, out.shape[-1], offset))
        J = torch.cat(parts)
        return J.reshape(-1, offset) if joint else J

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
