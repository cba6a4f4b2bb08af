"""The complement's curvature: what a fit computes beside its eigen-solve.

``complement='diag'`` takes the summed GGN diagonal, ``'kron'`` KFAC's Kronecker factors,
``'kron_diag'`` both block by block; ``'auto'`` the first that serves the model.

* :mod:`~laplace_glas.curvature.complement.passes`: the fit's complement passes (a mixin
  of the fit) and how ``'auto'`` resolves.
* :mod:`~laplace_glas.curvature.complement.diagonal`: the GGN diagonal (BackPACK where it
  covers the model, else the per-example pass).
* :mod:`~laplace_glas.curvature.complement.per_example_diagonal`: the exact (or Monte
  Carlo) GGN diagonal of any model torch differentiates.
* :mod:`~laplace_glas.curvature.complement.kron`: KFAC's factors (curvlinops' pass, or
  from the factored operator's stored factors).
* :mod:`~laplace_glas.curvature.complement.kfac_layers`: which parameters KFAC's blocks
  cover, and how blocks are checked and combined.

It uses :mod:`~laplace_glas.curvature.data`, :mod:`~laplace_glas.curvature.parallel` and
the operators' factors.
"""
