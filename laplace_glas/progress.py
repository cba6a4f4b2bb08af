"""Progress bars over loaders that start one iterator per pass.

``tqdm.auto``'s bar (its asyncio variant) calls ``iter()`` on what it wraps when it is
built, and then iterates the wrapped object again: a ``DataLoader`` wrapped that way
started two iterators per pass, with ``num_workers > 0`` two sets of worker processes,
the first set's prefetched batches thrown away. :func:`progress` hands the bar one
iterator, and no bar at all where none is shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], desc: str, show: bool) -> Iterable[T]:
    """``iterable`` itself where ``show`` is false, else a tqdm bar over one iterator of
    it (its length, where it has one, as the bar's total).
    """
    if not show:
        return iterable
    try:
        total = len(iterable)  # type: ignore[arg-type]
    except TypeError:
        total = None
    return tqdm(iter(iterable), desc=desc, total=total)
