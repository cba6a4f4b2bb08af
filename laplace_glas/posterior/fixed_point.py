"""The posterior's own curvature: the GGN's output Hessian averaged over the posterior's
predictive, to its fixed point.

The GGN at the MAP weights a training example by the softmax Hessian at the MAP's
probabilities, ``diag(p_n) - p_n p_n^T``, which vanishes as ``p_n`` saturates: the
directions that move a confidently fitted point's logits keep the prior's variance, and
the predictive is much less confident than the network on data like the training data.
:func:`fit_posterior_curvature` replaces the weight by its average under the
posterior's own predictive at ``x_n`` (the mean held at the MAP ``theta*``) and iterates
to the fixed point

.. math::

    \\Sigma^{-1} = \\sum_{n=1}^N J_n^\\top\\,
    \\mathbb E_{f \\sim \\mathcal N(f_n, J_n \\Sigma J_n^\\top)}
    \\left[\\operatorname{diag}(p(f)) - p(f) p(f)^\\top\\right] J_n + P_0 ,

the stationarity condition in ``Sigma`` of the Gaussian variational objective of the
linearised network, ``E_q[log p(y | f_lin)] - KL(q || p)``, with ``q = N(theta*,
Sigma)``. The posterior keeps its form (the exact top-``k`` directions of the averaged
GGN plus KFAC's factors of it outside them, from the factored operator), so every
predictive, the evidence and ``sample`` work as after ``fit``.

The plain iteration alternates between two states (a wide posterior spreads the logits,
which raises the curvature, which narrows the posterior, ...), so each step is damped:
step ``t`` averages the output Hessian over the mixture of the posteriors so far with
weights ``1/2, 1/4, ...`` from the newest (the oldest takes the rest), the same as
averaging each new GGN with the last. Each posterior of the mixture is kept as a
snapshot of the fitted object (the network shared, not copied), and each step's pass
evaluates the logit covariance of every snapshot on every batch: step ``t`` costs
``t`` 'glm' covariances per batch besides the fit. The prior precision is chosen by
the evidence after every fit (``optimize_prior=True``), as laplace-torch's
``optimize_prior_precision()`` chooses it after the MAP's fit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from laplace_glas.curvature.data.output_hessian import LogitCovariance, PosteriorAveragedHessian
from laplace_glas.validation import ArgumentTypeError

__all__ = [
    "FixedPointStep",
    "fit_posterior_curvature",
    "frozen_logit_covariance",
    "mixture_weights",
]


@dataclass(frozen=True)
class FixedPointStep:
    """One fit of :func:`fit_posterior_curvature`.

    Attributes
    ----------
    step : int
        0 for the fit at the MAP's output Hessian, then ``1, 2, ...``.
    relative_change : float
        ``||lambda_t - lambda_{t-1}|| / ||lambda_{t-1}||`` of the top-``k`` mean-loss
        eigenvalues (``nan`` at step 0).
    prior_precision : torch.Tensor
        The prior precision after the step (chosen by the evidence where asked).
    log_marginal_likelihood : float
        laplace-torch's ``log_marginal_likelihood()`` after the step.

    """

    step: int
    relative_change: float
    prior_precision: torch.Tensor
    log_marginal_likelihood: float


def mixture_weights(n: int) -> list[float]:
    """The damped iteration's weights of ``n`` posteriors, oldest first: ``1/2`` for the
    newest, ``1/4`` for the one before, ..., the oldest the rest (``[1]`` for one,
    ``[1/2, 1/2]`` for two, ``[1/4, 1/4, 1/2]`` for three).
    """
    if n < 1:
        raise ValueError(f"A mixture needs at least one posterior, got {n}.")
    weights = [0.5 ** (n - i) for i in range(1, n)]
    return [1.0 - sum(weights), *weights]


def frozen_logit_covariance(la: Any) -> LogitCovariance:
    """``x -> J(x) Sigma J(x)^T`` ``(B, C, C)`` of ``la``'s posterior as it is now: a
    snapshot of the fitted object (its model and parameters shared, everything else
    copied), so that later fits and prior changes of ``la`` leave it as it was.
    """
    la.posterior  # noqa: B018  (raises NotFittedError before a fit)
    shared = {id(la.model): la.model}
    shared.update({id(p): p for p in la.model.parameters()})
    shared.update({id(b): b for b in la.model.buffers()})
    glm_moments = copy.deepcopy(la, memo=shared).posterior.glm_moments

    def covariance(x: Any) -> torch.Tensor:
        return glm_moments(x)[1]

    return covariance


def _eigenvalue_change(new: torch.Tensor, old: torch.Tensor | None) -> float:
    """``||new - old|| / ||old||`` (``nan`` without ``old``)."""
    if old is None:
        return float("nan")
    return float(torch.linalg.vector_norm(new - old) / torch.linalg.vector_norm(old))


def fit_posterior_curvature(
    la: Any,
    train_loader: Iterable,
    n_steps: int = 8,
    n_draws: int = 256,
    optimize_prior: bool = True,
    seed: int = 0,
    progress_bar: bool = False,
) -> list[FixedPointStep]:
    """Fit ``la`` at the fixed point of its own posterior-averaged curvature.

    Parameters
    ----------
    la : ActiveSubspaceLaplace
        A GLAS posterior over the whole network (``subset_of_weights='all'``) of a
        classification model, fitted or not; it is refitted ``n_steps + 1`` times.
    train_loader : iterable
        The training data, as for ``la.fit`` (any order on every pass: each example's
        output Hessian depends on the example only).
    n_steps : int
        Fits after the one at the MAP's output Hessian (8: the relative change of the
        eigenvalues is then at the Monte Carlo noise on the benchmarks' networks).
    n_draws : int
        Antithetic Monte Carlo draws per example for the average (even).
    optimize_prior : bool
        Choose the prior precision by the evidence
        (``la.optimize_prior_precision(method='marglik')``) after every fit; otherwise
        keep ``la.prior_precision``.
    seed : int
        Seed of the draws (step ``t`` uses ``seed + t``).
    progress_bar : bool
        Passed to every ``la.fit``.

    Returns
    -------
    list of FixedPointStep
        One record per fit, the MAP's first; ``la.output_hessian`` keeps the last step's
        average, so a later ``la.fit(train_loader)`` refits the same curvature.

    Raises
    ------
    ValueError
        If the likelihood is not classification, or ``n_steps`` / ``n_draws`` are not
        valid; the fit's own errors where the model does not take the factored operator.

    """
    if getattr(la, "likelihood", None) != "classification":
        raise ValueError(
            "fit_posterior_curvature averages the softmax cross-entropy's output Hessian; "
            f"got likelihood {getattr(la, 'likelihood', None)!r}."
        )
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ArgumentTypeError(f"n_steps must be an int >= 1, got {n_steps!r}.")
    la.output_hessian = None
    la.fit(train_loader, progress_bar=progress_bar)
    if optimize_prior:
        la.optimize_prior_precision(method="marglik")
    previous = la.eigenvalues.clone()
    history = [
        FixedPointStep(
            0, float("nan"), la.prior_precision.clone(), float(la.log_marginal_likelihood())
        )
    ]
    snapshots: list[LogitCovariance] = []
    for step in range(1, n_steps + 1):
        snapshots.append(frozen_logit_covariance(la))
        la.output_hessian = PosteriorAveragedHessian(
            snapshots, mixture_weights(len(snapshots)), n_draws=n_draws, seed=seed + step
        )
        la.fit(train_loader, progress_bar=progress_bar)
        if optimize_prior:
            la.optimize_prior_precision(method="marglik")
        change = _eigenvalue_change(la.eigenvalues, previous)
        previous = la.eigenvalues.clone()
        history.append(
            FixedPointStep(
                step, change, la.prior_precision.clone(), float(la.log_marginal_likelihood())
            )
        )
    return history
