"""Which operator and which eigen-solver a fit uses.

``solver`` of :class:`~laplace_glas.ActiveSubspaceLaplace`:

* ``'auto'`` (default): first the explicit-Jacobian operator
  (:mod:`~laplace_glas.curvature.operators.jacobian`: the ``N R D`` rows of
  ``Lambda^{1/2} J_n`` stored, from the factors or ``torch.func``) where they fit the budget
  and take less memory than the factors (adapters and heads over token sequences, a
  subnetwork, a small model with parameters outside supported layers); it is a factored
  operator of one dense block, so the same solvers and the same choice between them apply.
  Then the factored operator
  (:mod:`~laplace_glas.curvature.operators.factored`) where the model and loss qualify, with
  the dual Gram solve (:mod:`~laplace_glas.curvature.solvers.gram`) when :func:`choose_solver`
  finds it fits the memory budget and costs fewer flops than Lanczos on the factored
  products; otherwise Lanczos on the linearised operator
  (:mod:`~laplace_glas.curvature.operators.linearized`: kept forward graphs, no forward pass per
  product), or on curvlinops' operator when the kept graphs exceed their budget. The
  choice is recorded in ``la.lanczos_info.solver`` and ``.operator`` (with the reasons
  for a fallback).
* ``'dual'`` / ``'factored'``: the dual solve (on the Jacobian or factored operator) /
  Lanczos on the factored operator (never the Jacobian one),
  falling back (with a warning) to Lanczos on the linearised or curvlinops operator
  where the model does not qualify.
* ``'lanczos'``: curvlinops + ARPACK, the reference; ``'block'``: block Krylov on the
  factored, linearised or curvlinops operator (the first that applies).

:func:`plan_solve` makes the choice for one
:class:`~laplace_glas.curvature.problem.CurvatureProblem` and returns it as a
:class:`Plan`; laplace-torch's empirical Fisher and Hessian backends
(:mod:`~laplace_glas.curvature.backends`) get curvlinops' operators of those matrices.

The budget rule: the stored Jacobians (``N R D`` numbers, estimated before any pass by
:func:`~laplace_glas.curvature.operators.jacobian.estimate_jacobian_bytes`), the factors
(activations and ``R`` output-side gradients per weight layer), and the linearised
operator's kept graphs, may each take
``max(2 GiB, 4 k D itemsize)`` bytes, the Gram matrix ``max(768 MiB, k D itemsize)``;
beyond them the next option is used, so memory stays ``O(k D)`` plus the activations
(for the linearised operator: plus its kept graphs, as far as its count of them goes).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from laplace_glas.curvature.backends import (
    _NAMES,
    CurvatureChoice,
    _ef_loss,
)
from laplace_glas.curvature.operators.curvlinops import curvlinops_operator
from laplace_glas.curvature.operators.factored import (
    FactoredGGN,
    build_factored_ggn,
    default_factor_budget,
)
from laplace_glas.curvature.operators.jacobian import (
    JacobianGGN,
    build_jacobian_ggn,
    estimate_jacobian_bytes,
)
from laplace_glas.curvature.operators.linearized import build_linearized_ggn
from laplace_glas.curvature.problem import CurvatureProblem
from laplace_glas.curvature.solvers.gram import gram_fits, gram_flops

__all__ = ["SOLVERS", "Plan", "choose_solver", "plan_solve"]

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
        :func:`~laplace_glas.curvature.eigensolve.compute_eigenpairs`.
    operator_name : str
        Recorded as ``Eigenpairs.operator``, with the reasons for a fallback.
    n_data : int
        The number of likelihood terms the operator averages over (recorded).
    curvature : {'ggn', 'ef', 'hessian'}
        The matrix (laplace-torch's backend).
    budget_bytes : int or None
        The memory budget of the factors and of the kept graphs (None where no fast
        path was tried).
    reasons : tuple of str
        Why the factored (and the linearised) operator was not used.

    """

    operator: Any
    scale: float
    solver: str
    operator_name: str
    n_data: int
    curvature: str = "ggn"
    budget_bytes: int | None = None
    reasons: tuple[str, ...] = ()

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
        }


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


