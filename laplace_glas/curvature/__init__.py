"""The curvature GLAS is built from, grouped by the steps of a fit's way through the data.

* :mod:`~laplace_glas.curvature.fit`: the fit itself (``SubspaceFit``, a mixin of the
  posterior classes): checks, the pass at the MAP, the plan, the complement's passes,
  the solve.
* :mod:`~laplace_glas.curvature.backends`: laplace-torch's ``backend`` as curvlinops'
  GGN, empirical Fisher or Hessian operator.
* :mod:`~laplace_glas.curvature.data`: the batches, the pass at the MAP (loss, ``N``)
  and the curvature problem it describes.
* :mod:`~laplace_glas.curvature.memory`: the memory budget, the planner that picks the
  operator and solver within it, streaming, and the measured peak.
* :mod:`~laplace_glas.curvature.operators`: the matrix-free GGN operators (factored,
  stored Jacobians, linearised, streamed, curvlinops' reference).
* :mod:`~laplace_glas.curvature.solvers`: the eigen-solve (Lanczos, block Krylov, the
  dual Gram solve) and its record.
* :mod:`~laplace_glas.curvature.complement`: the complement's curvature (the GGN
  diagonal, KFAC's factors) computed beside the solve.
* :mod:`~laplace_glas.curvature.parallel`: data-parallel fits (sums over ranks, the
  ranks' agreement, collectives after the fit).

The layers point down: ``fit`` uses all of them; ``complement`` and ``memory`` use
``data``, ``operators`` and ``parallel``; ``solvers`` use ``operators`` and ``parallel``;
nothing here imports the posterior, the predictive or the diagnostics.
"""

from laplace_glas.curvature.memory.budget import MemoryBudgetError
from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator
from laplace_glas.curvature.solvers.eigenpairs import (
    Eigenpairs,
    LanczosConvergenceWarning,
    NumericalRankWarning,
)
from laplace_glas.curvature.solvers.solve import compute_eigenpairs

__all__ = [
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "MemoryBudgetError",
    "NumericalRankWarning",
    "compute_eigenpairs",
    "mean_ggn_operator",
]
