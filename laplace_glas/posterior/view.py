"""A read-only view of a fitted GLAS posterior: what diagnostics, calibration and
persistence read instead of the posterior object's private state.

``la.posterior`` (:attr:`laplace_glas.laplace.ActiveSubspaceLaplace.posterior`) is a frozen
snapshot taken at the time of the call: the eigen-decomposition of the mean-loss GGN,
the curvature the posterior sees along each direction, the prior and the settings of
the fit. With ``K`` eigenpairs computed by ``fit`` and ``k <= K`` of them in use
(``n_components``),

.. math::

    \\theta = \\theta^* + U_k z, \\qquad z_j \\sim \\mathcal{N}\\!\\left(0,
    \\frac{1}{a_j + \\tau}\\right), \\qquad a_j = \\frac{s \\lambda_j}{T},

with ``lambda_j`` the eigenvalues of the mean-loss GGN (noise precision included),
``s`` the loss scaling's factor and ``T`` the temperature. The view holds all ``K``
pairs so that a sweep over ``k`` (the calibration) needs no refit.

The few operations that depend on which weights the posterior covers (all of the
network's, its last layer, or a subnetwork) are the view's callables: the directions
and draws embedded into the network's weights, and the network's outputs under the
linearised posterior.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from laplace_glas.curvature import Eigenpairs
from laplace_glas.posterior.kron_complement import curvature_complement_posterior
from laplace_glas.posterior.prior import Prior
from laplace_glas.validation import ArgumentTypeError

__all__ = ["FittedPosterior", "fitted_posterior"]


@dataclass(frozen=True)
class FittedPosterior:
    """Read-only record of a fitted posterior (``la.posterior``).

    The record cannot be rebound; its tensors are the posterior's own (no copies are
    made), so change none of them in place.

    Attributes
    ----------
    eigenvectors : torch.Tensor
        ``(D, K)``: every computed eigenvector ``U`` over the posterior's weights.
    ggn_eigenvalues : torch.Tensor
        ``(K,)``: ``lambda_j`` of the mean-loss GGN (``1 / sigma^2`` included).
    curvature : torch.Tensor
        ``(K,)``: ``a_j = s lambda_j / T``, the posterior's curvature along ``u_j``.
    n_components : int
        ``k``, the number of leading pairs the posterior uses (``k <= K``).
    prior_precision : torch.Tensor
        laplace-torch's prior precision: ``(1,)``, ``(n_layers,)`` or ``(D,)``.
    prior : Prior
        The same prior as one object (:class:`~laplace_glas.posterior.prior.Prior`:
        scalar, layerwise or diagonal) with the operations the subspace algebra needs.
    prior_mean : torch.Tensor
        ``mu_0``: a scalar or ``(D,)``.
    mean : torch.Tensor
        ``theta*`` over the posterior's weights, ``(D,)``.
    network_weights : torch.Tensor
        ``theta*`` over every weight the model's predictions use (equals ``mean``
        except for a subnetwork posterior, which embeds its weights in the network's).
    scaling_factor : float
        ``s``: 1 for ``loss_scaling='mean'``, ``N`` for ``'sum'``.
    n_data : int
        ``N``, the number of likelihood terms of the fit.
    sigma_noise, temperature : torch.Tensor or float
        Observation noise and temperature of the likelihood.
    likelihood, complement : str
        The likelihood and the complement (``'zero'``, ``'prior'``, ``'diag'`` or ``'kron'``).
    param_names, param_shapes : tuple
        Names and shapes of the network's parameter tensors under inference.
    device, dtype :
        Where the posterior's tensors live.
    eigen_solve : Eigenpairs
        The eigen-solve's record (``la.lanczos_info``).
    weight_indices : torch.Tensor or None
        For a subnetwork posterior, the ``(D,)`` indices of its weights among the
        network's flattened parameters (``param_names``, ``param_shapes``); None when
        the posterior covers those parameters whole.
    ggn_diagonal : torch.Tensor or None
        ``(D,)`` diagonal of the summed unit-noise GGN (``complement='diag'``; None
        otherwise).
    ggn_kron : laplace.utils.matrix.Kron or None
        KFAC's Kronecker factors of the summed unit-noise GGN (``complement='kron'``;
        None otherwise).
    complement_curvature : torch.Tensor or KronCurvature or None
        The complement's curvature scaled as ``curvature``: ``(D,)`` ``c = s diag(G) / T``
        (``complement='diag'``) or KFAC's ``C = s K / T``
        (:class:`~laplace_glas.posterior.kron_complement.KronCurvature`,
        ``complement='kron'``); None otherwise.
    process_group : Any
        The process group of a data-parallel fit (None otherwise).
    ignore_index : int
        Classification targets left out of the loss and the scores.
    dict_key_x, dict_key_y : str
        Keys of inputs and targets in mapping batches.
    network_directions : Callable[[int], torch.Tensor]
        ``k -> (D_net, k)``: the leading ``k`` eigenvectors embedded in the network's
        weights (any ``k <= K``).
    embed_weight_draws : Callable[[torch.Tensor], torch.Tensor]
        ``(S, D) -> (S, D_net)``: draws over the posterior's weights as draws over the
        network's (zeros outside a subnetwork).
    prior_gram_diagonal : Callable
        ``(X, theta, chunk_size) -> (n, C)``: the diagonal of ``J P_0^{-1} J^T`` at
        the unit prior, over the weights under inference.
    glm_moments : Callable
        ``X -> (f_mu, f_var, lead_shape)``: the linearised predictive's mean and
        covariance at the posterior's current ``k`` and prior.
    check_inputs : Callable
        Raises a clear error for inputs the model cannot take (dtype, empty, NaN).
    check_fitted_weights : Callable[[], bool]
        Warns (``FittedWeightsChangedWarning``) when the model's weights moved after
        the fit; True when they did not.
    to_device : Callable
        Moves a tensor input to the posterior's device (mappings as they are).

    """

    eigenvectors: torch.Tensor
    ggn_eigenvalues: torch.Tensor
    curvature: torch.Tensor
    n_components: int
    prior_precision: torch.Tensor
    prior: Prior
    prior_mean: torch.Tensor
    mean: torch.Tensor
    network_weights: torch.Tensor
    scaling_factor: float
    n_data: int
    sigma_noise: torch.Tensor
    temperature: float | torch.Tensor
    likelihood: str
    complement: str
    param_names: tuple[str, ...]
    param_shapes: tuple[torch.Size, ...]
    device: torch.device
    dtype: torch.dtype
    eigen_solve: Eigenpairs
    weight_indices: torch.Tensor | None
    ggn_diagonal: torch.Tensor | None
    ggn_kron: Any
    complement_curvature: Any
    process_group: Any
    ignore_index: int
    dict_key_x: str
    dict_key_y: str
    network_directions: Callable[[int], torch.Tensor]
    embed_weight_draws: Callable[[torch.Tensor], torch.Tensor]
    prior_gram_diagonal: Callable[..., torch.Tensor]
    glm_moments: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Size]]
    check_inputs: Callable[[Any], None]
    check_fitted_weights: Callable[[], bool]
    to_device: Callable[[Any], Any]

    def posterior_in_use(self, k: int | None = None, tau: float | None = None) -> Any:
        """The posterior object of the complement in use with the leading ``k``
        eigenpairs (default: the posterior's ``n_components``): a
        :class:`~laplace_glas.posterior.complement.ProjectedComplementPosterior` for the
        curvature-aware complements, else the prior's
        (:meth:`~laplace_glas.posterior.prior.Prior.posterior`); under the scalar prior
        ``tau`` where given (curvature-aware complements only).
        """
        k = self.n_components if k is None else self.check_k(k)
        U, a = self.eigenvectors[:, :k], self.curvature[:k]
        prior = self.prior.tau if self.prior.tau is not None else self.prior.diagonal()
        if tau is not None:
            prior = torch.as_tensor(tau, dtype=U.dtype, device=U.device)
        if self.complement_curvature is not None:  # a curvature-aware complement
            return curvature_complement_posterior(
                self.complement, U, a, prior, self.complement_curvature
            )
        return self.prior.posterior(U, a, self.complement)

    @property
    def n_computed(self) -> int:
        """``K``: the number of eigenpairs ``fit`` computed."""
        return int(self.eigenvectors.shape[1])

    @property
    def scalar_prior(self) -> bool:
        """Whether the prior precision is one scalar ``tau`` (the closed forms)."""
        return self.prior.tau is not None

    @property
    def tau(self) -> float | None:
        """The scalar prior precision ``tau``; None for a layerwise or diagonal prior."""
        return None if self.prior.tau is None else float(self.prior.tau)

    def check_k(self, k: int) -> int:
        """``k`` as an int after checking it is an integer with ``1 <= k <= K``."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ArgumentTypeError(f"k must be an int, got {k!r}.")
        k = int(k)
        if not 1 <= k <= self.n_computed:
            raise ValueError(f"k must lie in [1, {self.n_computed}], got {k}.")
        return k


def fitted_posterior(la: Any, caller: str) -> FittedPosterior:
    """``la.posterior`` of a fitted GLAS posterior; a ``TypeError`` naming ``caller`` for
    any other object (a laplace-torch ``KronLaplace``, a model), ``NotFittedError`` before
    ``fit``.
    """
    if not isinstance(getattr(type(la), "posterior", None), property):
        raise TypeError(
            f"{caller} needs a fitted GLAS posterior (an ActiveSubspaceLaplace, "
            f"hessian_structure='glas'), got "
            f"{type(la).__name__}."
        )
    view = la.posterior
    if not isinstance(view, FittedPosterior):
        raise TypeError(
            f"{caller} needs a fitted GLAS posterior (an ActiveSubspaceLaplace, "
            f"hessian_structure='glas'), got "
            f"{type(la).__name__}."
        )
    return view