def plan_solve(
    problem: CurvatureProblem,
    k: int,
    solver: str = "auto",
    curvature: CurvatureChoice | None = None,
) -> Plan:
    """The operator and the solver for the top-``k`` eigenpairs of ``problem``.

    The GGN: curvlinops' operator (with ``problem.scale``) for ``solver='lanczos'`` (the
    reference); the other solvers get the factored operator where the model qualifies
    (``'block'`` then multiplies its blocks with two GEMMs per layer instead of a pass
    over the data), else the linearised operator of ``problem.loss_func`` on
    ``problem.data`` within the budget, else curvlinops' operator; a request for the
    factored or dual solver that cannot be met is answered with a warning.

    The empirical Fisher and the Hessian (``curvature``, from
    :func:`~laplace_glas.curvature.backends.resolve_backend`) are curvlinops'
    ``EFLinearOperator`` / ``HessianLinearOperator`` of the same loss with the same
    scale, solved by Lanczos unless ``solver='block'``.
    """
    curvature = _GGN if curvature is None else curvature
    if curvature.kind != "ggn":
        return _curvlinops_plan(problem, solver, curvature)
    reference = problem.reference_operator()
    if solver == "lanczos":
        return Plan(reference, problem.scale, solver, "curvlinops", problem.n_terms)
    itemsize = torch.finfo(problem.dtype).bits // 8
    budget = default_factor_budget(k, problem.n_params, itemsize)
    jacobian = _jacobian(problem, budget) if solver != "factored" else "solver='factored'"
    if not isinstance(jacobian, str):
        return Plan(jacobian, 1.0, solver, "jacobian", problem.n_terms, budget_bytes=budget)
    built = _factored(problem, budget)
    if not isinstance(built, str):
        solver = {"factored": "lanczos"}.get(solver, solver)
        return Plan(built, 1.0, solver, "factored", problem.n_terms, budget_bytes=budget)
    linearized = build_linearized_ggn(
        problem.model,
        problem.loss_func,
        problem.params,
        problem.data,
        num_data=problem.num_data,
        batch_size_fn=problem.batch_size_fn,
        device=problem.device,
        budget_bytes=budget,
        progress_bar=problem.progress_bar,
    )
    if isinstance(linearized, str):
        operator, reasons = reference, (built, linearized)
        name = f"curvlinops (not factored: {built}; not linearised: {linearized})"
    else:
        operator, reasons = linearized, (built,)
        name = f"linearised (not factored: {built})"
    if solver in ("dual", "factored"):
        warnings.warn(
            f"solver={solver!r} needs the factored GGN, which this fit cannot use "
            f"({built}); using Lanczos on the {name.split(' (')[0]} operator.",
            UserWarning,
            stacklevel=3,
        )
    # the block solver works on any operator
    solver = "block" if solver == "block" else "lanczos"
    return Plan(operator, problem.scale, solver, name, problem.n_terms, "ggn", budget, reasons)


def _jacobian(problem: CurvatureProblem, budget: int) -> JacobianGGN | str:
    """The GGN of ``problem`` from stored Jacobians within ``budget`` bytes, or why not.

    Tried first: no pass over the data when :func:`estimate_jacobian_bytes` (``N R D
    itemsize``) exceeds the budget; the build stops after the first batch when the
    Jacobians take more memory than the factored operator's factors would.
    """
    itemsize = torch.finfo(problem.dtype).bits // 8
    estimate = estimate_jacobian_bytes(
        problem.n_terms, problem.out_shape, problem.likelihood, problem.n_params, itemsize
    )
    if estimate > budget:
        return (
            f"explicit Jacobians ({estimate / 2**20:.0f} MiB) above the memory budget "
            f"({budget / 2**20:.0f} MiB)"
        )
    return build_jacobian_ggn(
        problem.model,
        problem.params,
        problem.loader,
        problem.likelihood,
        problem.n_terms,
        ignore_index=problem.ignore_index,
        dict_key_x=problem.dict_key_x,
        dict_key_y=problem.dict_key_y,
        device=problem.device,
        budget_bytes=budget,
        loss_fn=problem.loss_fn,
        progress_bar=problem.progress_bar,
    )


def _factored(problem: CurvatureProblem, budget: int) -> FactoredGGN | str:
    """The factored GGN of ``problem`` within ``budget`` bytes, or why not."""
    return build_factored_ggn(
        problem.model,
        problem.params,
        problem.loader,
        problem.likelihood,
        problem.n_terms,
        ignore_index=problem.ignore_index,
        dict_key_x=problem.dict_key_x,
        dict_key_y=problem.dict_key_y,
        device=problem.device,
        budget_bytes=budget,
        loss_fn=problem.loss_fn,
        progress_bar=problem.progress_bar,
    )


def _curvlinops_plan(problem: CurvatureProblem, solver: str, curvature: CurvatureChoice) -> Plan:
    """The plan of curvlinops' empirical Fisher or Hessian operator of ``problem``'s loss."""
    if solver in ("dual", "factored"):
        warnings.warn(
            f"solver={solver!r} needs the factored GGN; the {_NAMES[curvature.kind]} "
            f"({curvature.backend}) uses curvlinops + Lanczos.",
            UserWarning,
            stacklevel=3,
        )
    loss_func = problem.loss_func
    if curvature.kind == "ef":
        loss_func = _ef_loss(loss_func, len(problem.out_shape))
    operator = curvlinops_operator(
        curvature.kind,
        problem.model,
        loss_func,
        problem.params,
        problem.data,
        num_data=problem.num_data,
        batch_size_fn=problem.batch_size_fn,
    )
    name = "curvlinops EF" if curvature.kind == "ef" else "curvlinops Hessian"
    solver = "block" if solver == "block" else "lanczos"
    return Plan(operator, problem.scale, solver, name, problem.n_terms, curvature.kind)
