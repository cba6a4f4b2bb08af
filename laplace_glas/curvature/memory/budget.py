"""The memory budget of an eigen-solve: its default, the solvers' storage, the measured peak.

``memory_budget`` of :class:`~laplace_glas.ActiveSubspaceLaplace` bounds what the
planner (:func:`~laplace_glas.curvature.memory.planner.plan_solve`) may spend on the operator,
its products and the solver's ``O(k D)`` storage. The default, :func:`resolve_budget`
with ``None``, is :data:`DEFAULT_SHARE` (half) of the memory free on the model's device
when the fit starts:

* CUDA: ``torch.cuda.mem_get_info``'s free bytes plus what torch's caching allocator
  holds without using it (``memory_reserved - memory_allocated``);
* the host: ``MemAvailable`` of ``/proc/meminfo``, capped by the cgroup limit
  (``memory.max - memory.current``) where one is set, else
  ``os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')``, else 4 GiB.

Storage of the solvers in ``D``-vectors of the model's itemsize ``s``
(:func:`solver_storage`): ARPACK's Lanczos keeps its ``ncv`` basis vectors and three
work vectors, and the fit holds the ``k`` eigenvectors, their sorted copy and their
images for the residual check, ``(ncv + 5 k + 8) D s`` in all; the block solver keeps a
basis and its images of ``max_basis = max(2 k + p, 3 p)`` columns each (``ncv`` for
``p = 1``, the Lanczos of the linearised operator) plus a few blocks,
``(2 max_basis + 3 p + 3 k) D s``; the Lanczos estimate is the larger of the two.

Estimated peaks of the planner's strategies, in bytes, with ``s`` the itemsize, ``D``
the parameters, ``k`` the pairs and the solver's storage ``B`` (:func:`solver_storage`:
``(ncv + 5 k + 8) D s`` for Lanczos), each measured on the first batch and projected
to the loader by its examples (:mod:`~laplace_glas.curvature.data.example_counts`): what grows
with the data (factors, kept graphs, ``M``) to all examples, one batch's share (a
forward graph, a product's temporaries) to the largest batch's; by the number of
batches where the sizes are not known without a pass over the data:

* jacobian: the rows ``N R D s``
  (:func:`~laplace_glas.curvature.operators.jacobian_estimates.estimate_jacobian_bytes`, before
  any pass over the data) in the factored formulas below, with ``M = N R`` and one
  batch's build in place of a layer's join
  (:func:`~laplace_glas.curvature.operators.jacobian_estimates.estimate_build_bytes`:
  the batch's rows ``B R D s`` beside ``6 g``, its factors, forward graph ``g`` and
  backward, 5.6 g measured on the GPT-2 LoRA classifier of ``benchmarks/scale.py``;
  on the ``torch.func`` route at least ``O g`` and the batch's full Jacobian);
* factored + Lanczos: the factors ``F`` plus one layer's (joining the batches), one
  column's GEMM temporaries ``2 W s`` (``W``: the widest layer's ``N T d_out``) and
  ``2 D s``, plus ``B``; the products of many columns then take the chunks the rest
  of the budget allows (at most ``2^25`` numbers), added to the recorded estimate;
* dual: ``F`` plus the Gram matrix and its build's temporaries (:func:`gram_build_numbers`:
  ``(M^2 + 2 min(M^2, 2^20)) s`` on the CPU, ``3 M^2 s`` elsewhere; ``M = N R``), its eigen-solve's
  ``(4 k + 40) M`` float64 numbers and ``3 k D s`` for the eigenvectors;
* linearised: every batch's kept graphs and, on the host, a heap page per kept
  storage, plus one batch's graphs for a product's temporaries
  (:func:`~laplace_glas.curvature.operators.linearized.build_linearized_ggn`), ``2 D s``
  and ``B``;
* streaming: one batch's forward graph ``g``
  (:func:`~laplace_glas.curvature.operators.graph_bytes.forward_graph_bytes`) plus per
  column ``4 g + 3 D s`` (tangents and gradients of the activations before and after
  the nonlinearities, the column in and out; measured about ``3.5 g`` on an MLP),
  plus ``B``. Where that exceeds the budget, the batches are cut into equal slices of
  ``c`` examples (:meth:`Estimates.slice_size`; ``g`` taken as ``g c / b`` for batches
  of ``b``) and every strategy is estimated on the slices; one example's estimate is
  the smallest budget named. For a model the factored operator covers, streaming
  rebuilds one batch's factors per product instead
  (:class:`~laplace_glas.curvature.operators.streamed.StreamedFactoredGGN`): the graph
  ``g`` and the hooks' copies of the layer outputs (up to another ``g``), the batch's
  factors ``F_b`` and ``R g`` for its batched backward over the ``R`` rows of
  ``Lambda^{1/2}`` (the largest batch's, from a survey pass over the data), plus per
  column ``4 D s`` (the column in and out, a batch's partial product) and ``2 W s`` (the
  GEMMs' temporaries, ``W`` the widest layer's ``B T d_out``), plus ``B``
  (:meth:`Estimates.factor_streaming_peak`); where
  that exceeds the budget and curvlinops' streaming does not, curvlinops streams.
  For a model the linearised operator covers, streaming rebuilds one batch's kept
  graphs per product
  (:class:`~laplace_glas.curvature.operators.relinearized.RelinearizedGGN`): the
  first batch's graphs ``L`` (as the kept build counted them; later batches are taken
  to be no larger, as the kept build's projection does) and its forward graph ``g``
  (the linearisation's temporaries) plus per column ``L`` (the two backward passes'
  temporaries, as for the kept operator) and ``4 D s``, plus ``B``
  (:meth:`Estimates.linearized_streaming_peak`).

The fit measures its peak and warns where it passes the budget
(:mod:`~laplace_glas.curvature.memory.peak`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Any

import torch

from laplace_glas.curvature.data.example_counts import BatchSizes

__all__ = [
    "DEFAULT_SHARE",
    "HOST_PAGE_BYTES",
    "HOST_SLACK",
    "Estimates",
    "MemoryBudgetError",
    "OverBudget",
    "format_bytes",
    "free_memory",
    "resolve_budget",
    "return_freed_memory",
    "solver_storage",
]

DEFAULT_SHARE = 0.5
"""Share of the device's free memory that ``memory_budget=None`` grants a fit."""

