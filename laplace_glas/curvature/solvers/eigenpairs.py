"""The record of an eigen-solve and the warnings a solve can raise.

:class:`Eigenpairs` holds the top-``k`` eigenpairs of a symmetric PSD operator with
their residuals and cost; in a fitted ``ActiveSubspaceLaplace`` (``la.lanczos_info``) the
operator is the unit-noise mean-loss GGN

.. math::

    G_1 = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

and the record also says which operator and solver the fit's plan chose
(:func:`~laplace_glas.curvature.memory.planner.plan_solve`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "ZERO_GGN",
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "NumericalRankWarning",
]


class LanczosConvergenceWarning(UserWarning):
    """The eigen-solve stopped before all requested eigenpairs converged, or its final
    residuals exceed the tolerance (e.g. a loader whose data changes between passes).
    """


ZERO_GGN = (
    "The GGN is zero at these weights: the model's outputs do not depend on the "
    "parameters under inference (or all their gradients vanish, e.g. saturated or dead "
    "units). There is no curvature to build a posterior from."
)


class NumericalRankWarning(UserWarning):
    """Some eigenvalues are below what the operator's precision can resolve."""


@dataclass(frozen=True)
class Eigenpairs:
    """Immutable record of an eigen-solve of a symmetric PSD operator.

    In a fitted ``ActiveSubspaceLaplace`` (``la.lanczos_info``) the operator is the
    unit-noise GGN ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n`` (``Lambda = I`` for
    regression); ``la.eigenvalues`` is ``values / sigma^2``.

    Attributes
    ----------
    values : torch.Tensor
        ``(k,)`` eigenvalues, descending. Values below ``rank_threshold`` are set to
        zero (they are round-off, not curvature); see ``below_threshold``.
    vectors : torch.Tensor
        ``(D, k)`` orthonormal eigenvectors, column ``j`` belongs to ``values[j]``.
    residuals : torch.Tensor
        ``(k,)`` relative residuals ``||G u_j - lambda_j u_j|| / lambda_j`` of the raw
        Ritz pairs (``inf`` where ``lambda_j`` is zero). Lanczos takes ``G U`` from one
        fresh product with ``k`` columns, or, on the factored and Jacobian operators
        (whose products are fixed functions of stored factors), recombines it from the
        solve's recorded products (:mod:`~laplace_glas.curvature.solvers.lanczos`).
    below_threshold : torch.Tensor
        ``(k,)`` bool mask of the eigenpairs whose raw eigenvalue fell below
        ``rank_threshold * lambda_1``.
    raw_values : torch.Tensor
        ``(k,)`` the Ritz values as returned by the solver (descending).
    n_products : int
        Operator-vector products spent (a matrix product with m columns counts m),
        including the ``k`` products of a fresh residual check (none where its images
        were recombined from the recorded products).
    n_requested : int
        The number of eigenpairs asked for.
    n_converged : int
        The number of eigenpairs the solver reported as converged.
    wall_time : float
        Seconds spent in the solve and the residual check.
    n_data : int
        Number of data points the operator averaged over.
    rank_threshold : float
        Relative threshold used for ``below_threshold``.
    solver : str
        Name of the solver (``'lanczos'``, ``'block'`` or ``'dual'``, the Gram solve).
    n_passes : int
        Operator calls, i.e. passes over the data (a ``matmat`` with many columns is
        one pass), including a fresh residual check. The factored operator needs one
        data pass in all, to build its factors; its calls are counted all the same.
    operator : str
        The operator the solver multiplied with, as the planner names it:
        ``'curvlinops'`` (the reference), ``'jacobian'``, ``'factored'``,
        ``'linearised (not factored: why)'``, or for a budgeted fit that streams
        ``'factored, rebuilt per batch ...'``, ``'linearised, rebuilt per batch ...'``
        or ``'curvlinops (not factored: why; not linearised: why)'``, ending with
        ``'(batches in slices of c)'`` where the batches were cut.
    plan : dict or None
        The plan of a fit's solve (:meth:`~laplace_glas.curvature.memory.planner.Plan.summary`
        with the solver that ran): the curvature, the operator, the solver, the scale,
        ``n_data``, the memory budget ``budget_bytes`` (``-1``: none), the reasons for a
        fallback, the ``strategy``, its ``estimated_peak_bytes``, every strategy's
        ``estimates`` tried and the fit's ``measured_peak_bytes`` with its
        ``peak_method`` (:mod:`~laplace_glas.curvature.memory.budget`; ``-1``: unknown);
        with ``complement='kron'``, ``kron_factors``: where KFAC's factors came from
        (:mod:`~laplace_glas.curvature.complement.passes`).
        ``None`` for a solve called on an operator directly; records saved before
        budgets lack the memory entries (the properties below read them as None).

    """

    values: torch.Tensor
    vectors: torch.Tensor
    residuals: torch.Tensor
    below_threshold: torch.Tensor
    raw_values: torch.Tensor
    n_products: int
    n_requested: int
    n_converged: int
    wall_time: float
    n_data: int
    rank_threshold: float
    solver: str = "lanczos"
    n_passes: int = 0
    operator: str = "curvlinops"
    plan: dict[str, Any] | None = None

    def _plan_bytes(self, key: str) -> int | None:
        value = (self.plan or {}).get(key, -1)
        return None if value is None or int(value) < 0 else int(value)

    @property
    def memory_budget(self) -> int | None:
        """The fit's memory budget in bytes (None: not recorded)."""
        return self._plan_bytes("budget_bytes")

    @property
    def strategy(self) -> str | None:
        """The planner's strategy: ``'jacobian'``, ``'dual'``, ``'factored'``,
        ``'linearised'`` or ``'streaming'`` (None: not recorded).
        """
        return (self.plan or {}).get("strategy") or None

    @property
    def estimated_peak_bytes(self) -> int | None:
        """The chosen strategy's estimated peak in bytes (None: not recorded).

        For the factored operator it includes the temporaries the budget leaves its
        products: a dual solve's chunk of ``k`` columns, or the record of products
        Lanczos keeps for its residual check (up to 256 MiB in float32, a bound: the
        record holds two ``D``-vectors per product); ``estimates`` holds the
        strategies' estimates without them.
        """
        return self._plan_bytes("estimated_peak_bytes")

    @property
    def measured_peak_bytes(self) -> int | None:
        """The fit's measured peak above its start in bytes (None: not recorded, or not
        measurable here; the plan then holds ``-1``). On the host it counts the resident
        pages the process adds (``VmHWM`` above the start's ``VmRSS``), so a fit that
        reuses heap an earlier fit left resident may read 0 or little.
        """
        return self._plan_bytes("measured_peak_bytes")

    @property
    def k(self) -> int:
        """Number of eigenpairs held."""
        return int(self.values.numel())

    def __repr__(self) -> str:
        """One line: sizes, eigenvalue range and cost, no tensor contents.

        ``max residual`` is the largest relative residual among the pairs above the
        rank threshold.
        """
        if self.k == 0:
            spectrum = "no eigenvalues"
        else:
            spectrum = (
                f"eigenvalues [{float(self.values.min()):.4g}, {float(self.values.max()):.4g}]"
            )
        # pairs below the rank threshold are round-off (their residual relative to a
        # near-zero lambda_j is huge by construction), so the maximum leaves them out
        kept = self.residuals[~self.below_threshold.to(self.residuals.device)]
        finite = kept[torch.isfinite(kept)]
        residual = f"{float(finite.max()):.2g}" if finite.numel() else "n/a"
        return (
            f"Eigenpairs(k={self.k}, D={self.vectors.shape[0]}, dtype={self.vectors.dtype}, "
            f"solver={self.solver!r}, {spectrum}, {int(self.below_threshold.sum())} below "
            f"threshold, {self.n_products} products, {self.n_passes} passes, "
            f"max residual {residual}, {self.wall_time:.3g} s)"
        )

    def truncate(self, k: int) -> Eigenpairs:
        """The leading ``k`` eigenpairs, without recomputing anything."""
        if not 1 <= k <= self.k:
            raise ValueError(f"Cannot truncate {self.k} eigenpairs to k={k}.")
        return replace(
            self,
            values=self.values[:k],
            vectors=self.vectors[:, :k],
            residuals=self.residuals[:k],
            below_threshold=self.below_threshold[:k],
            raw_values=self.raw_values[:k],
        )

    def to(self, device: torch.device | str | None = None, dtype=None) -> Eigenpairs:
        """Move the tensors (mask excluded from the dtype change)."""
        return replace(
            self,
            values=self.values.to(device=device, dtype=dtype),
            vectors=self.vectors.to(device=device, dtype=dtype),
            residuals=self.residuals.to(device=device, dtype=dtype),
            raw_values=self.raw_values.to(device=device, dtype=dtype),
            below_threshold=self.below_threshold.to(device=device),
        )

    def to_dict(self) -> dict:
        """Plain-dict form (tensors and Python scalars only; safe for
        ``torch.load(weights_only=True)``).
        """
        return {
            "values": self.values,
            "vectors": self.vectors,
            "residuals": self.residuals,
            "below_threshold": self.below_threshold,
            "raw_values": self.raw_values,
            "n_products": int(self.n_products),
            "n_requested": int(self.n_requested),
            "n_converged": int(self.n_converged),
            "wall_time": float(self.wall_time),
            "n_data": int(self.n_data),
            "rank_threshold": float(self.rank_threshold),
            "solver": str(self.solver),
            "n_passes": int(self.n_passes),
            "operator": str(self.operator),
            "plan": () if self.plan is None else tuple(self.plan.items()),
        }

    @classmethod
    def from_dict(cls, state: dict) -> Eigenpairs:
        """Inverse of :meth:`to_dict` (also of a record without ``plan``)."""
        state = dict(state)
        plan = state.pop("plan", ())
        return cls(**state, plan=dict(plan) if plan else None)
