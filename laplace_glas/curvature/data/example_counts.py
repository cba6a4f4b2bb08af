"""How many examples a loader's batches hold, known before a pass over its data.

The planner (:mod:`~laplace_glas.curvature.memory.planner`) measures one batch, the first, and
projects what it measured to the loader: the factors, the kept graphs and the Gram
matrix grow with the examples of all batches, a product's temporaries and a streamed
batch's graph with the examples of the largest. Where the first batch is not the
largest (a list of batches whose first is short, a custom batch sampler), a projection
by the number of batches is wrong by the ratio of the sizes. :func:`survey_batch_sizes`
reads the sizes where that costs no pass over the data:

* a ``DataLoader`` with a ``batch_size`` over a sampler with a length: batches of
  ``batch_size`` (the last shorter, or dropped with ``drop_last``); with a
  ``batch_sampler``: the lengths of the index batches it draws (indices only; torch's
  global random state is restored after);
* a list or tuple of batches: each batch's first input axis, read in memory;
* :class:`~laplace_glas.curvature.data.batches.SubBatches` and
  :class:`~laplace_glas.curvature.data.batches.XYBatches`: from the loader they view.

Elsewhere (an iterable dataset, a generator, another iterable) it returns ``None`` and
the planner projects by the number of batches, as from a first batch of the largest
size (the measured peak, :mod:`~laplace_glas.curvature.memory.peak`, warns where that
was low).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset

from laplace_glas.curvature.data.batches import SubBatches, XYBatches, batch_size, split_batch
from laplace_glas.curvature.data.replay import ReplayedBatches

__all__ = ["BatchSizes", "survey_batch_sizes"]


@dataclass(frozen=True)
class BatchSizes:
    """Examples in a loader's first batch and in each of its batches.

    Attributes
    ----------
    first : int
        Examples of the first batch (the one the planner measures).
    counts : tuple of (int, int)
        ``(examples, batches)`` pairs: how many batches hold how many examples.

    """

    first: int
    counts: tuple[tuple[int, int], ...]

    @property
    def largest(self) -> int:
        """Examples of the largest batch."""
        return max(size for size, _ in self.counts)

    @property
    def examples(self) -> int:
        """Examples of all batches."""
        return sum(size * n for size, n in self.counts)

    @property
    def batches(self) -> int:
        """The number of batches."""
        return sum(n for _, n in self.counts)

    def to_loader(self, first_bytes: int, fixed: int = 0) -> int:
        """``first_bytes`` measured on the first batch, ``fixed`` of them a share every
        batch holds whatever its size, projected to all batches (rounded up):
        ``fixed * batches + (first_bytes - fixed) * examples / first``.
        """
        varying = max(0, first_bytes - fixed)
        return fixed * self.batches - (-varying * self.examples // self.first)

    def to_largest(self, first_bytes: int, fixed: int = 0) -> int:
        """``first_bytes`` of the first batch (``fixed`` of them whatever its size)
        projected to the largest: ``fixed + (first_bytes - fixed) * largest / first``.
        """
        varying = max(0, first_bytes - fixed)
        return fixed - (-varying * self.largest // self.first)

    def sliced(self, size: int) -> BatchSizes:
        """The sizes of the same batches cut into slices of at most ``size`` examples
        (:class:`~laplace_glas.curvature.data.batches.SubBatches`).
        """
        counts: dict[int, int] = {}
        for examples, n in self.counts:
            whole, rest = divmod(examples, size)
            for part, times in ((size, whole), (rest, 1)):
                if part and times:
                    counts[part] = counts.get(part, 0) + n * times
        return BatchSizes(min(self.first, size), tuple(sorted(counts.items())))


def survey_batch_sizes(
    loader: Iterable, dict_key_x: str = "input_ids", dict_key_y: str = "labels"
) -> BatchSizes | None:
    """The :class:`BatchSizes` of ``loader`` where they are known without loading its
    data (see the module), else ``None`` (also for an empty loader).
    """
    if isinstance(loader, SubBatches):
        sizes = survey_batch_sizes(loader.loader, loader.dict_key_x, loader.dict_key_y)
        return None if sizes is None else sizes.sliced(loader.size)
    if isinstance(loader, XYBatches):
        return survey_batch_sizes(loader.loader, dict_key_x, loader.dict_key_y)
    if isinstance(loader, DataLoader):
        return _data_loader_sizes(loader)
    if isinstance(loader, ReplayedBatches):
        loader = loader.items
    if isinstance(loader, list | tuple):
        try:
            sizes = [batch_size(split_batch(d, dict_key_y)[0], dict_key_x) for d in loader]
        except (KeyError, TypeError, IndexError, AttributeError, ValueError):
            return None  # batches the fit itself will refuse, with its own message
        return _of_sizes(sizes)
    return None


def _of_sizes(sizes: list[int]) -> BatchSizes | None:
    """The :class:`BatchSizes` of batches of ``sizes`` examples in order (``None`` for
    none, or an empty batch).
    """
    if not sizes or min(sizes) < 1:
        return None
    return BatchSizes(sizes[0], tuple(sorted(Counter(sizes).items())))


def _data_loader_sizes(loader: DataLoader) -> BatchSizes | None:
    """A ``DataLoader``'s sizes from its ``batch_size`` and its sampler's length."""
    if isinstance(loader.dataset, IterableDataset):
        return None
    b = loader.batch_size
    if b is None:
        return _batch_sampler_sizes(loader.batch_sampler)
    try:
        n = len(loader.sampler)
    except TypeError:
        return None
    whole, rest = divmod(n, b)
    counts = tuple((size, times) for size, times in ((b, whole), (rest, 1)) if size and times)
    if loader.drop_last:
        counts = counts[:1] if whole else ()
    if not counts:
        return None
    return BatchSizes(b if whole else rest, tuple(sorted(counts)))


def _batch_sampler_sizes(batch_sampler: Iterable | None) -> BatchSizes | None:
    """The sizes of the index batches a batch sampler draws (indices only, no data;
    torch's global random state restored after: the fit's own passes draw theirs).
    """
    if batch_sampler is None:
        return None
    try:
        with torch.random.fork_rng(devices=[]):
            sizes = [len(indices) for indices in batch_sampler]
    except TypeError:
        return None
    return _of_sizes(sizes)
