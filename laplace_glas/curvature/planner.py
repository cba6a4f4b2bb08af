"""Which operator and which eigen-solver a fit uses.

``solver`` of :class:`~laplace_glas.ActiveSubspaceLaplace`:

* ``'auto'`` (default): the factored operator
  (:mod:`~laplace_glas.curvature.operators.factored`) where the model and loss qualify, with
  the dual Gram solve (:mod:`~laplace_glas.curvature.solvers.gram`) when :func:`choose_solver`
  finds it fits the memory budget and costs fewer flops than Lanczos on the factored
  products; otherwise Lanczos on the linearised operator
  (:mod:`~laplace_glas.curvature.operators.linearized`: kept forward graphs, no forward pass per
  product), or on curvlinops' operator when the kept graphs exceed their budget. The
  choice is recorded in ``la.lanczos_info.solver`` and ``.operator`` (with the reasons
  for a fallback).
* ``'dual'`` / ``'factored'``: the dual solve / Lanczos on the factored operator,
  falling back (with a warning) to Lanczos on the linearised or curvlinops operator
  where the model does not qualify.
* ``'lanczos'``: curvlinops + ARPACK, the reference; ``'block'``: block Krylov on the
  factored, linearised or curvlinops operator (the first that applies).

The budget rule: the factors (activations and ``R`` output-side gradients per
weight layer), and the linearised operator's kept graphs, may each take
``max(2 GiB, 4 k D itemsize)`` bytes, the Gram matrix ``max(768 MiB, k D itemsize)``;
beyond them the next option is used, so memory stays ``O(k D)`` plus the activations
(for the linearised operator: plus its kept graphs, as far as its count of them goes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from laplace_glas.curvature.operators.factored import (
    FactoredGGN,
    build_factored_ggn,
    default_factor_budget,
)
from laplace_glas.curvature.operators.linearized import build_linearized_ggn
from laplace_glas.curvature.solvers.gram import gram_fits, gram_flops

__all__ = ["SOLVERS", "choose_solver", "select_operator"]

SOLVERS = ("auto", "dual", "factored", "lanczos", "block")
"""The ``solver`` values :class:`~laplace_glas.ActiveSubspaceLaplace` accepts."""


def lanczos_products(k: int) -> int:
    """Products ARPACK typically spends on ``k`` pairs to machine precision."""
    return 3 * max(2 * k + 1, 20) + k


def choose_solver(operator, k: int) -> str:
    """``'dual'`` or ``'lanczos'`` for ``solver='auto'``.

    Dual when the operator is factored, ``K`` fits :func:`~.gram.gram_fits` and
    building and solving it (``gram_flops + k`` columns of ``S^T`` ) costs less than
    :func:`lanczos_products` factored products.
    """
    if not isinstance(operator, FactoredGGN) or not gram_fits(operator, k):
        return "lanczos"
    M = operator.n_examples * operator.n_rows
    dual = gram_flops(operator) + 6 * M * M * max(2 * k + 1, 20) + k * operator.column_cost // 2
    primal = lanczos_products(k) * operator.column_cost
    return "dual" if dual <= primal else "lanczos"


def select_operator(
    curvlinops_operator,
    scale: float,
    solver: str,
    *,
    model: nn.Module,
    params: Sequence[torch.Tensor],
    loader: Iterable,
    likelihood: str,
    n_terms: int,
    k: int,
    loss_func: nn.Module,
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
    loss_fn: nn.Module | None = None,
    ignore_index: int = -100,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress_bar: bool = False,
) -> tuple[object, float, str, str]:
    """The operator, its scale, the solver for
    :func:`~laplace_glas.curvature.eigensolve.compute_eigenpairs` and the operator's
    description for the record.

    ``curvlinops_operator`` (with ``scale``) is returned for ``solver='lanczos'`` (the
    reference); the other solvers get the factored operator where the model qualifies
    (``'block'`` then multiplies its blocks with two GEMMs per layer instead of a pass
    over the data), else the linearised operator of ``loss_func`` on ``data`` (the
    batches curvlinops reads, with its ``num_data`` and ``batch_size_fn``; same
    ``scale``) within the budget, else ``curvlinops_operator``.
    """
    if solver == "lanczos":
        return curvlinops_operator, scale, solver, "curvlinops"
    n_params = sum(p.numel() for p in params)
    budget = default_factor_budget(k, n_params, torch.finfo(dtype).bits // 8)
    built = build_factored_ggn(
        model,
        params,
        loader,
        likelihood,
        n_terms,
        ignore_index=ignore_index,
        dict_key_x=dict_key_x,
        dict_key_y=dict_key_y,
        device=device,
        budget_bytes=budget,
        loss_fn=loss_fn,
        progress_bar=progress_bar,
    )
    if not isinstance(built, str):
        return built, 1.0, {"factored": "lanczos"}.get(solver, solver), "factored"
    linearized = build_linearized_ggn(
        model,
        loss_func,
        params,
        data,
        num_data=num_data,
        batch_size_fn=batch_size_fn,
        device=device,
        budget_bytes=budget,
        progress_bar=progress_bar,
    )
    if isinstance(linearized, str):
        operator = curvlinops_operator
        name = f"curvlinops (not factored: {built}; not linearised: {linearized})"
    else:
        operator, name = linearized, f"linearised (not factored: {built})"
    if solver in ("dual", "factored"):
        warnings.warn(
            f"solver={solver!r} needs the factored GGN, which this fit cannot use "
            f"({built}); using Lanczos on the {name.split(' (')[0]} operator.",
            UserWarning,
            stacklevel=3,
        )
    # the block solver works on any operator
    return operator, scale, "block" if solver == "block" else "lanczos", name
