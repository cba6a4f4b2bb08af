"""The planner's streaming strategy: what a product recomputes, and what it may hold.

Streaming recomputes one batch's graph per product, so that the fit holds one batch
and the solver's ``O(k D)`` basis (:mod:`~laplace_glas.curvature.memory.budget` gives the
estimates). Three operators stream:

* the factored operator rebuilt batch by batch
  (:class:`~laplace_glas.curvature.operators.streamed.StreamedFactoredGGN`), for a
  model whose factors qualified but do not fit: a product is one forward and one
  batched backward pass per batch, and a block of columns shares them;
* the linearised operator rebuilt batch by batch
  (:class:`~laplace_glas.curvature.operators.relinearized.RelinearizedGGN`), for a
  model whose kept graphs qualified but do not fit: a product is one forward and one
  ``create_graph`` backward pass per batch, shared by a block of columns, and two
  backward passes per column;
* curvlinops' GGN operator, for every other model: a forward, a forward-mode and a
  backward pass per batch and column.

:func:`choose_streaming` takes the first whose estimate fits; :func:`sliced_problem`
cuts the batches into slices where not even one batch's graph fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from laplace_glas.curvature.data.batches import (
    SubBatches,
    XYBatches,
    batch_size,
    batch_to_device,
    slices_agree,
)
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.budget import Estimates, OverBudget, return_freed_memory
from laplace_glas.curvature.operators.graph_bytes import forward_graph_bytes
from laplace_glas.curvature.operators.relinearized import RelinearizedGGN
from laplace_glas.curvature.operators.streamed import BatchFactorSizes, StreamedFactoredGGN

__all__ = [
    "STREAMED_BLOCK",
    "choose_streaming",
    "sliced_problem",
    "streamed_factored",
    "streamed_linearized",
    "streamed_what",
    "streaming_estimate",
    "streaming_passes",
]


def streaming_estimate(budget: Estimates, problem: CurvatureProblem) -> tuple[int | None, int]:
    """Curvlinops' streaming estimate and the columns a product may take at once (one
    forward pass of the first batch, made once per planning, its graph projected to the
    largest batch).
    """
    if budget.streaming is None:
        graph = forward_graph_bytes(problem.model, problem.first_data(), problem.device)
        return_freed_memory()  # the measured graph's activations
        budget.graph = None if graph is None else budget.to_largest(graph)
        budget.streaming = budget.streaming_peak(budget.graph)
    return budget.streaming


def streaming_passes(loader: Any, budget: Estimates) -> int | None:
    """Batches (or slices) of one pass over ``loader``, the passes of one streamed
    product (for the planner's refusal; None: unknown).
    """
    if budget.batches is not None:
        return budget.batches.batches
    if isinstance(loader, SubBatches):
        return None  # its length is a bound where the batch sizes are not known
    try:
        return len(loader)
    except TypeError:
        return None


def sliced_problem(problem: CurvatureProblem, budget: Estimates) -> CurvatureProblem:
    """``problem`` on slices of its batches (:class:`~.batches.SubBatches`, as many as
    :meth:`~.budget.Estimates.slice_size` says) where a whole batch's streaming estimate
    exceeds the budget and the slices' outputs are the batch's, else ``problem``.
    """
    peak, _ = streaming_estimate(budget, problem)
    if peak is None or peak <= budget.total or problem.shards is not None:
        return problem
    X = batch_to_device(next(iter(problem.first_data()))[0], problem.device)
    b = batch_size(X, problem.dict_key_x)
    if budget.batches is not None:
        b = budget.batches.largest  # the graph is the largest batch's
    size, streaming = budget.slice_size(budget.graph, b)
    if size >= b or not slices_agree(problem.model, X, size, problem.dict_key_x):
        return problem
    budget.streaming, budget.graph = streaming, budget.graph * size // b
    count = None
    if budget.batches is not None:
        budget.batches = budget.batches.sliced(size)
        count = budget.batches.batches
    keys = (problem.dict_key_x, problem.dict_key_y)
    loader = SubBatches(problem.loader, size, *keys, full=b, count=count)
    data = XYBatches(loader, problem.dict_key_y)
    return replace(problem, loader=loader, data=data, first_batch=None)  # a slice comes first


def streamed_factored(
    problem: CurvatureProblem, built: str, linearized: str, budget: Estimates
) -> tuple[StreamedFactoredGGN, str, BatchFactorSizes] | None:
    """The factored operator rebuilt per product, with its name and its largest batch's
    factor sizes, where the factors of ``problem`` were refused for the budget alone
    (``built`` an :class:`~laplace_glas.curvature.memory.budget.OverBudget`: the model
    qualified and passed the first batch's forward-mode check), the first batch's
    estimate fits ``budget`` and a survey pass (a product's memory, no columns) finds
    every batch factorable; None otherwise and in a data-parallel fit (which streams
    curvlinops' products).
    """
    first = budget.first_factors
    if not isinstance(built, OverBudget) or problem.shards is not None or first is None:
        return None
    shape = (budget.graph, budget.to_largest(first.batch_bytes), first.rows_per_example)
    peak, _ = budget.factor_streaming_peak(*shape, widest=budget.to_largest(first.widest))
    if peak is not None and peak > budget.total:  # no survey pass for a plan that cannot fit
        return None
    operator = StreamedFactoredGGN(**problem.batch_arguments(), dtype=problem.dtype)
    sizes = operator.survey()
    if isinstance(sizes, str):  # a later batch the factors cannot take
        return None
    name = f"factored, rebuilt per batch (not stored: {built}; not linearised: {linearized})"
    return operator, name, sizes


def streamed_linearized(
    problem: CurvatureProblem,
    built: str,
    linearized: str,
    budget: Estimates,
    block: int | None = None,
) -> tuple[RelinearizedGGN, str, int] | None:
    """The linearised operator rebuilt per product, with its name and one batch's graph
    bytes, where the kept graphs of ``problem`` were refused for the budget alone
    (``linearized`` an :class:`~laplace_glas.curvature.memory.budget.OverBudget` with the
    first batch's bytes: the model passed the linearisation) and, where its estimate
    for one column or for ``block`` columns a pass fits ``budget``, the first batch
    passes the double-backward check (an operator neither of whose estimates fits is
    returned unchecked: it can only be refused, naming its estimate); None otherwise
    and in a data-parallel fit (which streams curvlinops' products).
    """
    batch = getattr(linearized, "batch_bytes", None)
    if not isinstance(linearized, OverBudget) or problem.shards is not None or batch is None:
        return None
    operator = RelinearizedGGN(problem.loss_on_data(), device=problem.device, batch_bytes=batch)
    name = f"linearised, rebuilt per batch (not factored: {built}; not kept: {linearized})"
    least = min(budget.linearized_streaming_peak(batch, block=width)[0] for width in _widths(block))
    if least > budget.total:
        return operator, name, batch  # unchecked: it can only size the refusal
    reason = operator.check()
    return_freed_memory()  # the checked batch's graphs
    return None if reason is not None else (operator, name, batch)


def streamed_factors_fit(streamed: tuple | None, budget: Estimates) -> bool:
    """Whether the rebuilt factors of ``streamed`` (from :func:`streamed_factored`) fit
    ``budget`` one column a pass: :func:`choose_streaming` then takes them, and the
    rebuilt linearisations need not be checked.
    """
    if streamed is None:
        return False
    sizes = streamed[2]
    shape = (budget.graph, sizes.factor_bytes, sizes.rows)
    peak, _ = budget.factor_streaming_peak(*shape, widest=sizes.widest)
    return peak is not None and peak <= budget.total


def _widths(block: int | None) -> tuple[int, ...]:
    """The columns a pass a streamed operator is estimated for: one, and ``block``."""
    return (1, block) if block is not None and block > 1 else (1,)


def streamed_what(operator: Any, streamed: tuple | None, relinearized: tuple | None) -> str:
    """What a streaming plan's ``operator`` is (one of ``streamed``'s and
    ``relinearized``'s, or curvlinops'), for the planner's fallback warning.
    """
    if streamed is not None and operator is streamed[0]:
        return "the factors rebuilt per batch"
    if relinearized is not None and operator is relinearized[0]:
        return "the linearised operator rebuilt per batch"
    return "curvlinops' operator"


STREAMED_BLOCK = 4
"""Columns per pass of the block solver on the rebuilt factors where the caller leaves
the solver to the planner: the pass over the data is shared by the block (mlp16k under
a 64 MiB budget: 28 products in 3.0 s against 23 in 5.9 s one column at a time; the
GPT-2 LoRA classifier, made to stream rebuilt factors: 88 in 26 s against 46 in 43 s)."""


def choose_streaming(
    budget: Estimates,
    problem: CurvatureProblem,
    operator: Any,
    name: str,
    streamed: tuple[StreamedFactoredGGN, str, BatchFactorSizes] | None = None,
    block: int | None = None,
    relinearized: tuple[RelinearizedGGN, str, int] | None = None,
) -> tuple[int | None, int, Any, str, float, int | None]:
    """``(peak, columns, operator, name, scale, block_size)`` of the streaming operator
    to use (``scale``: the factor of its products, 1 for the factored one;
    ``block_size``: the block solver's columns per pass chosen here, None to keep the
    caller's): ``streamed`` where its estimate
    (:meth:`~.budget.Estimates.factor_streaming_peak`, from its largest batch's factors)
    fits the budget, with ``block`` columns per pass where that fits too (``block``
    None: the caller chose the solver), else ``relinearized`` likewise
    (:meth:`~.budget.Estimates.linearized_streaming_peak`), else curvlinops' ``operator``
    (:func:`streaming_estimate`); where none fits, the one with the smallest estimate
    (which the caller refuses, naming it). The chosen streamed operator's product
    temporaries are bounded by its columns (``chunk_elements``).
    """
    peak, columns = streaming_estimate(budget, problem)
    options = [(peak, columns, operator, name, problem.scale, None)]
    widths = _widths(block)
    if relinearized is not None:
        rebuilt, rebuilt_name, batch = relinearized
        for width in widths:
            estimate = budget.linearized_streaming_peak(batch, block=width)
            wide = width if width > 1 else None
            options.insert(0, (*estimate, rebuilt, rebuilt_name, problem.scale, wide))
    if streamed is not None:
        rebuilt, rebuilt_name, sizes = streamed
        shape = (budget.graph, sizes.factor_bytes, sizes.rows)
        for width in widths:
            estimate = budget.factor_streaming_peak(*shape, block=width, widest=sizes.widest)
            wide = width if width > 1 else None
            options.insert(0, (*estimate, rebuilt, rebuilt_name, 1.0, wide))
    fitting = [option for option in options if option[0] is None or option[0] <= budget.total]
    chosen = fitting[0] if fitting else min(options, key=lambda option: option[0])
    if streamed is not None and chosen[2] is streamed[0]:
        chosen[2].chunk_elements = max(sizes.widest, chosen[1] * sizes.widest)
    if relinearized is not None and chosen[2] is relinearized[0]:
        chosen[2].column_chunk = max(1, min(chosen[2].column_chunk, chosen[1]))
    return chosen
