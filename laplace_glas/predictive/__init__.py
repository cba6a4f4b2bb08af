"""From the weight posterior to predictions.

* :mod:`~laplace_glas.predictive.jvp`: network outputs and Jacobian-vector products
  ``J(x) U`` along weight-space directions (``torch.func``).
* :mod:`~laplace_glas.predictive.links`: Gaussian samples and the Laplace bridge.
* :mod:`~laplace_glas.predictive.prior_gram`: the prior's term ``J P_0^{-1} J^T`` of the
  'glm' covariance with ``complement='prior'``.
* :mod:`~laplace_glas.predictive.subspace_predictive`: laplace-torch's predictive methods
  ('glm' and 'nn', probit / MC / bridge links) for a posterior on a subspace.
"""
