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

The batches are kept while their storages take at most :data:`KEPT_BYTES`, an eighth of
the host memory a fit's measured peak may exceed its budget by
(:data:`~laplace_glas.curvature.budget.HOST_SLACK`): the strategies' estimates leave
them out. Not kept: the batches of a data-parallel fit (each rank's shard is its own),
of a fit that solves on a subsample (the solve draws its own batches), a loader that
already is a list or tuple, items holding objects whose size is not known, and batches
that read memory an earlier one reads (a loader that refills its tensors in place
would leave copies of its last batch).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from laplace_glas.curvature.budget import HOST_SLACK

__all__ = ["KEPT_BYTES", "BatchKeeper", "KeptBatches", "item_storages"]

KEPT_BYTES = HOST_SLACK // 8
"""Most bytes of training batches the pass at the MAP keeps (4 MiB)."""


@dataclass(frozen=True)
class KeptBatches:
    """Every item of a loader, in order, as one pass yielded them, and their bytes."""

    batches: tuple
    nbytes: int


def _tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)``: the byte addresses a tensor reads, ``stop`` exclusive."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def item_storages(data: Any) -> tuple[dict[int, int], list[tuple[int, int]], int] | None:
    """What a loader's item holds (tuples, lists and mappings of tensors, numbers,
    strings and ``None``): its storages, ``{address: bytes}``, the address spans its
    tensors read (merged where they overlap, sorted), and the bytes of its strings;
    ``None`` where the item holds anything else (NumPy arrays included: a default
    collate makes tensors of them).
    """
    storages: dict[int, int] = {}
    spans: list[tuple[int, int]] = []
    strings = 0
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if value.numel():
                storages[storage.data_ptr()] = storage.nbytes()
                spans.append(_tensor_span(value))
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, tuple | list):
            stack.extend(value)
        elif isinstance(value, str | bytes):
            strings += len(value)
        elif not (value is None or isinstance(value, int | float | bool | complex | np.generic)):
            return None
    return storages, _merged(spans), strings


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
    """Keeps a pass's items while their storages take at most ``limit`` bytes (0: keeps
    none). Once an item would take the total past ``limit``, holds an object of unknown
    size or reads memory an earlier item reads (a loader refilling its tensors in
    place; views of distinct rows of one tensor are kept), every item is let go: the
    later passes iterate the loader itself.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._batches: list | None = [] if self.limit > 0 else None
        self._storages: dict[int, int] = {}
        self._spans: list[tuple[int, int]] = []  # disjoint, sorted
        self._string_bytes = 0

    def add(self, data: Any) -> None:
        """Keep ``data`` (the loader's next item), or stop keeping."""
        if self._batches is None:
            return
        found = item_storages(data)
        if found is not None:
            storages, spans, strings = found
            new = {a: b for a, b in storages.items() if a not in self._storages}
            size = self.nbytes + sum(new.values()) + strings
        if found is None or size > self.limit or _overlaps(spans, self._spans):
            self._batches, self._storages, self._spans = None, {}, []
            return
        self._batches.append(data)
        self._storages.update(new)
        for span in spans:
            bisect.insort(self._spans, span)
        self._string_bytes += strings

    @property
    def nbytes(self) -> int:
        """Bytes of the kept items' storages (each storage once) and strings."""
        return sum(self._storages.values()) + self._string_bytes

    def kept(self) -> KeptBatches | None:
        """The items of the whole pass, or ``None`` where they were not all kept."""
        if not self._batches:
            return None
        return KeptBatches(tuple(self._batches), self.nbytes)
