"""Matrix-free GGN operators, one per module, each with its product in the docstring.

* :mod:`~laplace_glas.curvature.operators.torch_operator`: the SciPy / torch base class.
* :mod:`~laplace_glas.curvature.operators.curvlinops`: curvlinops' GGN (the reference),
  empirical Fisher and Hessian operators of the mean loss.
* :mod:`~laplace_glas.curvature.operators.factored`: the GGN from per-layer Jacobian
  factors (one forward and one batched backward pass), products without network passes.
* :mod:`~laplace_glas.curvature.operators.factors`: the per-layer factors and the hooks
  that record them.
* :mod:`~laplace_glas.curvature.operators.stored_jacobian`: the GGN from stored per-example
  Jacobians (``N R D`` numbers; adapters, heads, subnetworks, small models), products as
  two GEMMs.
* :mod:`~laplace_glas.curvature.operators.jacobian_estimates`: the planner's estimates of
  the stored Jacobians' memory, before any pass.
* :mod:`~laplace_glas.curvature.operators.linearized`: products from kept forward graphs
  (no forward pass per product), for the models the factored operator does not cover.
* :mod:`~laplace_glas.curvature.operators.graph_bytes`: the bytes a kept autograd graph
  holds (the linearised operators' and streaming's memory estimates).
* :mod:`~laplace_glas.curvature.operators.relinearized`: the linearised GGN rebuilt
  batch by batch per product (one batch's graphs held), where the kept graphs do not fit
  the memory budget.
* :mod:`~laplace_glas.curvature.operators.streamed`: the factored GGN rebuilt batch by
  batch per product (one batch's factors held), where the stored factors do not fit the
  memory budget.
* :mod:`~laplace_glas.curvature.operators.updated`: a stored low-rank curvature plus a
  new data set's operator (``fit(override=False)``).

curvlinops' ``GGNLinearOperator`` (the reference) is built by
:func:`laplace_glas.curvature.operators.curvlinops.mean_ggn_operator`.
"""
