"""The curvature GLAS is built from: the data pass at the MAP and the eigen-solve.

* :mod:`~laplace_glas.curvature.batches`: ``(X, y)`` and dict batches, subsamples.
* :mod:`~laplace_glas.curvature.losses`: per-token cross-entropy for sequence outputs.
* :mod:`~laplace_glas.curvature.fitting`: loss at the MAP, the count ``N`` of
  likelihood terms, and the loss whose GGN is taken.
* :mod:`~laplace_glas.curvature.problem`: one curvature problem (model, data, loss,
  ``N``), built once per fit.
* :mod:`~laplace_glas.curvature.eigensolve`: the top-k eigenpairs of an operator
  (Lanczos, block Krylov or the dual solve).
* :mod:`~laplace_glas.curvature.eigenpairs`: the record of a solve and its warnings.
* :mod:`~laplace_glas.curvature.solvers.lanczos`: ARPACK's Lanczos.
* :mod:`~laplace_glas.curvature.solvers.block_krylov`: the block Krylov solver.
* :mod:`~laplace_glas.curvature.operators.curvlinops`: curvlinops' GGN (the reference),
  empirical Fisher and Hessian operators.
* :mod:`~laplace_glas.curvature.operators.factored`: the GGN from per-layer Jacobian factors
  (one forward and one batched backward pass), products without network passes; the
  factors themselves in :mod:`~laplace_glas.curvature.operators.factors`.
* :mod:`~laplace_glas.curvature.solvers.gram`: the dual eigen-solve through ``K = S S^T``.
* :mod:`~laplace_glas.curvature.operators.linearized`: GGN products from kept forward graphs
  (no forward pass per product), for the models the factored operator does not cover.
* :mod:`~laplace_glas.curvature.operators.torch_operator`: the SciPy / torch operator base of the
  factored, linearised and all-reduced operators.
* :mod:`~laplace_glas.curvature.planner`: which operator and solver a fit uses (a
  ``Plan`` for a ``CurvatureProblem``), within the memory budget.
* :mod:`~laplace_glas.curvature.streaming`: the planner's streaming strategy (the
  factors rebuilt per product, or curvlinops' products) and slices of batches.
* :mod:`~laplace_glas.curvature.budget`: the memory budget's default, the solvers'
  storage and the strategies' estimated peaks.
* :mod:`~laplace_glas.curvature.peak_memory`: the measured peak of a fit, and the
  warning where it passes the budget.
* :mod:`~laplace_glas.curvature.backends`: laplace-torch's ``backend`` as curvlinops'
  GGN, empirical Fisher or Hessian operator.
* :mod:`~laplace_glas.curvature.distributed`: data-parallel fits on ``torch.distributed``
  (products, loss and ``N`` summed with ``all_reduce``).
"""

from laplace_glas.curvature.budget import MemoryBudgetError
from laplace_glas.curvature.eigenpairs import (
    Eigenpairs,
    LanczosConvergenceWarning,
    NumericalRankWarning,
)
from laplace_glas.curvature.eigensolve import compute_eigenpairs
from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator

__all__ = [
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "MemoryBudgetError",
    "NumericalRankWarning",
    "compute_eigenpairs",
    "mean_ggn_operator",
]
