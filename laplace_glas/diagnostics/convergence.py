"""Lanczos diagnostics: residuals of the eigenpairs and a replica check.

* :func:`residual_report` lists, for every computed eigenpair, its eigenvalue, the
  relative residual ``||G u - lambda u|| / lambda``, whether it fell below the
  numerical-rank threshold, and the GGN products and time spent.
* :func:`replica_check` recomputes the eigenpairs from other random start vectors
  (and, optionally, other data subsamples) and compares them with the fitted ones
  through ``|U_fit^T U_r|``. For well-separated eigenvalues each fitted vector has a
  partner with overlap near 1 in every replica; a vector without one (below
  ``threshold``) is flagged as unconverged or ill-determined (nearly degenerate
  eigenvalues, or a direction that depends on the data subsample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from laplace_glas.posterior.view import fitted_posterior
from laplace_glas.validation import finite_number, positive_int

__all__ = ["ReplicaCheck", "ResidualReport", "replica_check", "residual_report"]


@dataclass(frozen=True)
class ResidualReport:
    """Per-eigenpair convergence figures of a fit."""

    eigenvalues: torch.Tensor
    residuals: torch.Tensor
    below_threshold: torch.Tensor
    n_products: int
    wall_time: float
    n_requested: int
    n_converged: int
    solver: str = "lanczos"

    def __str__(self) -> str:
        lines = [
            f"{self.solver}: {self.n_converged}/{self.n_requested} eigenpairs converged, "
            f"{self.n_products} GGN products, {self.wall_time:.2f} s",
            f"{'j':>4} {'lambda_j':>12} {'rel. residual':>14}",
        ]
        for j, (lam, res, low) in enumerate(
            zip(self.eigenvalues.tolist(), self.residuals.tolist(), self.below_threshold.tolist())
        ):
            flag = "  below numerical rank" if low else ""
            lines.append(f"{j + 1:>4} {lam:>12.5g} {res:>14.3e}{flag}")
        return "\n".join(lines)


def residual_report(la: Any) -> ResidualReport:
    """Residuals, products and time of the fitted eigen-solve (eigenvalues of the
    mean-loss GGN, including the noise precision for regression).
    """
    posterior = fitted_posterior(la, "residual_report")
    info = posterior.eigen_solve
    return ResidualReport(
        eigenvalues=posterior.ggn_eigenvalues.detach().cpu(),
        residuals=info.residuals.detach().cpu(),
        below_threshold=info.below_threshold.detach().cpu(),
        n_products=info.n_products,
        wall_time=info.wall_time,
        n_requested=info.n_requested,
        n_converged=info.n_converged,
        solver=info.solver,
    )


@dataclass
class ReplicaCheck:
    """Outcome of :func:`replica_check`.

    Attributes
    ----------
    overlaps : list of torch.Tensor
        One ``(k, k_r)`` matrix ``|U_fit^T U_r|`` per replica.
    best_overlap : torch.Tensor
        ``(k,)`` for every fitted vector, its worst (over replicas) best partner
        overlap ``min_r max_i |u_j^T u_i^{(r)}|``.
    flagged : list of int
        Indices (0-based) of fitted vectors with ``best_overlap < threshold``.
    threshold : float
    replica_eigenvalues : list of torch.Tensor
        The replicas' (unit-noise) eigenvalues, for comparison.
    subsample : int or None
        Subsample size used by the replicas.

    """

    overlaps: list[torch.Tensor]
    best_overlap: torch.Tensor
    flagged: list[int]
    threshold: float
    replica_eigenvalues: list[torch.Tensor] = field(default_factory=list)
    subsample: int | None = None

    @property
    def passed(self) -> bool:
        """True when every fitted eigenvector has a partner in every replica."""
        return not self.flagged

    def subspace_overlap(self, m: int | None = None) -> torch.Tensor:
        """Share of the leading ``m`` fitted eigenvectors' span inside each replica's
        subspace: ``||U_{:, :m}^T U_r||_F^2 / m`` in ``[0, 1]``, one value per replica.

        Unlike the per-vector overlaps this does not care how the replica splits a
        cluster of near-equal eigenvalues among its vectors (``m = k`` by default).
        """
        k = self.best_overlap.numel()
        m = k if m is None else m
        if not 1 <= m <= k:
            raise ValueError(f"m must lie in [1, {k}], got {m}.")
        return torch.stack([(o[:m] ** 2).sum() / m for o in self.overlaps])

    def __str__(self) -> str:
        n = len(self.overlaps)
        where = f"subsamples of {self.subsample} points" if self.subsample else "the full data"
        head = (
            f"Replica check: {n} replica(s) from new random starts on {where}; "
            f"threshold {self.threshold:.2f}: "
            + ("all eigenvectors matched." if self.passed else f"{len(self.flagged)} flagged.")
        )
        lines = [head, f"{'j':>4} {'min_r max_i |u_j.u_i|':>22} {'span of u_1..u_j kept':>22}"]
        for j, value in enumerate(self.best_overlap.tolist()):
            mark = "  FLAGGED" if j in self.flagged else ""
            kept = float(self.subspace_overlap(j + 1).min())
            lines.append(f"{j + 1:>4} {value:>22.4f} {kept:>22.4f}{mark}")
        lines.append(
            "(last column: min over replicas of ||U_{:, :j}^T U_r||_F^2 / j, the share of "
            "the leading j-dimensional subspace that the replica's subspace contains)"
        )
        return "\n".join(lines)


def replica_check(
    la: Any,
    train_loader: Any,
    n_replicas: int = 3,
    subsample: int | None = None,
    threshold: float = 0.9,
    seed: int | None = None,
) -> ReplicaCheck:
    """Recompute the eigenpairs ``n_replicas`` times and match them with the fit.

    Parameters
    ----------
    la : ActiveSubspaceLaplace
        Fitted posterior (its Lanczos settings are reused).
    train_loader : DataLoader
        The training data (as given to ``fit``).
    n_replicas : int, default=3
        Number of recomputations, each from a new random start vector.
    subsample : int, optional
        Each replica uses its own random subsample of this many points.
    threshold : float, default=0.9
        A fitted vector needs a partner with ``|u_j^T u_i| >= threshold`` in every
        replica.
    seed : int, optional
        Seed of replica ``r`` is ``seed + r`` (default: one above the fit's seed,
        ``la.seed`` or its ``generator``'s initial seed, so that no replica repeats the
        fit's own start vector and subsample). A range containing the fit's seed is
        refused.

    """
    posterior = fitted_posterior(la, "replica_check")
    n_replicas = positive_int("n_replicas", n_replicas, allow_none=False)
    threshold = finite_number("threshold", threshold)
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__} ({seed!r}).")
    fit_generator = getattr(la, "generator", None)
    fit_seed = getattr(la, "seed", 0) if fit_generator is None else fit_generator.initial_seed()
    if seed is None:
        seed = fit_seed + 1
    if seed <= fit_seed < seed + n_replicas:
        raise ValueError(
            f"Replica seeds {seed}..{seed + n_replicas - 1} include the fit's seed {fit_seed}: "
            "that replica would repeat the fit exactly. Pass another seed."
        )
    U_fit = posterior.eigen_solve.vectors
    k = U_fit.shape[1]
    overlaps, eigenvalues = [], []
    for r in range(n_replicas):
        generator = torch.Generator().manual_seed(seed + r)
        replica = la.compute_eigenpairs(
            train_loader, n_components=k, generator=generator, subsample_size=subsample
        )
        overlaps.append((U_fit.T @ replica.vectors).abs().cpu())
        eigenvalues.append(replica.values.cpu())
    best = torch.stack([o.max(dim=1).values for o in overlaps]).min(dim=0).values
    flagged = [j for j, value in enumerate(best.tolist()) if value < threshold]
    return ReplicaCheck(overlaps, best, flagged, threshold, eigenvalues, subsample)
