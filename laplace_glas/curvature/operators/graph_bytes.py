"""Bytes an autograd graph keeps: the storages its nodes save, counted as the allocator
holds them.

A graph built inside :meth:`SavedBytes.hooks` reports each tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``); a saved tensor keeps its whole storage
alive, so each storage counts once and whole, except a batch's inputs and targets,
which count the rows their views span (a batch sliced from a data set's tensor keeps
no more than the data set holds anyway). The model's parameters and buffers are left
out. The kept-graph and streaming estimates of the planner
(:mod:`~laplace_glas.curvature.operators.linearized`,
:mod:`~laplace_glas.curvature.memory.streaming`) are these counts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from laplace_glas.curvature.data.batches import batch_to_device

__all__ = ["SavedBytes", "forward_graph_bytes", "spanned_bytes"]


def spanned_bytes(tensor: torch.Tensor) -> int:
    """Bytes of storage from ``tensor``'s first element to its last (0 if empty)."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum(
        (n - 1) * abs(step) for n, step in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return span * tensor.element_size()


class SavedBytes:
    """Bytes of the distinct storages autograd saves inside the context, except the
    storages in ``exclude`` (parameters and buffers, which the model holds anyway).

    A saved tensor keeps its whole storage alive, so a storage counts whole (a gate
    sliced from a recurrent layer's joint pre-activations keeps all of them), except
    the storages of the batch's inputs and targets (:meth:`add_inputs`), which count
    the rows the batch's tensors span: a batch sliced from a data set's tensor,
    ``X[i : i + b]``, keeps only what the data set holds anyway (counting the whole
    storage counted the data set in every batch's graph, and the planner then scaled it
    with the batch).

    The pack hook keeps a detached alias of each saved tensor (the same storage;
    autograd restores the graph edge when it unpacks). Keeping the tensor itself would
    tie a node to its own saved output in a reference cycle that no collector frees:
    every graph built inside the context would outlive its operator. (With saved-tensor
    hooks set, autograd does not check saved tensors for in-place changes; the graphs
    are only multiplied with while the model's weights stay as they are.)
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.inputs: set[int] = set()  # storages counted by the rows their views span
        self.seen: dict[int, int] = {}  # storage -> bytes of it counted
        self.bytes = 0
        self.dropped = 0  # saved tensors not kept (see drop)

    @classmethod
    def beside(cls, model: nn.Module) -> SavedBytes:
        """A counter that leaves out ``model``'s parameters and buffers."""
        return cls(
            {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        )

    def add_inputs(self, *batch: torch.Tensor | dict | None) -> None:
        """Count the storages of a batch's tensors (inputs, a mapping of them, targets)
        by the rows their views span.
        """
        for part in batch:
            tensors = part.values() if isinstance(part, dict) else [part]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    self.inputs.add(tensor.untyped_storage().data_ptr())

    def count(self, tensor: torch.Tensor) -> None:
        """Add ``tensor``'s storage (of a batch's input, the part it spans beyond the
        largest view counted), unless excluded or counted before.
        """
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.exclude:
            return
        spanned = storage.nbytes()
        if pointer in self.inputs:
            spanned = min(spanned, spanned_bytes(tensor))
        counted = self.seen.get(pointer, 0)
        if spanned > counted:
            self.seen[pointer] = spanned
            self.bytes += spanned - counted

    @property
    def storages(self) -> int:
        """The number of distinct storages counted."""
        return len(self.seen)

    def drop(self, tensor: torch.Tensor) -> None:
        """Record a saved tensor that the graph does not keep
        (:func:`~laplace_glas.autodiff.cotangents.zero_free_saving`): where it is freed
        amid the kept storages (most are: the backward pass's own temporaries), it leaves
        heap pages resident (:meth:`heap_bytes`; one that lives on is counted all the same,
        a small overcount). It unpacks from a one-element zero of its own, counted here.
        """
        self.dropped += 1
        self.bytes += tensor.element_size()

    def heap_bytes(self, page: int) -> int:
        """What the host heap keeps resident beside the kept storages, for pages of
        ``page`` bytes: a page per kept storage (freed temporaries share the pages at
        its ends, :data:`~laplace_glas.curvature.memory.budget.HOST_PAGE_BYTES`) and half a page
        per tensor not kept (a hole amid the kept storages; measured 2.0-3.0 KB each on
        the models of ``benchmarks/kept_graph_memory.py``).
        """
        return page * self.storages + page // 2 * self.dropped

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: count ``tensor`` and keep a detached alias of it."""
        self.count(tensor)
        return tensor.detach()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context whose graphs are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def forward_graph_bytes(
    model: nn.Module, data: Iterable, device: torch.device | str = "cpu"
) -> int | None:
    """Bytes of one forward pass of the first batch of ``data`` with its graph to the
    parameters that require grad: the tensors autograd saves (each storage once, the model's own
    parameters and buffers not counted), the outputs and the inputs. ``None`` for an
    empty loader or a model that returns no tensor.

    The streaming (curvlinops) products hold about this graph plus per column a
    tangent and a gradient of each activation (the planner's estimate).
    """
    counter = SavedBytes.beside(model)
    for X, y in data:
        X = batch_to_device(X, device)
        inputs = X.values() if isinstance(X, dict) else [X]
        counter.add_inputs(X, y)
        with counter.hooks(), torch.enable_grad():
            outputs = model(X)
        if not isinstance(outputs, torch.Tensor):
            return None
        for tensor in (outputs, y, *inputs):
            if isinstance(tensor, torch.Tensor):
                counter.count(tensor)
        return counter.bytes
    return None
