"""Data-parallel fits on ``torch.distributed``: every rank holds a shard of the data.

* :mod:`~laplace_glas.curvature.parallel.distributed`: the process group of a fit, and
  the loss, ``N`` and GGN products summed with ``all_reduce``.
* :mod:`~laplace_glas.curvature.parallel.agreement`: the ranks' agreement before a fit
  (settings, weights, the complement each rank will run) and faults that reach every rank.
* :mod:`~laplace_glas.curvature.parallel.collectives`: collectives after a fit (the
  calibration's coverage rows, the grid search's losses).

It uses only ``torch.distributed`` and the package's lower layers; the fit calls it.
"""
