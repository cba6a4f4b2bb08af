"""Application helpers used by the examples and benchmarks, not by the core.

* :mod:`~laplace_glas.applications.data`: the known-noise toy problem, UCI Concrete
  loading and splits, MLP training to a MAP.
* :mod:`~laplace_glas.applications.smiles`: a SMILES tokenizer, a character LSTM
  language model, its training and generation from posterior samples.
* :mod:`~laplace_glas.applications.cli`: ``run_example`` (a missing data set ends an
  example in one ``error:`` line) and the benchmarks' ``--help`` formatter (the
  examples parse with the standard-library copy in ``examples/_cli.py``, before torch
  and laplace-torch load).
* :mod:`~laplace_glas.applications.compare`: the side-by-side harness against
  laplace-torch's own structures (fit time, memory, coverage, NLL).

Import them by module: ``from laplace_glas.applications.smiles import SmilesLSTM``.
"""