HOST_SLACK = 32 * 2**20
"""Bytes a fit's measured host peak may exceed its budget by: what the process, not the
fit, takes during it (libraries torch loads at a process's first product, memory the
allocator keeps from an earlier step; see
:class:`~laplace_glas.curvature.memory.peak.PeakMemory`)."""

HOST_PAGE_BYTES = mmap.PAGESIZE
"""Bytes the host heap keeps resident beside each storage a kept graph holds: freed
temporaries share the pages at a kept storage's ends, so handing the freed pages back
leaves about a page per storage (the kept-graph estimate of
:func:`~laplace_glas.curvature.operators.linearized.build_linearized_ggn` counts them)."""

_FALLBACK_FREE = 4 * 2**30  # bytes assumed free where the system does not say


class MemoryBudgetError(ValueError):
    """No exact strategy fits ``memory_budget``; ``smallest`` is the smallest budget
    (bytes) that one of them fits (``None`` where none could be estimated), and
    ``estimates`` maps each strategy tried to its estimated peak.
    """

    def __init__(self, message: str, budget: int, smallest: int | None, estimates: dict):
        super().__init__(message)
        self.budget = budget
        self.smallest = smallest
        self.estimates = dict(estimates)


def format_bytes(n: int | float) -> str:
    """``n`` bytes in bytes (below 1 KiB), KiB (below 1 MiB), MiB or GiB (from 10 GiB),
    with three significant digits (``'2.98 MiB'``, ``'64.0 MiB'``, ``'560 MiB'``), so that
    an estimate and a budget that differ by 1% read differently, for messages.
    """
    if n < 2**10:
        return f"{int(n)} B"
    value, unit = next(
        (n / 2**power, unit)
        for power, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB"))
        if n >= (10 * 2**30 if unit == "GiB" else 2**power)
    )
    digits = 0 if value >= 100 else 1 if value >= 10 else 2
    return f"{value:.{digits}f} {unit}"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def _host_free() -> int:
    free = _meminfo_available()
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = _FALLBACK_FREE
    cgroup = _cgroup_free()
    return free if cgroup is None else min(free, cgroup)


