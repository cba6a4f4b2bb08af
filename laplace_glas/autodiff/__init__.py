"""Making any model differentiable by GLAS's forward-mode (``torch.func``) computations.

* :mod:`~laplace_glas.autodiff.context`: the context that puts a model in evaluation
  mode and swaps in differentiable kernels.
* :mod:`~laplace_glas.autodiff.functional`: ``functional_call`` that leaves a model
  calling one module twice as it was.
* :mod:`~laplace_glas.autodiff.cotangents`: backward graphs that keep only what their
  derivative in the cotangent reads (the linearised GGN's kept graphs).
* :mod:`~laplace_glas.autodiff.frozen_activations`: elementwise activations whose derivative is
  frozen at the linearisation point (the linearised GGN's kept graphs).
* :mod:`~laplace_glas.autodiff.checkpoints`: reentrant activation checkpoints that
  leave fitted parameters out of the differentiated graph, refused by name.
* :mod:`~laplace_glas.autodiff.kernels`: attention and recurrent kernels written for
  forward-mode autodiff.
* :mod:`~laplace_glas.autodiff.rnn`: recurrent layers in elementary ops.
"""
