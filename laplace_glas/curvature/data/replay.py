"""The training loader's batches, kept by the pass at the MAP for the fit's later passes.

A fit passes over the training data more than once: the pass at the MAP (validation,
the loss, ``N``), then the curvature's (the factors, Jacobians or kept graphs of a
one-pass operator; every product of a streaming one; the complement's GGN diagonal).
laplace-torch's fits make one pass. Where the batches are small, the pass at the MAP
keeps them as they came and the later passes replay them, so that

* the user's loader is iterated once per fit (with ``num_workers > 0``, one set of
  worker processes; a map-style dataset's per-item indexing and collation, once);
* every pass of the fit sees the same batches: a loader that shuffles or augments at
  random gives the eigen-solver one fixed operator, and the loss at the MAP belongs
  to the data of the curvature.

The batches are kept while they take at most :data:`KEPT_BYTES` (their storages, and
:data:`OBJECT_BYTES` per tensor and container), an eighth of the host memory a fit's
measured peak may exceed its budget by
(:data:`~laplace_glas.curvature.memory.budget.HOST_SLACK`): the strategies' estimates leave
them out. (A loader that yields CUDA tensors keeps them on the device.) Each replay
hands out shallow copies of the items' lists and mappings, so that a model may take
keys out of its input mapping; their tensors are shared, so a model must not change
its inputs in place. Not kept: the batches of a data-parallel fit (each rank's shard
is its own), of a fit that solves on a subsample (the solve draws its own batches), a
loader that already is a list or tuple, items holding anything but tensors, numbers,
strings, tuples, lists and mappings, and items that hold a tensor or a list or mapping
an earlier item held, or tensors reading memory an earlier item's read (a loader that
reuses its objects or refills its tensors in place would leave copies of its last
batch).
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "KEPT_BYTES",
    "OBJECT_BYTES",
    "BatchKeeper",
    "ItemContents",
    "ReplayedBatches",
    "item_contents",
]

KEPT_BYTES = 4 * 2**20
"""Most bytes of training batches the pass at the MAP keeps: an eighth of
:data:`~laplace_glas.curvature.memory.budget.HOST_SLACK`."""


def _tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)``: the byte addresses a tensor reads, ``stop`` exclusive."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


OBJECT_BYTES = 1024
"""Bytes charged per tensor and per container of a kept item besides its storages (the
Python objects and tensor headers: 20,000 items of two one-number tensors took 32 MiB)."""


class ItemContents(NamedTuple):
    """What a loader's item holds, as :class:`BatchKeeper` counts it."""

    storages: dict[int, int]
    """The storages behind its tensors, ``{address: bytes}``."""
    spans: list[tuple[int, int]]
    """The address spans its tensors read, merged where they overlap, sorted."""
    objects: set[int]
    """``id`` of its tensors and mutable containers (lists, mappings)."""
    other_bytes: int
    """Its strings' bytes and :data:`OBJECT_BYTES` per tensor and container."""


def item_contents(data: Any) -> ItemContents | None:
    """The contents of a loader's item (tuples, lists and mappings of tensors, numbers,
    strings and ``None``); ``None`` where the item holds anything else (NumPy arrays
    included: a default collate makes tensors of them).
    """
    storages: dict[int, int] = {}
    spans: list[tuple[int, int]] = []
    objects: set[int] = set()
    other = 0
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            if value.numel():
                spans.append(_tensor_span(value))
            objects.add(id(value))
            other += OBJECT_BYTES
        elif isinstance(value, Mapping | tuple | list):
            stack.extend(value.values() if isinstance(value, Mapping) else value)
            if not isinstance(value, tuple):
                objects.add(id(value))
            other += OBJECT_BYTES
        elif isinstance(value, str | bytes):
            other += len(value)
        elif not (value is None or isinstance(value, int | float | bool | complex | np.generic)):
            return None
    return ItemContents(storages, _merged(spans), objects, other)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, the overlapping ones merged."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _overlaps(spans: list[tuple[int, int]], kept: list[tuple[int, int]]) -> bool:
    """Whether a span of ``spans`` overlaps one of ``kept`` (disjoint, sorted): only the
    last kept span starting before a span's end can reach into it.
    """
    for start, stop in spans:
        i = bisect.bisect_left(kept, (stop, stop))
        if i and kept[i - 1][1] > start:
            return True
    return False


class BatchKeeper:
    """Keeps a pass's items while they take at most ``limit`` bytes (0: keeps none).

    Once an item would take the total past ``limit``, holds an object of unknown size,
    or holds a tensor or mutable container an earlier item held, or tensors reading
    memory an earlier item's read (a loader reusing its objects or refilling its
    tensors in place; views of distinct rows of one tensor are kept), every item is let
    go: the later passes iterate the loader itself.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._batches: list | None = [] if self.limit > 0 else None
        self._storages: dict[int, int] = {}
        self._spans: list[tuple[int, int]] = []  # disjoint, sorted
        self._objects: set[int] = set()  # ids of kept objects: unique while they live
        self.nbytes = 0
        """Bytes of the kept items (each storage once)."""

    def add(self, data: Any) -> None:
        """Keep ``data`` (the loader's next item), or stop keeping."""
        if self._batches is None:
            return
        found = item_contents(data)
        if found is not None:
            new = {a: b for a, b in found.storages.items() if a not in self._storages}
            size = self.nbytes + sum(new.values()) + found.other_bytes
            reused = not found.objects.isdisjoint(self._objects)
        if found is None or size > self.limit or reused or _overlaps(found.spans, self._spans):
            self._batches, self._storages, self._spans, self._objects = None, {}, [], set()
            return
        self._batches.append(data)
        self._storages.update(new)
        self._objects |= found.objects
        for span in found.spans:
            bisect.insort(self._spans, span)
        self.nbytes = size

    def kept(self) -> ReplayedBatches | None:
        """The items of the whole pass, or ``None`` where they were not all kept."""
        if not self._batches:
            return None
        return ReplayedBatches(tuple(self._batches), self.nbytes)


class ReplayedBatches:
    """Every item of a loader, in order, as one pass yielded them (``items``), and their
    bytes (``nbytes``), replayed: each pass gets shallow copies of their lists and
    mappings (a model may take keys out of its input mapping), the tensors themselves.
    """

    def __init__(self, items: tuple, nbytes: int):
        self.items, self.nbytes = items, nbytes

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            yield _shallow_copy(item)


def _shallow_copy(value: Any) -> Any:
    """``value`` with its tuples, lists and mappings copied, their tensors shared."""
    if isinstance(value, tuple):
        return type(value)(_shallow_copy(v) for v in value) if type(value) is tuple else value
    if isinstance(value, list):
        return [_shallow_copy(v) for v in value]
    if isinstance(value, MutableMapping):
        out = copy.copy(value)
        for key in value:
            out[key] = _shallow_copy(value[key])
        return out
    return value