def free_memory(device: torch.device | str) -> int:
    """Bytes free on ``device`` (see the module)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    return int(_host_free())


def resolve_budget(budget: int | None, device: torch.device | str) -> int:
    """``budget`` (checked bytes), or :data:`DEFAULT_SHARE` of :func:`free_memory`."""
    if budget is not None:
        return int(budget)
    return max(1, int(DEFAULT_SHARE * free_memory(device)))


def lanczos_ncv(k: int, n_params: int, ncv: int | None = None) -> int:
    """ARPACK's basis size: ``ncv``, or its default ``min(D, max(2 k + 1, 20))``."""
    return ncv if ncv is not None else min(n_params, max(2 * k + 1, 20))


def solver_storage(
    solver: str,
    n_params: int,
    k: int,
    itemsize: int,
    *,
    ncv: int | None = None,
    block_size: int | None = None,
) -> int:
    """Bytes the eigen-solver keeps in ``D``-vectors (see the module): Lanczos
    ``(ncv + 5 k + 8) D s``, block ``(2 max_basis + 3 p + 3 k) D s``.
    """
    ncv = lanczos_ncv(k, n_params, ncv)
    if solver == "block":
        p = block_size or max(k, 8)
        max_basis = min(n_params, max(2 * k + p, 3 * p) if p > 1 else max(ncv, k + 2))
        return (2 * max_basis + 3 * p + 3 * k) * n_params * itemsize
    # the planner may run Lanczos as the one-column block solver (linearised operator)
    one_column = solver_storage("block", n_params, k, itemsize, ncv=ncv, block_size=1)
    return max(one_column, (ncv + 5 * k + 8) * n_params * itemsize)


class OverBudget(str):
    """A builder's refusal (a reason, as a ``str``) that says what it would need:
    ``needed`` bytes for the operator (``None`` if unknown) and ``batch_bytes``, one
    batch's share.
    """

    needed: int | None
    batch_bytes: int | None

    def __new__(cls, reason: str, needed: int | None = None, batch_bytes: int | None = None):
        """The reason with its sizes."""
        self = super().__new__(cls, reason)
        self.needed, self.batch_bytes = needed, batch_bytes
        return self


GRAM_CHUNK_ELEMENTS = 2**20
"""Numbers in the chunks of the dual solve's Gram build on the CPU, all threads together
(4 MiB of float32; each thread's chunk is kept in cache for the Hadamard product)."""


def gram_build_numbers(M: int, device: torch.device | str = "cpu") -> int:
    """Numbers held while the dual solve builds its ``M x M`` Gram matrix ``K``: on the
    CPU ``K`` plus three chunks per thread (``M^2 + 3 min(M^2, 2^20)`` at most), elsewhere
    ``K``, a layer's block and its Hadamard factor (``3 M^2``).
    """
    if torch.device(device).type == "cpu":
        return M * M + 3 * min(M * M, GRAM_CHUNK_ELEMENTS)
    return 3 * M * M


