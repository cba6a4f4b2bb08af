"""The linearised GGN with each batch's graphs rebuilt at every product: streaming for
models the factored operator does not cover.

The linearised operator (:mod:`~laplace_glas.curvature.operators.linearized`) keeps,
for every batch ``b``, the forward graph of ``f_b`` and the graph of
``J_b^T u`` (built with ``create_graph=True``), and multiplies

.. math::

    G V = c \\sum_b J_b^\\top \\Lambda_b J_b V

by two backward passes per batch over them. Where those graphs of all batches exceed
the memory budget, :class:`RelinearizedGGN` rebuilds one batch's graphs at a time (one
forward pass with the elementwise activations' and the norms' first derivatives frozen,
and the ``create_graph`` backward pass), multiplies the whole block of columns with them and
drops them before the next batch. Its memory is one batch's graphs plus the columns;
its products are the kept operator's (the same graphs, rebuilt). Against curvlinops'
GGN products, which the planner streamed otherwise, the batch's pass is shared by the
block of columns and the frozen modules' derivatives are not differentiated again.

The planner (:mod:`~laplace_glas.curvature.memory.streaming`) uses it as its ``'streaming'``
strategy for a model that the linearised operator covers but whose kept graphs do not
fit the budget (and whose factored operator does not stream instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from laplace_glas.curvature.memory.budget import format_bytes, return_freed_memory
from laplace_glas.curvature.operators.curvlinops import LossOnData
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.linearized import (
    COLUMN_BYTES,
    Linearization,
    LinearizedGGN,
    adjoint_check,
    linearize_batch,
)

__all__ = ["LARGER_BATCH", "RelinearizedGGN"]

LARGER_BATCH = 1.25
"""The first rebuilt batch whose graphs exceed this multiple of the first batch's (the
bytes the memory budget was planned with) is warned about, once per operator."""


class RelinearizedGGN(LinearizedGGN):
    """``G = c sum_b J_b^T Lambda_b J_b`` with batch ``b``'s graphs rebuilt per product.

    Parameters
    ----------
    loss : LossOnData
        As for :func:`~laplace_glas.curvature.operators.linearized.build_linearized_ggn`;
        its batches are passed over once per product (their order does not matter).
    device : torch.device or str
        Where the batches go (the model's device).
    batch_bytes : int
        One batch's graphs (the first batch's, as the kept build counted them): a
        batched product's columns go through the backward passes in chunks of
        ``column_bytes`` over it.
    column_bytes : int
        Temporaries a batched product may take (at most 512 MiB).

    Attributes
    ----------
    largest_batch_bytes : int
        The largest batch's graphs linearised so far (bytes, counted as the kept build
        counts them); the first batch above ``LARGER_BATCH`` times ``batch_bytes`` is
        warned about.

    Notes
    -----
    ``matmat_torch(V)`` returns ``G V`` for ``V (D, m)``: per batch, the linearisation
    (:func:`~laplace_glas.curvature.operators.linearized.linearize_batch`), then the
    kept operator's two backward passes for the columns (batched where vmap can), and
    the batch's graphs are freed before the next batch is linearised.

    """

    def __init__(
        self,
        loss: LossOnData,
        *,
        device: torch.device | str = "cpu",
        batch_bytes: int,
        column_bytes: int = COLUMN_BYTES,
    ):
        super().__init__([], list(loss.params), batch_bytes, column_bytes)
        self.loss = loss
        self.largest_batch_bytes = 0  # the largest batch's graphs linearised so far

    def batches(self) -> Iterator[Linearization]:
        """Each batch's linearisation, built when the product reaches it.

        Raises
        ------
        RuntimeError
            If a batch cannot be linearised (the first one could: the planner built it).

        """
        for i, (X, y) in enumerate(self.loss.data):
            # yielded without a name here, so that the caller's release frees it
            yield self._linearized(X, y, i)

    def _linearized(self, X: torch.Tensor | dict, y: torch.Tensor, index: int) -> Linearization:
        loss = self.loss
        counter = SavedBytes.beside(loss.model)
        lin = linearize_batch(
            loss.model, loss.loss_func, self.params, X, y, num_data=loss.num_data,
            batch_size_fn=loss.batch_size_fn, device=self.device, counter=counter,
        )  # fmt: skip
        if isinstance(lin, str):
            raise RuntimeError(
                f"Batch {index + 1} (counting from 1) of the training data cannot be "
                f"linearised: {lin}."
            )
        first_larger = counter.bytes > LARGER_BATCH * self.saved_bytes >= self.largest_batch_bytes
        self.largest_batch_bytes = max(self.largest_batch_bytes, counter.bytes)
        if first_larger:
            warnings.warn(
                f"Batch {index + 1}'s graphs (counting from 1) take {format_bytes(counter.bytes)}, "
                "more than the "
                f"{format_bytes(self.saved_bytes)} of the first batch that the memory budget "
                "was planned with: the fit may exceed memory_budget (longer sequences or "
                "larger batches later in the loader?).",
                UserWarning,
                stacklevel=2,
            )
        return lin

    def check(self) -> str | None:
        """Why this model's rebuilt products cannot be trusted, or None: the kept
        operator's check of the double-backward ``J v`` against ``J^T u`` on the first
        batch (the kept build's ``adjoint_check``).
        """
        for lin in self.batches():
            return adjoint_check(self, lin)
        return "the loader is empty"

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``G V`` for ``V (D, m)``, one batch's graphs at a time."""
        result = super().matmat_torch(V)
        return_freed_memory()  # the last batch's graphs
        return result
