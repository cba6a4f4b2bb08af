"""The factored GGN recomputed batch by batch at every product: streaming at GEMM speed.

The mean-loss GGN is a sum over the batches ``b`` of the loader,

.. math::

    G_1 V = \\sum_b S_b^\\top (S_b V) ,

where ``S_b`` are batch ``b``'s rows of the factored Jacobian ``S``
(:mod:`~laplace_glas.curvature.operators.factored`, ``1/sqrt(N)`` included). Where the
factors of all ``N`` examples exceed the memory budget,
:class:`StreamedFactoredGGN` rebuilds one batch's factors at a time (a forward pass with
hooks and a batched backward pass over the ``R`` rows of ``Lambda^{1/2}``), multiplies
the whole block of columns with them (two GEMMs per layer) and drops them before the
next batch. Its memory is one batch's graph and factors plus the columns; its products
are the stored factored operator's to rounding. Against curvlinops' GGN products, which
the planner streams otherwise, a product costs one pass of the network instead of a
forward, a forward-mode and a backward pass per batch, and a block of ``m`` columns
shares that pass (the 10-300-300-1 MLP at ``N = 16,000``: 208 ms for one column, 75 ms a
column in blocks of 8, against 56 ms a column on stored factors).

The planner (:mod:`~laplace_glas.curvature.memory.planner`) uses it as its ``'streaming'``
strategy for a model whose factored operator qualifies but does not fit the budget;
models the factored operator does not cover stream curvlinops' products.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from laplace_glas.curvature.data.batches import split_batch_to
from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian
from laplace_glas.curvature.memory.budget import return_freed_memory
from laplace_glas.curvature.operators.factor_join import (
    assemble_factors,
    factor_bytes,
    widest_product_columns,
)
from laplace_glas.curvature.operators.factored import CHUNK_ELEMENTS, FactoredGGN
from laplace_glas.curvature.operators.factors import (
    ForwardRecorder,
    NotFactorable,
    batch_factors,
    parameter_offsets,
)
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES, TorchOperator

__all__ = ["BatchFactorSizes", "StreamedFactoredGGN"]


@dataclass(frozen=True)
class BatchFactorSizes:
    """The largest batch's factors, from :meth:`StreamedFactoredGGN.survey`.

    Attributes
    ----------
    factor_bytes : int
        Bytes of the largest batch's factors (``F_b``).
    widest : int
        The largest ``B T d_out`` of a weight layer over the batches (numbers per
        column of a product's GEMM temporaries).
    rows : int
        ``R``, the rows of ``Lambda^{1/2}`` per example.

    """

    factor_bytes: int
    widest: int
    rows: int


class StreamedFactoredGGN(TorchOperator):
    """``G_1 V = sum_b S_b^T (S_b V)`` with each batch's factors rebuilt per product.

    Parameters
    ----------
    model : nn.Module
        The network (in eval mode); its supported layers are hooked during a product
        only.
    params : sequence of tensors
        The trainable parameters, in the order of the ``D``-vector.
    loader : iterable
        ``(X, y)`` batches or mappings with the target under ``dict_key_y``; passed
        over once per product. It must yield the same data on every pass.
    likelihood : {'regression', 'classification'}
        Unit-noise Gaussian or softmax cross-entropy.
    n_terms : int
        ``N``, the likelihood terms the GGN averages over.
    dtype : torch.dtype
        The dtype of the products (the model's).
    ignore_index : int
        Classification targets left out.
    dict_key_x, dict_key_y : str
        Keys of the input and the target of mapping batches.
    device : torch.device or str
        Where the batches go (the model's device).
    output_hessian : PosteriorAveragedHessian, optional
        The rows of ``Lambda_n^{1/2}`` (default: the softmax Hessian at the outputs).

    Notes
    -----
    The caller checks that the model qualifies for the factored operator
    (:func:`~laplace_glas.curvature.operators.factored.build_factored_ggn` on the first
    batch, with its forward-mode check) and that every batch can be factored
    (:meth:`survey`); ``n_passes`` counts the products' passes over the data and
    ``chunk_elements`` bounds a batch product's temporaries, as
    ``FactoredGGN.chunk_elements`` does.

    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[torch.Tensor],
        loader: Iterable,
        likelihood: str,
        n_terms: int,
        dtype: torch.dtype,
        *,
        ignore_index: int = -100,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        device: torch.device | str = "cpu",
        output_hessian: PosteriorAveragedHessian | None = None,
    ):
        self._offsets, _, n_params = parameter_offsets(model, list(params))
        super().__init__(dtype=NUMPY_DTYPES[dtype], shape=(n_params, n_params))
        self.model, self.loader, self.likelihood = model, loader, likelihood
        self.scale = float(n_terms) ** -0.5
        self.torch_dtype, self.device = dtype, torch.device(device)
        self.ignore_index, self.dict_key_x, self.dict_key_y = ignore_index, dict_key_x, dict_key_y
        self.output_hessian = output_hessian
        self.chunk_elements = CHUNK_ELEMENTS  # a batch product's temporaries (numbers)
        self.n_passes = 0

    def _batches(self) -> Iterator[tuple[dict, list, int]]:
        """Each batch's ``(layers, explicit, R)`` factors, the hooks on for the pass only."""
        recorder = ForwardRecorder(self._offsets)
        try:
            for data in self.loader:
                inputs, y = split_batch_to(data, self.device, self.dict_key_y)
                _, _, layers, explicit, R = batch_factors(
                    self.model,
                    recorder,
                    inputs,
                    y,
                    self.likelihood,
                    self.ignore_index,
                    self.scale,
                    self._offsets,
                    self.dict_key_x,
                    self.output_hessian,
                )
                yield layers, explicit, R
                del layers, explicit  # this batch's factors, before the next's
        finally:
            recorder.remove()

    def survey(self) -> BatchFactorSizes | str:
        """One pass without products: the largest batch's factor sizes, or why a batch
        cannot be factored (the planner's check of every batch; the factored build
        stops after the first when its projection exceeds the budget).
        """
        largest, widest, rows = 0, 1, 1
        try:
            for layers, explicit, R in self._batches():
                largest = max(largest, factor_bytes(layers, explicit))
                widest, rows = max(widest, widest_product_columns(layers)), R
        except NotFactorable as err:
            return str(err)
        finally:
            return_freed_memory()
        return BatchFactorSizes(largest, widest, rows)

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``G_1 V`` for ``V (D, m)``: one pass over the loader for all ``m`` columns."""
        # the heap's free pages (the previous product's batches, earlier phases') back to
        # the OS first, so that this product's small blocks do not land beside them
        return_freed_memory()
        X = V.to(device=self.device, dtype=self.torch_dtype).T.contiguous()
        out = torch.zeros_like(X)
        for layers, explicit, R in self._batches():
            batch = FactoredGGN(assemble_factors(layers, explicit), self.shape[0], R)
            batch.chunk_elements = self.chunk_elements
            out += batch.apply_transpose(batch.apply_S(X))
            del batch
        self.n_passes += 1
        return out.T
