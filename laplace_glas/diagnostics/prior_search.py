"""The prior precisions a calibration tries: tuned by root-finding, or a grid.

Every predictive of a fitted posterior widens as the prior precision ``tau`` falls: the
variance along ``u_j`` is ``1 / (a_j + tau)`` and the complement's ``P (C + tau I)^{-1}
P``. The calibration coverage ``c(tau)`` of its central intervals (credible sets) is
then a non-increasing step function of ``tau``, and the prior precision that calibrates
the posterior to the level ``1 - alpha`` is

.. math::

    \\tau^\\star = \\max\\{\\tau : c(\\tau) \\ge 1 - \\alpha\\},

the narrowest intervals that still cover. :func:`tuned_rows` finds it for each ``k`` by a
bracketing search in ``log tau`` over :data:`TAU_RANGE`: a coarse grid, then nested grids
inside the bracket, each pass one call of the coverage table
(:func:`~laplace_glas.diagnostics.coverage.coverage_table`) for all candidates (the
linearised predictive of ``'zero'`` and ``'prior'`` pushes ``J U`` through once a pass;
the curvature-aware complements evaluate their own predictive per candidate, so their
grids are coarser). Where even ``tau = 1e-8`` stays below the level, or ``tau = 1e8``
already covers (the observation noise alone does), the row at that end is returned and
its coverage says so.

With a grid (:func:`grid_candidates`) every ``k`` is tried at each value and, where
asked, at its empirical-Bayes optimum (:func:`evidence_optimum`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from laplace_glas.diagnostics.coverage import CoverageRow
from laplace_glas.posterior.closed_forms import optimal_prior_precision
from laplace_glas.posterior.complement import optimal_complement_prior_precision
from laplace_glas.posterior.view import FittedPosterior
from laplace_glas.validation import ArgumentTypeError, scalar_value

__all__ = [
    "TAU_RANGE",
    "evidence_k",
    "evidence_optimum",
    "grid_candidates",
    "prior_precision_grid",
    "sharpest",
    "tuned_rows",
    "tuned_table",
]

TAU_RANGE = (1e-8, 1e8)
"""The prior precisions the search brackets (as laplace-torch's empirical Bayes does)."""


def _grid(low: float, high: float, n: int) -> list[float]:
    return [float(t) for t in np.exp(np.linspace(math.log(low), math.log(high), n))]


def tuned_rows(
    table: Callable[[list[tuple[int, float, bool]]], list[CoverageRow]],
    ks: Sequence[int],
    level: float,
    per_candidate: bool,
) -> list[CoverageRow]:
    """For each ``k`` of ``ks`` the :class:`CoverageRow` at ``tau* = max{tau : c(tau) >=
    level}`` (see the module; the widest row where even ``tau = 1e-8`` falls short).

    ``table`` evaluates a list of ``(k, tau, False)`` candidates on the calibration data
    (with the same draws at every call, so that ``c(tau)`` stays monotone across passes);
    ``per_candidate``: each candidate costs a predictive of its own (the
    curvature-aware complements, the sampling predictive): grids of 13 then 3 x 6 values
    instead of 65 then 2 x 24 (the last step a ratio of about 1.01 in ``tau`` either
    way).
    """
    coarse, fine, passes = (13, 6, 4) if per_candidate else (65, 24, 3)

    brackets: dict[int, tuple[float, float] | None] = {k: TAU_RANGE for k in ks}
    best: dict[int, CoverageRow] = {}
    for step in range(passes):
        if all(bracket is None for bracket in brackets.values()):
            break
        n = coarse if step == 0 else fine + 2
        # a closed k keeps one candidate (its best): the largest k stays in every pass,
        # so the shared draws keep their shape
        grids = {
            k: [best[k].prior_precision] if brackets[k] is None else _grid(*brackets[k], n)
            for k in ks
        }
        rows = table([(k, t, False) for k in ks for t in grids[k]])
        for k in ks:
            if brackets[k] is None:
                continue
            mine = [r for r in rows if r.k == k]  # in the grid's order: tau rising
            covering = [i for i, r in enumerate(mine) if r.coverage >= level]
            if not covering:  # the widest falls short (first pass): the widest row
                best.setdefault(k, mine[0])
                brackets[k] = None
                continue
            last = max(covering)
            best[k] = mine[last]
            inside = last < len(mine) - 1
            brackets[k] = (grids[k][last], grids[k][last + 1]) if inside else None
    return [best[k] for k in ks]


def evidence_k(posterior: Any, ks: Sequence[int], square_norm: float) -> tuple[int, float]:
    """``(k, tau)``: the ``k`` of ``ks`` with the largest evidence.

    For a posterior with a curvature-aware complement, at each ``k``'s empirical-Bayes
    ``tau`` (over all ``D`` directions; the likelihood at the MAP is the same for every
    ``k``):

    .. math::

        k^\\star = \\arg\\max_k\\; -\\tfrac12\\big(\\log\\det\\Sigma_k^{-1} - D\\log\\tau_k
        + \\tau_k \\|\\theta^* - \\mu_0\\|^2\\big).
    """
    best: tuple[float, int, float] | None = None
    for k in ks:
        tau = evidence_optimum(posterior, posterior.curvature, k, square_norm)
        occam = float(posterior.posterior_in_use(k, tau).log_det_ratio)
        evidence = -0.5 * (occam + tau * square_norm)
        if best is None or evidence > best[0]:
            best = (evidence, k, tau)
    assert best is not None
    return best[1], best[2]


def sharpest(rows: Sequence[CoverageRow], tolerance: float = 0.01) -> CoverageRow:
    """Among calibrated rows, the smallest ``k`` whose mean width (set size) is within
    ``tolerance`` (relative) of the narrowest.
    """
    narrowest = min(r.mean_width for r in rows)
    close = [r for r in rows if r.mean_width <= narrowest * (1 + tolerance)]
    return min(close, key=lambda r: (r.k, r.mean_width))


def tuned_table(
    table: Callable[[list[tuple[int, float, bool]]], list[CoverageRow]],
    posterior: Any,
    ks: Sequence[int],
    level: float,
    square_norm: float,
    per_candidate: bool = False,
) -> tuple[list[CoverageRow], str, CoverageRow | None]:
    """The rows :func:`~laplace_glas.diagnostics.calibration.select_dimension` chooses
    from when it tunes the prior precision, and the rule that chooses ``k``: every ``k``
    at its own ``tau*`` ('zero', 'prior'); for a curvature-aware complement ``tau*`` at
    the evidence's ``k`` (:func:`evidence_k`) and every ``k`` at that ``tau*``; the
    third element is the evidence's row (None for 'zero' and 'prior': the caller chooses
    by :func:`sharpest`).
    """
    if posterior.complement_curvature is None:
        rows = tuned_rows(table, ks, level, per_candidate)
        rule = (
            "the narrowest calibrated intervals (each k at the largest prior precision "
            "whose coverage reaches the level; the smallest k within 1% of the narrowest)"
        )
        return rows, rule, None
    k, _ = evidence_k(posterior, ks, square_norm)
    (row,) = tuned_rows(table, [k], level, per_candidate=True)
    others = [j for j in ks if j != k]
    rows = table([(j, row.prior_precision, False) for j in others]) if others else []
    coverages = [r.coverage for r in [row, *rows]]
    rule = (
        f"the evidence (complement={posterior.complement!r} carries curvature in every "
        f"direction, so k barely moves coverage: {min(coverages):.3f}-{max(coverages):.3f} "
        f"across k = {ks[0]}..{ks[-1]} at the tuned prior precision)"
    )
    return sorted([row, *rows], key=lambda r: r.k), rule, row


def prior_precision_grid(prior_precisions: Any) -> list[float]:
    """``prior_precisions`` as a list of floats: a sequence of real numbers or a 1-d
    tensor; an ``ArgumentTypeError`` naming the entry otherwise.
    """
    if isinstance(prior_precisions, torch.Tensor) and prior_precisions.dim() > 1:
        raise ArgumentTypeError(
            "prior_precisions must be a sequence of positive numbers or a 1-d tensor, got "
            f"a tensor of shape {tuple(prior_precisions.shape)}."
        )
    if isinstance(prior_precisions, torch.Tensor):
        prior_precisions = list(prior_precisions.reshape(-1))
    if isinstance(prior_precisions, (str, bytes)) or not isinstance(prior_precisions, Iterable):
        raise ArgumentTypeError(
            "prior_precisions must be a sequence of positive numbers or a 1-d tensor, got "
            f"{type(prior_precisions).__name__} ({prior_precisions!r})."
        )
    return [scalar_value(f"prior_precisions[{i}]", t) for i, t in enumerate(prior_precisions)]


def grid_candidates(
    la: Any, ks: Sequence[int], prior_precisions: Iterable[float] | None, empirical_bayes: bool
) -> list[tuple[int, float, bool]]:
    """The grid candidates ``(k, tau, is_empirical_bayes)``: each ``k`` of ``ks`` with
    every value of ``prior_precisions`` (default: the posterior's own prior) and, with
    ``empirical_bayes``, its evidence optimum (:func:`evidence_optimum`).
    """
    # every candidate k, also those above the posterior's current n_components
    posterior = la.posterior
    curvature = posterior.curvature[: max(ks)].detach()
    square_norm = float((la.mean - la.prior_mean).detach().square().sum())
    if prior_precisions is not None:
        grid = prior_precision_grid(prior_precisions)
    else:  # the posterior's own prior: tau, or None for a layerwise / diagonal one
        grid = [posterior.tau]
    if any(t is not None and not (t > 0 and math.isfinite(t)) for t in grid):
        raise ValueError("Prior precisions must be positive and finite.")
    if not grid and not empirical_bayes:
        raise ValueError(
            "prior_precisions is empty and empirical_bayes=False: there is no prior "
            "precision to try."
        )
    pairs = []
    for k in ks:
        taus = {t: False for t in grid}
        if empirical_bayes:
            try:
                taus[evidence_optimum(posterior, curvature, k, square_norm)] = True
            except ValueError:
                pass
        pairs.extend((k, t, eb) for t, eb in taus.items())
    if not pairs:
        raise ValueError(
            "prior_precisions is empty and no k has an empirical-Bayes optimum (the "
            "evidence has no finite optimum in the prior precision, e.g. a prior mean at "
            "the fitted weights): pass prior precisions to try, or leave "
            "prior_precisions=None to tune it on the calibration data."
        )
    return pairs


def evidence_optimum(
    posterior: FittedPosterior, curvature: torch.Tensor, k: int, square_norm: float
) -> float:
    """The evidence-maximising ``tau`` at ``k``: over the subspace, or over every
    direction for a curvature-aware complement (its evidence counts the complement
    too).
    """
    if posterior.complement_curvature is not None:
        return optimal_complement_prior_precision(
            posterior.eigenvectors[:, :k],
            curvature[:k],
            posterior.complement_curvature,
            square_norm,
        )
    return optimal_prior_precision(curvature[:k], square_norm)
