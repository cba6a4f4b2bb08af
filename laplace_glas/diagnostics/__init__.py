"""What a fitted GLAS posterior can tell about itself and about data.

* :mod:`~laplace_glas.diagnostics.calibration`: coverage sweeps over ``k`` and the prior
  precision on held-out data, and the choice of both.
* :mod:`~laplace_glas.diagnostics.activity`: which weights carry the curvature.
* :mod:`~laplace_glas.diagnostics.alignment`: the Jacobian's alignment with the subspace,
  and out-of-distribution scores built on it.
* :mod:`~laplace_glas.diagnostics.convergence`: residuals of the eigenpairs and a replica
  check of the eigen-solve.
"""
