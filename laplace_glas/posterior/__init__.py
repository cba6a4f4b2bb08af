"""The Gaussian posterior on the eigen-subspace: closed forms, the prior, the evidence.

* :mod:`~laplace_glas.posterior.closed_forms`: variances, log-determinants, samples and
  the posterior covariance operator of a rank-k curvature under a scalar prior.
* :mod:`~laplace_glas.posterior.prior`: the algebra of a rank-k curvature under a
  per-layer or per-weight (diagonal) prior precision.
* :mod:`~laplace_glas.posterior.subspace`: the posterior half of laplace-torch's
  contract (``posterior_covariance``, the evidence, ``sample``, prior tuning).
"""