class Estimates:
    """The budget of one planning and the estimated peaks made so far (bytes).

    The formulas are those of the module's docstring;
    ``storage`` is the solver's (:func:`solver_storage`). A strategy records its
    estimate with :meth:`record` (``None``: unknown) and learns whether it fits.
    """

    def __init__(
        self,
        total: int,
        storage: int,
        itemsize: int,
        n_params: int,
        k: int,
        device: torch.device | str = "cpu",
    ):
        self.total, self.storage, self.itemsize = total, storage, itemsize
        self.D, self.k, self.device = n_params, k, device
        self.estimates: dict[str, int | None] = {}
        self.streaming: tuple[int | None, int] | None = None  # the planner's cache
        self.graph: int | None = None  # the largest batch's forward graph (bytes), once measured
        self.first_factors: Any = None  # the factored build's first batch (FactorSizes)
        self.batches: BatchSizes | None = None  # the loader's batch sizes, where known

    def to_loader(self, first_bytes: int, n_batches: int | None) -> int | None:
        """``first_bytes`` measured on the first batch, projected to the loader: by its
        examples where ``batches`` knows them
        (:meth:`~laplace_glas.curvature.data.example_counts.BatchSizes.to_loader`), else by its
        ``n_batches`` batches (``None`` where neither is known).
        """
        if self.batches is not None:
            return self.batches.to_loader(first_bytes)
        return None if n_batches is None else first_bytes * n_batches

    def to_largest(self, first_bytes: int) -> int:
        """``first_bytes`` measured on the first batch, projected to the largest batch
        (itself where ``batches`` is not known).
        """
        return first_bytes if self.batches is None else self.batches.to_largest(first_bytes)

    def record(self, strategy: str, peak: int | None) -> bool:
        """Record ``peak`` for ``strategy``; True when it fits (or is unknown)."""
        self.estimates[strategy] = peak
        return peak is None or peak <= self.total

    def pairs(self) -> tuple[tuple[str, int], ...]:
        """The estimates as ``(strategy, bytes)`` pairs (``-1``: unknown)."""
        return tuple((name, -1 if b is None else int(b)) for name, b in self.estimates.items())

    def factored_peaks(self, F: int, layer: int, widest: int, M: int) -> tuple[int, int | None]:
        """Peaks of factored + Lanczos and of the dual solve (None where ``k >= M``)
        for factors of ``F`` bytes, ``layer`` more while they are joined, the widest
        layer's ``widest`` numbers per column and ``M`` rows.
        """
        s, D, k = self.itemsize, self.D, self.k
        lanczos = F + layer + 2 * widest * s + 2 * D * s + self.storage
        if k >= M:
            return lanczos, None
        gram = gram_build_numbers(M, self.device) * s + (4 * k + 40) * M * 8
        return lanczos, F + max(layer, gram) + 3 * k * D * s

    def streaming_peak(self, graph: int | None) -> tuple[int | None, int]:
        """The streaming peak for one batch's forward graph of ``graph`` bytes, and the
        columns a product may take at once (``(None, 1)`` for an unknown graph).
        """
        if graph is None:
            return None, 1
        column = 4 * graph + 3 * self.D * self.itemsize
        free = self.total - self.storage - graph
        return self.storage + graph + column, max(1, free // column)

    def factor_streaming_peak(
        self, graph: int | None, factors: int, rows: int = 1, block: int = 1, widest: int = 0
    ) -> tuple[int | None, int]:
        """The peak of streaming on one batch's rebuilt factors (``factors`` bytes), its
        forward graph (``graph``) and the batched backward over its ``rows`` rows of
        ``Lambda^{1/2}`` per example, and the columns a product may take at once:
        ``B + (2 + R) g + F_b`` fixed (the graph, the hooks' copies of the layer
        outputs, up to another ``g``, and the backward's ``R g``) and
        ``4 D s + 2 W s`` per column (``W``: the widest layer's ``B T d_out`` numbers of
        GEMM temporaries), for ``block`` columns at once (``block > 1``: with the block
        solver's storage ``B`` for that block size; ``(None, 1)`` for an unknown graph).
        """
        if graph is None:
            return None, 1
        storage = self.storage
        if block > 1:
            storage = solver_storage("block", self.D, self.k, self.itemsize, block_size=block)
        fixed = storage + (2 + rows) * graph + factors
        column = (4 * self.D + 2 * widest) * self.itemsize
        return fixed + block * column, max(block, (self.total - fixed) // column)

    def linearized_streaming_peak(self, batch: int, block: int = 1) -> tuple[int, int]:
        """The peak of streaming on one batch's rebuilt graphs (``batch`` bytes, ``L``)
        and the columns a product may take at once: ``B + L + g`` fixed (``g``: the
        batch's forward graph, ``graph``, for the temporaries of the ``create_graph``
        backward pass while the batch is linearised; 0 where not measured) and
        ``L + 4 D s`` per column, for ``block`` columns at once (``block > 1``: with the
        block solver's storage ``B`` for that block size).
        """
        storage = self.storage
        if block > 1:
            storage = solver_storage("block", self.D, self.k, self.itemsize, block_size=block)
        fixed = storage + batch + (self.graph or 0)
        column = batch + 4 * self.D * self.itemsize
        return fixed + block * column, max(block, (self.total - fixed) // column)

    def slice_size(self, graph: int, batch: int) -> tuple[int, tuple[int, int]]:
        """The most examples ``c`` of a ``batch``-example batch whose forward graph
        (``graph`` bytes, taken as ``graph c / batch``) keeps the streaming estimate
        within the budget, ``c = floor((budget - B - 3 D s) batch / (5 graph))`` clipped
        to ``[1, batch]`` and evened out (``ceil(batch / ceil(batch / c))``: as many
        slices, of equal sizes), and :meth:`streaming_peak` of that slice (at ``c = 1``
        the smallest budget streaming fits).
        """
        fixed = self.storage + 3 * self.D * self.itemsize
        c = (self.total - fixed) * batch // (5 * graph) if graph > 0 else batch
        c = int(min(batch, max(1, c)))
        c = -(-batch // -(-batch // c))  # as many slices, of equal sizes
        return c, self.streaming_peak(graph * c // batch)

    def refuse(
        self, what: str, one_example: bool = False, passes: int | None = None
    ) -> MemoryBudgetError:
        """The error for a budget below every estimate, naming the smallest; where that
        is streaming's, it says what a fit there costs: ``2 k`` to ``9 k`` products (the
        range of this project's benchmarks), each ``passes`` forward and backward passes
        (the batches or slices of one pass over the data; ``None``: not known), against
        one pass for an unbudgeted fit's build. ``one_example`` (the batches already
        sliced to single examples) leaves smaller batches out of its advice.
        """
        known = {name: b for name, b in self.estimates.items() if b is not None}
        smallest = min(known.values()) if known else None
        listed = ", ".join(f"{name} {format_bytes(b)}" for name, b in known.items())
        need = (
            f"the smallest that works is memory_budget={smallest} ({format_bytes(smallest)})"
            if smallest is not None
            else "no estimate could be made"
        )
        if smallest is not None and known.get("streaming") == smallest:
            each = "a pass over the data"
            if passes is not None:
                single = " of one example" if one_example else ""
                each += f" ({passes} forward and backward pass{'es' if passes > 1 else ''}{single})"
            need += (
                f", where products stream: a solve of {self.k} pairs takes some "
                f"{2 * self.k}-{9 * self.k} products, each {each}, where an unbudgeted "
                "fit's operator takes one pass over the data in all"
            )
        advice = (
            "Fewer components need less (the fit already cuts the batches into single examples)."
            if one_example
            else "Fewer components or smaller batches need less."
        )
        return MemoryBudgetError(
            f"memory_budget={self.total} ({format_bytes(self.total)}) is below the estimated "
            f"peak of every exact strategy for {what} ({listed}): {need}. {advice}",
            self.total,
            smallest,
            self.estimates,
        )


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing
    elsewhere).

    Small blocks (a batch's factors, a forward pass's activations) sit on glibc's heap;
    freed, they stay resident, and what a later phase allocates lands beside them. The
    fit trims after each phase that passes over the data: the factored build's batches
    before their join (mlp16k: the build's peak 184 MiB above its start for 74 MiB of
    factors; 114 MiB, the factors plus one layer's, with the trim), the loss pass, the
    planner's refused attempts and every streamed product.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)  # the process's own symbols, libc's among them
    except (OSError, TypeError):  # TypeError: Windows' CDLL(None) on older Pythons
        return None
