"""Which operator and which eigen-solver a fit uses, within its memory budget.

``solver`` of :class:`~laplace_glas.ActiveSubspaceLaplace`:

* ``'auto'`` (default): the fastest exact strategy whose estimated peak fits the
  memory budget (``memory_budget``; :mod:`~laplace_glas.curvature.memory.budget`), tried in
  this order (:data:`STRATEGIES`):

  0. ``'jacobian'``: the explicit-Jacobian operator
     (:mod:`~laplace_glas.curvature.operators.stored_jacobian`: the ``N R D`` rows of
     ``Lambda^{1/2} J_n`` stored, from the factors or ``torch.func``) where they fit and
     take less memory than the factors (adapters and heads over token sequences, a
     subnetwork, a small model with parameters outside supported layers); a factored
     operator of one dense block, so the same solvers (dual or Lanczos) and the same
     choice between them apply;
  1. ``'dual'`` / ``'factored'``: the factored operator
     (:mod:`~laplace_glas.curvature.operators.factored`) where the model and loss
     qualify, eigen-solved through the Gram matrix
     (:mod:`~laplace_glas.curvature.solvers.gram`) or by Lanczos on the factored
     products, whichever fits and, when both do, is cheaper (:func:`choose_solver`:
     fewer flops and ``K`` within the rule of :func:`~.gram.gram_fits`);
  2. ``'linearised'``: Lanczos on the linearised operator
     (:mod:`~laplace_glas.curvature.operators.linearized`: every batch's graph kept, no
     forward pass per product), as the one-column block solver (fully re-orthogonalised,
     images kept; ARPACK in a data-parallel fit);
  3. ``'streaming'``: an operator that recomputes one batch's graph per product (or a
     slice's, where a batch's does not fit; many columns in chunks): the factored
     operator rebuilt batch by batch (:mod:`~laplace_glas.curvature.operators.streamed`,
     the block solver with :data:`~.streaming.STREAMED_BLOCK` columns a pass where
     they fit, else one) where the model qualifies for factors that do not fit and
     every batch can be factored, else Lanczos (as in 2.) on curvlinops' operator.

  A budget below every estimate raises
  :class:`~laplace_glas.curvature.memory.budget.MemoryBudgetError`
  naming the smallest that works. The choice is recorded in ``la.lanczos_info.plan``
  (strategy, estimates, budget) and ``.operator`` (with the reasons for a fallback).
* ``'dual'`` / ``'factored'``: the dual solve (Jacobian or factored operator) / Lanczos
  on the factored operator, falling back (with a warning) to the next strategy that
  fits where the model does not qualify or the requested solve does not fit.
* ``'lanczos'``: curvlinops + ARPACK, the reference (streaming); ``'block'``: block
  Krylov (the fit's ``block_size``) on the first operator that fits, in the order
  above (the streamed ones included).

:func:`plan_solve` makes the choice for one
:class:`~laplace_glas.curvature.data.problem.CurvatureProblem` as a :class:`Plan`; the
empirical Fisher and Hessian backends get curvlinops' operators (streaming). Estimated
peaks: :mod:`~laplace_glas.curvature.memory.budget`. Another strategy is one more entry of
:data:`STRATEGIES` and one more step of :func:`plan_solve`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from laplace_glas.curvature.backends import MATRIX_NAMES, CurvatureChoice, ef_loss
from laplace_glas.curvature.data.batches import SubBatches
from laplace_glas.curvature.data.example_counts import survey_batch_sizes
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.budget import (
    Estimates,
    MemoryBudgetError,
    OverBudget,
    format_bytes,
    resolve_budget,
    return_freed_memory,
    solver_storage,
)
from laplace_glas.curvature.memory.streaming import (
    STREAMED_BLOCK,
    choose_streaming,
    sliced_problem,
    streamed_factored,
    streamed_factors_fit,
    streamed_linearized,
    streamed_what,
    streaming_estimate,
    streaming_passes,
)
from laplace_glas.curvature.operators.curvlinops import curvlinops_operator
from laplace_glas.curvature.operators.factored import (
    CHUNK_ELEMENTS,
    FactorSizes,
    build_factored_ggn,
)
from laplace_glas.curvature.operators.factors import stored_bytes
from laplace_glas.curvature.operators.jacobian_estimates import (
    estimate_build_bytes,
    estimate_jacobian_bytes,
)
from laplace_glas.curvature.operators.linearized import build_linearized_ggn
from laplace_glas.curvature.operators.stored_jacobian import build_jacobian_ggn
from laplace_glas.curvature.operators.torch_operator import ColumnChunks
from laplace_glas.curvature.solvers.gram import choose_solver, factored_solver

__all__ = ["SOLVERS", "STRATEGIES", "MemoryBudgetError", "Plan", "choose_solver", "plan_solve"]

STRATEGIES = ("jacobian", "dual", "factored", "linearised", "streaming")
"""The exact strategies, fastest first (the dual and factored ones ordered by flops)."""

SOLVERS = ("auto", "dual", "factored", "lanczos", "block")
"""The ``solver`` values :class:`~laplace_glas.ActiveSubspaceLaplace` accepts."""

_GGN = CurvatureChoice("ggn", "CurvlinopsGGN")


@dataclass(frozen=True)
class Plan:
    """How one curvature problem is solved: the top eigenpairs of ``scale * operator``.

    Attributes
    ----------
    operator : object
        The operator (factored, linearised, curvlinops', or a wrapper of one of them).
    scale : float
        The factor of every product.
    solver : str
        ``'auto'``, ``'dual'``, ``'lanczos'`` or ``'block'`` for
        :func:`~laplace_glas.curvature.solvers.solve.compute_eigenpairs`.
    operator_name : str
        Recorded as ``Eigenpairs.operator``, with the reasons for a fallback.
    n_data : int
        The number of likelihood terms the operator averages over (recorded).
    curvature : {'ggn', 'ef', 'hessian'}
        The matrix (laplace-torch's backend).
    budget_bytes : int or None
        The memory budget of the solve (None: none was applied).
    reasons : tuple of str
        Why the faster strategies were not used.
    strategy : str
        One of :data:`STRATEGIES` (``''`` where no budget was applied).
    estimated_peak : int or None
        The chosen strategy's estimated peak bytes (None: unknown).
    estimates : tuple of (str, int)
        Every strategy's estimate that was made (``-1``: unknown), fastest first.
    max_columns : int or None
        Columns a streaming product may take at once within the budget (set for
        streaming plans, and for data-parallel plans, whose fallback streams).
    streaming_peak : int or None
        The streaming estimate (with ``max_columns``).
    block_size : int or None
        Columns per pass of the block solver chosen here (None: the caller's).

    """

    operator: Any
    scale: float
    solver: str
    operator_name: str
    n_data: int
    curvature: str = "ggn"
    budget_bytes: int | None = None
    reasons: tuple[str, ...] = ()
    strategy: str = ""
    estimated_peak: int | None = None
    estimates: tuple[tuple[str, int], ...] = ()
    max_columns: int | None = None
    streaming_peak: int | None = None
    block_size: int | None = None

    def summary(self) -> dict[str, Any]:
        """The plan without its operator (plain values, for ``Eigenpairs.plan``)."""
        return {
            "curvature": self.curvature,
            "operator": self.operator_name,
            "solver": self.solver,
            "scale": float(self.scale),
            "n_data": int(self.n_data),
            "budget_bytes": -1 if self.budget_bytes is None else int(self.budget_bytes),
            "reasons": tuple(self.reasons),
            "strategy": self.strategy,
            "estimated_peak_bytes": -1 if self.estimated_peak is None else self.estimated_peak,
            "estimates": tuple(self.estimates),
        }


def plan_solve(
    problem: CurvatureProblem,
    k: int,
    solver: str = "auto",
    curvature: CurvatureChoice | None = None,
    *,
    memory_budget: int | None = None,
    ncv: int | None = None,
    block_size: int | None = None,
) -> Plan:
    """The operator and the solver for the top-``k`` eigenpairs of ``problem``.

    The GGN: curvlinops' operator (with ``problem.scale``) for ``solver='lanczos'`` (the
    reference); the other solvers get the fastest strategy whose estimated peak fits
    ``memory_budget`` bytes (None: the default share of the device's free memory,
    :func:`~laplace_glas.curvature.memory.budget.resolve_budget`): the factored operator where
    the model qualifies (dual or Lanczos; ``'block'`` then multiplies its blocks with
    two GEMMs per layer instead of a pass over the data), else the linearised operator
    of ``problem.loss_func`` on ``problem.data``, else streaming (the factors rebuilt per
    batch where the model qualifies, else curvlinops' operator);
    a request for the factored or dual solver that cannot be met is answered with a
    warning. ``ncv`` and ``block_size`` size the solver's storage.

    The empirical Fisher and the Hessian (``curvature``, from
    :func:`~laplace_glas.curvature.backends.resolve_backend`) are curvlinops'
    ``EFLinearOperator`` / ``HessianLinearOperator`` of the same loss with the same
    scale, solved by Lanczos unless ``solver='block'`` (streaming).

    Raises
    ------
    MemoryBudgetError
        If no strategy's estimated peak fits the budget; it names the smallest budget
        that one fits.

    """
    curvature = _GGN if curvature is None else curvature
    if problem.output_hessian is not None and curvature.kind != "ggn":
        raise ValueError(
            "A posterior-averaged output Hessian replaces the GGN's loss Hessian; got "
            f"backend curvature {curvature.kind!r} (use a GGN backend)."
        )
    base = "block" if solver == "block" else "lanczos"
    itemsize = torch.finfo(problem.dtype).bits // 8
    total = resolve_budget(memory_budget, problem.device)
    storage = solver_storage(base, problem.n_params, k, itemsize, ncv=ncv, block_size=block_size)
    budget = Estimates(total, storage, itemsize, problem.n_params, k, problem.device)
    if curvature.kind != "ggn":
        return _curvlinops_plan(problem, solver, curvature, budget)
    budget.batches = survey_batch_sizes(problem.loader, problem.dict_key_x, problem.dict_key_y)
    problem = sliced_problem(problem, budget)
    if solver == "lanczos":
        reference = problem.reference_operator()
        return _streaming_plan(problem, reference, "curvlinops", (), budget, base)
    jacobian = _jacobian(problem, solver, budget)
    if isinstance(jacobian, Plan):
        return jacobian
    built = _factored(problem, solver, budget)
    if isinstance(built, Plan):
        return built
    return_freed_memory()  # the refused builds' batches, before the next attempt
    reasons = [built]  # the Jacobian is an optimisation: its refusal is no fallback
    linearized = _linearized(problem, budget)
    if isinstance(linearized, str):
        return_freed_memory()
        reasons.append(linearized)
        name = f"curvlinops (not factored: {built}; not linearised: {linearized})"
    size = {} if base == "block" or problem.shards else {"solver": "block", "block_size": 1}
    if not isinstance(linearized, str):
        _warn_fallback(solver, built, "the linearised operator")
        return replace(Plan(
            linearized, problem.scale, base, f"linearised (not factored: {built})",
            problem.n_terms, "ggn", total, tuple(reasons), "linearised",
            budget.estimates["linearised"], budget.pairs(),
            *_distributed_fallback(problem, budget),
        ), **size)  # fmt: skip
    streamed = streamed_factored(problem, built, linearized, budget)
    block = STREAMED_BLOCK if size else None  # the planner's choice of solver only
    relinearized = None  # not checked where the rebuilt factors are taken anyway
    if not streamed_factors_fit(streamed, budget):
        relinearized = streamed_linearized(problem, built, linearized, budget, block)
    plan = _streaming_plan(
        problem, problem.reference_operator(), name, reasons, budget, base,
        streamed, block, relinearized,
    )  # fmt: skip
    _warn_fallback(solver, built, streamed_what(plan.operator.operator, streamed, relinearized))
    if size and plan.block_size is not None:
        size = {**size, "block_size": plan.block_size}
    return replace(plan, **size)


def _warn_fallback(solver: str, built: str, what: str) -> None:
    """Warn that a requested factored or dual solve gave way to ``what`` (streamed)."""
    _warn_unfactored(
        solver, f", which this fit cannot use ({built}); solving on {what} instead.", stacklevel=5
    )


def _warn_unfactored(solver: str, instead: str, stacklevel: int) -> None:
    """Warn that a requested factored or dual solve (``solver``) cannot have the factored
    GGN; ``instead`` ends the message with why and what is solved on.
    """
    if solver in ("dual", "factored"):
        warnings.warn(
            f"solver={solver!r} needs the factored GGN{instead}",
            UserWarning,
            stacklevel=stacklevel,
        )


def _distributed_fallback(problem: CurvatureProblem, budget: Estimates) -> tuple:
    """Streaming's ``(max_columns, peak)`` for a data-parallel plan, else ``(None, None)``."""
    if problem.shards is None:
        return None, None
    peak, columns = streaming_estimate(budget, problem)
    return columns, peak


def _streaming_plan(
    problem,
    operator,
    name,
    reasons,
    budget: Estimates,
    solver: str,
    streamed=None,
    block=None,
    relinearized=None,
) -> Plan:
    """Streaming in column chunks that fit (:func:`~.streaming.choose_streaming`:
    ``streamed``, the factors rebuilt per product, or ``relinearized``, the linearised
    operator's, ``block`` columns per pass where they fit, else curvlinops'
    ``operator``), or the budget error.
    """
    chosen = choose_streaming(budget, problem, operator, name, streamed, block, relinearized)
    peak, columns, operator, name, scale, block_size = chosen
    sliced = problem.loader.size if isinstance(problem.loader, SubBatches) else None
    if not budget.record("streaming", peak):
        cut = "" if sliced is None else f", its batches cut into slices of {sliced}"
        raise budget.refuse(f"this fit{cut}", sliced == 1, streaming_passes(problem.loader, budget))
    operator = ColumnChunks(operator, columns, problem.dtype, problem.device)
    if sliced is not None:
        name = f"{name} (batches in slices of {sliced})"
    return Plan(
        operator, scale, solver, name, problem.n_terms, "ggn", budget.total,
        tuple(reasons), "streaming", peak, budget.pairs(), columns, peak, block_size,
    )  # fmt: skip


def _build(builder: Callable, problem: CurvatureProblem, budget: Estimates, **extra: Any):
    """``builder`` (the Jacobian or the factored operator's) on ``problem``, its data within
    what the budget leaves beside the least solver storage (Lanczos's, or dual's 3kDs).
    """
    s = budget.itemsize
    return builder(
        **problem.batch_arguments(),
        budget_bytes=max(1, budget.total - min(budget.storage, 3 * budget.k * budget.D * s)),
        loss_fn=problem.loss_fn,
        progress_bar=problem.progress_bar,
        **extra,
    )


def _jacobian(problem: CurvatureProblem, solver: str, budget: Estimates) -> Plan | str:
    """The plan on stored Jacobians (dual or Lanczos) within the budget, or why not
    (``''`` where ``solver='factored'`` asks for the factored operator).

    Tried first: no pass over the data when the estimate (:func:`estimate_jacobian_bytes`,
    ``N R D s``, in the factored formulas with a batch's build, :func:`estimate_build_bytes`)
    exceeds the budget or the first batch's Jacobians outweigh its factors (checked on
    ``problem.first_batch`` where known). Recorded (named) once built.
    """
    if solver == "factored":
        return ""
    s, wants_dual, first = budget.itemsize, solver in ("auto", "dual"), problem.first_batch
    examples = None if budget.batches is None else budget.batches.examples
    rows = estimate_jacobian_bytes(
        problem.n_terms, problem.out_shape, problem.likelihood, problem.n_params, s, examples
    )
    largest = problem.first_batch_size() if budget.batches is None else budget.batches.largest
    build = estimate_build_bytes(
        problem.model, problem.params, problem.likelihood, problem.out_shape,
        budget.graph or 0, largest, s,
    )  # fmt: skip
    lanczos, dual = budget.factored_peaks(rows, build, 1, rows // (problem.n_params * s))
    best = min(lanczos, dual) if wants_dual and dual is not None else lanczos
    if best > budget.total:  # not recorded: the model may not allow this strategy at all
        return (
            f"explicit Jacobians' estimated peak {format_bytes(best)} exceeds the memory "
            f"budget {format_bytes(budget.total)}"
        )
    built = _build(build_jacobian_ggn, problem, budget, n_examples=examples, first_batch=first)
    if isinstance(built, str):
        return built
    rows = built.J.numel() * built.J.element_size()
    lanczos, dual = budget.factored_peaks(rows, build, 1, built.n_examples * built.n_rows)
    fits_lanczos = lanczos <= budget.total
    fits_dual = wants_dual and dual is not None and dual <= budget.total
    if not (fits_lanczos or fits_dual):
        budget.record("jacobian", lanczos)
        return f"explicit Jacobians exceed the memory budget {format_bytes(budget.total)}"
    chosen = factored_solver(built, solver, budget.k, fits_lanczos, fits_dual)
    peak = dual if chosen == "dual" else lanczos
    budget.record("jacobian", peak)
    return Plan(
        built, 1.0, chosen, "jacobian", problem.n_terms, "ggn", budget.total, (),
        "jacobian", peak, budget.pairs(), *_distributed_fallback(problem, budget),
    )  # fmt: skip


def _factored(problem: CurvatureProblem, solver: str, budget: Estimates) -> Plan | str:
    """The factored plan (dual or Lanczos) of ``problem`` within the budget, or why not."""
    s = budget.itemsize
    wants_dual = solver in ("auto", "dual")

    def check(sizes: FactorSizes) -> str | None:
        budget.first_factors = sizes  # streaming's first estimate, should they not fit
        projected = [
            budget.to_loader(size, sizes.n_batches)
            for size in (sizes.batch_bytes, sizes.layer_bytes, sizes.widest, sizes.rows)
        ]
        if None in projected:
            return None  # the cumulative cap below applies
        lanczos, dual = budget.factored_peaks(*projected)
        fits = budget.record("factored", lanczos)
        if wants_dual and dual is not None:
            fits = budget.record("dual", dual) or fits
        if fits:
            return None
        best = lanczos if dual is None or not wants_dual else min(lanczos, dual)
        return OverBudget(
            f"the factored operator's estimated peak {format_bytes(best)} exceeds the memory "
            f"budget {format_bytes(budget.total)}",
            needed=best,
        )

    built = _build(build_factored_ggn, problem, budget, first_batch_check=check)
    if isinstance(built, str):
        return built
    # with the explicit rows the products form; the build held the largest layer twice
    # while joining its batches
    layers = [stored_bytes(f) for f in built.factors]
    M, widest = built.n_examples * built.n_rows, built.widest
    lanczos, dual = budget.factored_peaks(sum(layers), max(layers, default=0), widest, M)
    # the first batch's projection (with the join's layer) where one was made and the
    # built factors did not outgrow it, so that the estimate reported is the one decided
    # on; factors larger than projected (a loader whose batch sizes were not known) are
    # decided on again
    lanczos = max(lanczos, budget.estimates.get("factored") or 0)
    if dual is not None:
        dual = max(dual, budget.estimates.get("dual") or 0)
    fits_lanczos = budget.record("factored", lanczos)
    fits_dual = wants_dual and dual is not None and budget.record("dual", dual)
    if not (fits_lanczos or fits_dual):
        return OverBudget("the factored operator exceeds the memory budget", needed=lanczos)
    chosen = factored_solver(built, solver, budget.k, fits_lanczos, fits_dual)
    strategy = "dual" if chosen == "dual" else "factored"
    # a product's temporaries: what the budget leaves beyond the estimate (which
    # counts one column's), up to the default chunk; the estimate grows with what the
    # solver may take of them (Lanczos' record of products takes the allowance, the
    # dual solve's products of k columns at most one column chunk)
    spare = (budget.total - budget.estimates[strategy]) // (2 * s)
    chunk = int(min(CHUNK_ELEMENTS, widest + max(0, spare)))
    built.chunk_elements = max(chunk, widest)
    used = built.chunk_elements
    if strategy == "dual":
        used = max(widest, min(built.product_elements(), budget.k * widest))
    peak = budget.estimates[strategy] + 2 * s * (used - widest)
    return Plan(
        built, 1.0, chosen, "factored", problem.n_terms, "ggn", budget.total, (),
        strategy, peak, budget.pairs(), *_distributed_fallback(problem, budget),
    )  # fmt: skip


def _linearized(problem: CurvatureProblem, budget: Estimates):
    """The linearised operator within the budget (its estimate recorded), or why not."""
    s = budget.itemsize
    room = budget.total - budget.storage - 2 * budget.D * s
    built = build_linearized_ggn(
        problem.loss_on_data(),
        device=problem.device,
        budget_bytes=max(1, room),
        progress_bar=problem.progress_bar,
        batch_sizes=budget.batches,
    )
    if isinstance(built, OverBudget):
        needed = None if built.needed is None else built.needed + budget.total - room
        budget.record("linearised", needed)
        return built
    if isinstance(built, str):
        return built
    per_batch = built.saved_bytes // max(1, len(built.linearizations))
    peak = built.resident_bytes + per_batch + budget.total - room
    budget.record("linearised", peak)
    built.column_chunk = max(1, min(built.column_chunk, (room - built.resident_bytes) // per_batch))
    return built


def _curvlinops_plan(
    problem: CurvatureProblem, solver: str, curvature: CurvatureChoice, budget: Estimates
) -> Plan:
    """The plan of curvlinops' empirical Fisher or Hessian operator of ``problem``'s loss
    (streaming, within the budget).
    """
    _warn_unfactored(
        solver,
        f"; the {MATRIX_NAMES[curvature.kind]} ({curvature.backend}) uses curvlinops + Lanczos.",
        stacklevel=4,
    )
    loss = problem.loss_on_data()
    if curvature.kind == "ef":
        loss = replace(loss, loss_func=ef_loss(loss.loss_func, len(problem.out_shape)))
    operator = curvlinops_operator(curvature.kind, loss)
    name = "curvlinops EF" if curvature.kind == "ef" else "curvlinops Hessian"
    solver = "block" if solver == "block" else "lanczos"
    plan = _streaming_plan(problem, operator, name, (), budget, solver)
    return replace(plan, curvature=curvature.kind)
