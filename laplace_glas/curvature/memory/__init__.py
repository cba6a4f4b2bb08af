"""Planning a fit within its memory budget: which operator and solver, and what it holds.

* :mod:`~laplace_glas.curvature.memory.budget`: the budget's default, the solvers'
  storage, the strategies' estimated peaks, and the free memory of a device.
* :mod:`~laplace_glas.curvature.memory.planner`: the fastest exact strategy whose
  estimated peak fits (a ``Plan`` for a ``CurvatureProblem``).
* :mod:`~laplace_glas.curvature.memory.streaming`: the planner's streaming strategy (the
  factors or linearisations rebuilt per product), and slices of batches.
* :mod:`~laplace_glas.curvature.memory.peak`: the measured peak of a fit and the warning
  where it passes the budget.

It uses :mod:`~laplace_glas.curvature.data` and :mod:`~laplace_glas.curvature.operators`
(whose operators it builds) and the package's lower layers.
"""
