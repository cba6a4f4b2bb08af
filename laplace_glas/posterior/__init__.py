"""The Gaussian posterior on the eigen-subspace: closed forms, the prior, the evidence.

* :mod:`~laplace_glas.posterior.prior`: the prior precision as one object
  (:class:`~laplace_glas.posterior.prior.Prior`: scalar, layerwise or diagonal), which
  hands the subspace posterior its algebra.
* :mod:`~laplace_glas.posterior.closed_forms`: variances, log-determinants, samples and
  the posterior covariance operator of a rank-k curvature under a scalar prior.
* :mod:`~laplace_glas.posterior.diagonal_prior`: the algebra of a rank-k curvature under
  a per-layer or per-weight (diagonal) prior precision.
* :mod:`~laplace_glas.posterior.subspace`: the posterior half of laplace-torch's
  contract (``posterior_covariance``, the evidence, ``sample``, prior tuning).
* :mod:`~laplace_glas.posterior.fixed_point`: the posterior's own curvature, the GGN's
  output Hessian averaged over the posterior's predictive, refitted to its fixed point.
"""

from laplace_glas.posterior.prior import DiagonalPrior, LayerwisePrior, Prior, ScalarPrior

__all__ = ["DiagonalPrior", "LayerwisePrior", "Prior", "ScalarPrior"]
