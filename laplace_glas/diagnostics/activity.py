"""Activity scores: which weights carry the curvature of the active subspace.

The activity score of weight ``i`` over the leading ``k`` eigenpairs is

.. math::

    \\alpha_i(k) = \\sum_{j \\le k} w_j \\, u_{ij}^2 ,

with the weights ``w_j`` chosen by ``weighting``:

* ``'eigenvalue'`` (default, the active-subspace convention): ``w_j = lambda_j``,
  the mean-loss GGN eigenvalue; then ``alpha_i(D) = G_ii``;
* ``'posterior'``: ``w_j = a_j v_j = a_j / (a_j + tau)`` with ``a_j = s lambda_j / T``,
  the share of direction ``j``'s prior variance the data removed (in [0, 1));
* ``'variance'``: the marginal posterior variance ``Sigma_ii`` of weight ``i`` under
  the posterior in use (its complement included): ``sum_j v_j u_ij^2`` for
  ``complement='zero'``, plus ``(1 - sum_j u_ij^2) / tau`` for ``'prior'``, plus
  ``diag(P E^{-1} P)_i`` for ``'diag'`` / ``'kron'`` / ``'kron_diag'``
  (:meth:`~laplace_glas.posterior.complement.ProjectedComplementPosterior.marginal_variances`).

For the first two, since ``U`` is orthonormal, ``sum_i alpha_i = sum_j w_j``; with
``'variance'``, ``sum_i alpha_i = tr(Sigma)``.
"""

from __future__ import annotations

from typing import Any

import torch

from laplace_glas.posterior.closed_forms import posterior_variances
from laplace_glas.posterior.view import fitted_posterior
from laplace_glas.validation import scalar_prior_precision

__all__ = ["activity_scores", "cumulative_activity", "per_parameter", "weights_for_share"]

_WEIGHTINGS = ("eigenvalue", "posterior", "variance")


def activity_scores(la: Any, k: int | None = None, weighting: str = "eigenvalue") -> torch.Tensor:
    """``(D,)`` activity scores of a fitted GLAS posterior (see module docstring).

    Parameters
    ----------
    la : ActiveSubspaceLaplace
        Fitted posterior.
    k : int, optional
        Number of leading eigenpairs (default: the posterior's ``n_components``);
        may go up to the number computed by ``fit``.
    weighting : {'eigenvalue', 'posterior', 'variance'}
        Eigen-direction weights ``w_j``.

    """
    posterior = fitted_posterior(la, "activity_scores")
    k = posterior.check_k(posterior.n_components if k is None else k)
    if weighting not in _WEIGHTINGS:
        raise ValueError(f"weighting must be one of {_WEIGHTINGS}, got {weighting!r}.")
    U = posterior.eigenvectors[:, :k]
    if weighting == "variance" and posterior.complement not in ("zero", "prior"):
        return posterior.posterior_in_use(k).marginal_variances().detach()
    if weighting == "eigenvalue":
        weights = posterior.ggn_eigenvalues[:k]
    else:
        a = posterior.curvature[:k]
        scalar_prior_precision(posterior.prior_precision)
        variances = posterior_variances(a, posterior.prior_precision.reshape(()))
        weights = a * variances if weighting == "posterior" else variances
    scores = U.square() @ weights
    if weighting == "variance" and posterior.complement == "prior":
        scores = scores + (1 - U.square().sum(-1)).clamp_min(0) / posterior.prior_precision
    return scores.detach()


def _tensor(name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")


def per_parameter(la: Any, scores: torch.Tensor) -> dict[str, float]:
    """Total score per named parameter tensor (layer weights, biases), in model order.

    A subnetwork posterior's scores (one per subnetwork weight) are placed at the
    subnetwork's indices among the network's weights first, so every total lands on
    the tensor its weights belong to (tensors outside the subnetwork total 0).
    """
    posterior = fitted_posterior(la, "per_parameter")
    _tensor("scores", scores)
    if scores.shape != (la.n_params,):
        raise ValueError(f"scores must have shape ({la.n_params},), got {tuple(scores.shape)}.")
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain NaN or inf.")
    if posterior.weight_indices is not None:
        n_network = sum(shape.numel() for shape in posterior.param_shapes)
        placed = scores.new_zeros(n_network)
        placed[posterior.weight_indices.to(scores.device)] = scores
        scores = placed
    totals, offset = {}, 0
    for name, shape in zip(posterior.param_names, posterior.param_shapes):
        n = shape.numel()
        totals[name] = float(scores[offset : offset + n].sum())
        offset += n
    return totals


def cumulative_activity(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative share of the total score carried by the top-n weights.

    Returns ``(n_weights, share)``: ``n_weights = 1..D`` and ``share[n-1]`` the
    fraction of ``sum(scores)`` carried by the ``n`` largest scores (plot on log-log
    axes to see how localised the subspace is).
    """
    _tensor("scores", scores)
    if scores.ndim != 1 or scores.numel() == 0:
        raise ValueError("scores must be a non-empty 1-D tensor.")
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain NaN or inf.")
    if (scores < 0).any():
        raise ValueError("Activity scores are non-negative; got negative entries.")
    ordered = scores.sort(descending=True).values.double()
    cumulative = torch.cumsum(ordered, 0)
    total = cumulative[-1]  # the same float64 sum, so the last share is exactly 1
    if total <= 0:
        raise ValueError("All activity scores are zero.")
    share = cumulative / total
    n_weights = torch.arange(1, scores.numel() + 1)
    return n_weights, share


def weights_for_share(scores: torch.Tensor, share: float = 0.95) -> tuple[int, float]:
    """Smallest number (and fraction) of weights whose scores carry ``share`` of the total."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"share must be a number in (0, 1], got {share!r}.")
    _, cumulative = cumulative_activity(scores)
    count = (
        int(torch.searchsorted(cumulative, torch.tensor(share - 1e-12, dtype=torch.float64))) + 1
    )
    count = min(count, scores.numel())
    return count, count / scores.numel()
