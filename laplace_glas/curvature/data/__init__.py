"""The fit's data: its batches, the loss at the MAP and the problem the solve is of.

The first step of a fit: a pass over the training loader at the MAP weights gives the
loss, the count ``N`` of likelihood terms, the output shape and (within a byte budget)
the batches kept for the later passes;
:class:`~laplace_glas.curvature.data.problem.CurvatureProblem`
then holds everything that describes the matrix the solve eigen-decomposes.

* :mod:`~laplace_glas.curvature.data.batches`: ``(X, y)`` and mapping batches, their
  checks, subsamples and slices.
* :mod:`~laplace_glas.curvature.data.example_counts`: how many examples a loader's batches
  hold, before a pass.
* :mod:`~laplace_glas.curvature.data.replay`: the batches the pass at the MAP keeps and
  replays to the fit's later passes.
* :mod:`~laplace_glas.curvature.data.losses`: loss modules whose GGN GLAS takes
  (per-token cross-entropy).
* :mod:`~laplace_glas.curvature.data.map_loss`: the pass at the MAP (loss, ``N``, output
  shape) and the loss whose GGN is taken.
* :mod:`~laplace_glas.curvature.data.problem`: one curvature problem, built once per fit.
* :mod:`~laplace_glas.curvature.data.output_hessian`: the loss Hessian in the outputs
  averaged over a posterior's predictive, which the problem may weight its examples by.

It uses :mod:`laplace_glas.validation`, :mod:`laplace_glas.progress` and
:mod:`laplace_glas.autodiff`; nothing else of the package.
"""
