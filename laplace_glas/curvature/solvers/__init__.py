"""Eigen-solvers for the top-k eigenpairs of a symmetric PSD operator.

* :mod:`~laplace_glas.curvature.solvers.solve`: the top-k eigenpairs of a curvature
  problem's operator, by the solver its plan names (:func:`compute_eigenpairs`).
* :mod:`~laplace_glas.curvature.solvers.eigenpairs`: the record of a solve and the
  warnings it can raise.
* :mod:`~laplace_glas.curvature.solvers.block_krylov`: block Krylov with Rayleigh-Ritz,
  many GGN columns per data pass; its basis and the products on it in
  :mod:`~laplace_glas.curvature.solvers.krylov_basis`.
* :mod:`~laplace_glas.curvature.solvers.gram`: the dual eigen-solve of the factored GGN
  through the ``NR x NR`` Gram matrix ``K = S S^T``.
* :mod:`~laplace_glas.curvature.solvers.lanczos`: ARPACK's implicitly restarted Lanczos
  (``scipy.sparse.linalg.eigsh``), the reference.
* :mod:`~laplace_glas.curvature.solvers.threads`: one BLAS/LAPACK thread for the
  solvers' many small calls.

:func:`laplace_glas.curvature.solvers.solve.compute_eigenpairs` drives the three solvers.
"""
