"""Choosing the subspace dimension k and the prior precision by empirical coverage.

For every candidate ``(k, tau)`` the predictive distribution of a fitted GLAS posterior
truncated to its leading ``k`` eigenpairs is evaluated on held-out calibration data:

* regression: central ``1 - alpha`` intervals of ``f(x)`` (of ``y = f(x) + noise``
  with ``include_noise=True``); coverage is the fraction of targets inside;
* classification: the smallest set of classes whose predictive mass reaches
  ``1 - alpha``; coverage is the fraction of points whose label is in their set.

By default (``prior_precisions=None``) the prior precision is tuned over a continuous
range: for each ``k`` the largest ``tau`` whose calibration coverage reaches the level
(:func:`~laplace_glas.diagnostics.prior_search.tuned_rows`, a bracketing search in
``log tau``), so every ``k`` is calibrated and ``k`` is then chosen by sharpness: the
narrowest calibrated intervals (smallest sets), the smallest ``k`` within 1% of them.
A curvature-aware complement (``'diag'``, ``'kron'``, ``'kron_diag'``) carries curvature
in every direction, so ``k`` barely moves its coverage: its ``k`` is the one whose
evidence (at its empirical-Bayes ``tau``, over all ``D`` directions) is largest, ``tau``
is tuned at that ``k``, and the table holds every ``k`` at that ``tau`` to show the
effect (``DimensionSelection.k_rule`` says which rule chose).

With a grid (``prior_precisions=[...]``) the selection is the smallest ``k`` whose
coverage reaches the nominal level, the prior precision chosen jointly among the
candidates (the empirical-Bayes optimum at that ``k``, the posterior's current value
and the grid), ties broken by the narrowest interval (smallest set). The sweep is
vectorised over ``k``: the linearised predictive computes ``J U`` once for all ``k`` and
accumulates the variance along the eigen-directions; the sampling predictive draws one
set of ``z`` and truncates it.

A posterior with a layerwise or diagonal prior precision is swept at that prior (the
candidate ``prior_precision=None`` in the table), through the posterior's own
predictive truncated to each ``k`` (``z`` is correlated there: no shared draw); scalar
grid values and the scalar empirical-Bayes optimum remain candidates beside it.

A subnetwork posterior (scalar prior) is swept through its hooks: the directions
embedded in the network's weights, the network's MAP weights as the point of
linearisation, the subnetwork's Jacobian Gram for ``complement='prior'`` and
complement draws put on the subnetwork's weights.

Regression scores like with like: by default (``include_noise=True``) intervals of
``y = f(x) + noise`` against the observed targets. Intervals of ``f`` alone
(``include_noise=False``) are to be scored against values of ``f`` (a known function),
not against noisy observations: they cannot cover the noise.

After a data-parallel fit (:mod:`laplace_glas.curvature.parallel.distributed`) each rank passes
its shard of the calibration data; coverage, width and NLL of every candidate are
combined as means weighted by the shards' numbers of scored targets (one all-reduce),
so every rank selects the same ``(k, tau)``.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from laplace_glas.curvature.data.batches import batch_size as batch_rows
from laplace_glas.curvature.data.batches import check_input_dtype, concatenate_inputs, split_batch
from laplace_glas.curvature.parallel.collectives import reduce_coverage_rows
from laplace_glas.curvature.parallel.distributed import data_parallel
from laplace_glas.diagnostics.coverage import CoverageRow, check_sweep_arguments, coverage_table
from laplace_glas.diagnostics.prior_search import grid_candidates, sharpest, tuned_table
from laplace_glas.posterior.view import fitted_posterior
from laplace_glas.validation import flag

__all__ = [
    "CoverageNotReachedWarning",
    "CoverageRow",
    "DimensionSelection",
    "coverage",
    "coverage_table",
    "interval_width",
    "select_dimension",
]


class CoverageNotReachedWarning(UserWarning):
    """No candidate (k, prior precision) reached the nominal coverage."""


@dataclass
class DimensionSelection:
    """Outcome of :func:`select_dimension`.

    Attributes
    ----------
    k : int
        Selected number of eigen-directions.
    prior_precision : float or None
        Selected prior precision (None: the posterior's own layerwise or diagonal
        prior precision).
    reached : bool
        Whether the selection reaches the nominal coverage. If False, ``k`` and
        ``prior_precision`` are those of the best coverage achieved.
    coverage : float
        Calibration coverage of the selection.
    level : float
        Nominal coverage ``1 - alpha``.
    rows : list of CoverageRow
        The whole table over the candidates.

    """

    k: int
    prior_precision: float | None
    reached: bool
    coverage: float
    level: float
    rows: list[CoverageRow] = field(default_factory=list)
    loss_scaling: str = "mean"
    pred_type: str = "glm"
    include_noise: bool = False
    likelihood: str = "regression"
    numerical_rank: int | None = None
    k_rule: str = "smallest k reaching the level among the candidates"

    @property
    def beyond_rank(self) -> bool:
        """Whether the selected k exceeds the numerical rank of the computed GGN."""
        return self.numerical_rank is not None and self.k > self.numerical_rank

    def best_per_k(self) -> list[CoverageRow]:
        """For each k, the row the selection rule prefers (coverage curve vs k)."""
        out = []
        for k in sorted({r.k for r in self.rows}):
            out.append(_preferred([r for r in self.rows if r.k == k], self.level))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form."""
        data = asdict(self)
        data["rows"] = [asdict(r) for r in self.rows]
        return data

    def __str__(self) -> str:
        unit = "set size" if self.likelihood == "classification" else "width"
        status = "reached" if self.reached else "NOT reached"
        lines = [
            f"GLAS dimension selection ({self.loss_scaling} scaling, pred_type="
            f"'{self.pred_type}', noise {'added' if self.include_noise else 'not added'}): "
            f"nominal {self.level:.0%} {status}; k = {self.k}, prior precision = "
            f"{_prior_label(self.prior_precision)}, coverage = {self.coverage:.3f}",
            f"k chosen by: {self.k_rule}",
            f"{'k':>4} {'prior prec':>11} {'coverage':>9} {unit:>9} {'NLL':>9}",
        ]
        for r in self.rows:
            mark = " <" if (r.k, r.prior_precision) == (self.k, self.prior_precision) else ""
            eb = " (EB)" if r.empirical_bayes else ""
            star = "*" if self.numerical_rank is not None and r.k > self.numerical_rank else " "
            lines.append(
                f"{r.k:>4}{star}{_prior_label(r.prior_precision):>11} {r.coverage:>9.3f} "
                f"{r.mean_width:>9.4g} {r.nll:>9.4g}{eb}{mark}"
            )
        if self.numerical_rank is not None and any(r.k > self.numerical_rank for r in self.rows):
            lines.append(
                f"* k beyond the numerical rank ({self.numerical_rank}): those directions "
                "carry the prior's variance, not resolved curvature."
            )
        return "\n".join(lines)


def _prior_label(prior_precision: float | None) -> str:
    return "own" if prior_precision is None else f"{prior_precision:.4g}"


def _preferred(rows: Sequence[CoverageRow], level: float) -> CoverageRow:
    reaching = [r for r in rows if r.coverage >= level]
    if reaching:
        return min(reaching, key=lambda r: (r.mean_width, r.k))
    return max(rows, key=lambda r: (r.coverage, -r.k, -r.mean_width))


def _gather(la: Any, loader: Iterable) -> tuple[torch.Tensor, torch.Tensor, int]:
    """All of ``loader`` as one ``(X, y)`` on the posterior's device, and the largest
    batch size seen (the calibration pushes the data through in batches of that size).
    Warns (``FittedWeightsChangedWarning``) when the model's weights moved after fit.
    """
    posterior = fitted_posterior(la, "calibration")
    posterior.check_fitted_weights()
    Xs, ys = [], []
    for data in loader:
        X, y = split_batch(data, la.dict_key_y)
        if not isinstance(X, (torch.Tensor, MutableMapping)):
            raise TypeError(
                "Calibration needs (X, y) batches with tensor inputs or mapping batches "
                f"(e.g. input_ids, attention_mask, labels), got inputs of type {type(X).__name__}."
            )
        check_input_dtype("The calibration inputs", X, posterior.dtype, len(Xs))
        Xs.append(X)
        ys.append(y)
    if not Xs:
        raise ValueError("The calibration loader is empty.")
    pad_value = None
    if la.likelihood == "classification" and len({y.shape[1:] for y in ys}) > 1:
        # sequence batches of different lengths: right-pad inputs with 0 and targets
        # with ignore_index (padding after a sequence does not change a causal model's
        # earlier outputs, and padded targets are not scored)
        length = max(y.shape[1] for y in ys)
        pad = getattr(la, "ignore_index", -100)
        ys = [_pad_time_axis(y, length, pad) for y in ys]
        pad_value = 0  # inputs too (mappings: attention_mask 0 there)
    X = concatenate_inputs(Xs, la.dict_key_y, pad_value)
    device = posterior.device
    X = {k: v.to(device) for k, v in X.items()} if isinstance(X, dict) else X.to(device)
    y = torch.cat(ys).to(device)
    for value in X.values() if isinstance(X, dict) else [X]:
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError("The calibration inputs contain NaN or inf.")
    if y.is_floating_point() and not torch.isfinite(y).all():
        raise ValueError("The calibration targets contain NaN or inf.")
    return X, y, max(batch_rows(X_batch, la.dict_key_x) for X_batch in Xs)


def _pad_time_axis(t: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """Right-pad axis 1 of ``(batch, seq_len, ...)`` to ``length``."""
    padding = [0, 0] * (t.ndim - 2) + [0, length - t.shape[1]]
    return torch.nn.functional.pad(t, padding, value=value)


def _validate_ks(la: Any, ks: Sequence[int] | None) -> list[int]:
    available = fitted_posterior(la, "calibration").n_computed
    if ks is not None and (
        isinstance(ks, str)
        or not isinstance(ks, Iterable)
        or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in ks)
    ):
        raise TypeError(f"ks must be a sequence of ints, got {ks!r}.")
    ks = list(range(1, la.n_components + 1)) if ks is None else sorted({int(k) for k in ks})
    if not ks or ks[0] < 1 or ks[-1] > available:
        raise ValueError(
            f"ks must lie in [1, {available}] (the eigenpairs computed by fit); got {ks}. "
            "Refit with a larger n_components to sweep further."
        )
    return ks


def select_dimension(
    la: Any,
    calib_loader: Iterable,
    coverage: float = 0.9,
    ks: Sequence[int] | None = None,
    prior_precisions: Iterable[float] | None = None,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = True,
    empirical_bayes: bool = True,
) -> DimensionSelection:
    """``k`` and the prior precision whose predictive covers ``coverage`` of the
    calibration targets (see the module for the rules).

    Parameters
    ----------
    la : ActiveSubspaceLaplace
        A fitted GLAS posterior; its eigenpairs are truncated, never recomputed.
    calib_loader : iterable of (X, y)
        Held-out calibration data (not used in training).
    coverage : float, default=0.9
        Nominal level ``1 - alpha``.
    ks : sequence of int, optional
        Candidate dimensions (default ``1..n_components``).
    prior_precisions : iterable of float, optional
        Grid of prior precisions. Default: tuned over ``[1e-8, 1e8]`` for each ``k`` (the
        largest whose coverage reaches the level). With a grid, the empirical-Bayes
        optimum at each ``k`` is added when ``empirical_bayes``.
    pred_type : {'glm', 'nn'}, default='glm'
        Linearised or sampling predictive (the default agrees with ``coverage``,
        ``interval_width`` and the posterior's ``__call__``). 'glm' pushes ``J U``
        through once for all candidates (regression: closed form, no sampling);
        'nn' evaluates the network at shared samples once per ``(k, tau)``.
    n_samples : int, default=200
        Samples for 'nn' (and for 'glm' in classification).
    generator : torch.Generator, optional
        Controls the samples.
    include_noise : bool, default=True
        Regression only: intervals of ``y`` (with the observation noise), scored against
        the observed targets; False: intervals of ``f``, for targets that are values of
        ``f``.
    empirical_bayes : bool, default=True
        With a grid: add each ``k``'s evidence-maximising prior precision to the
        candidates.

    Returns
    -------
    DimensionSelection
        ``reached=False`` (with a :class:`CoverageNotReachedWarning`) when no
        candidate reaches the level; the best coverage achieved is then selected.

    """
    fitted_posterior(la, "select_dimension")
    if la.likelihood not in ("regression", "classification"):
        raise ValueError(
            f"calibrate / select_dimension need regression or classification targets; "
            f"likelihood={la.likelihood!r} has none to cover (reward models are trained "
            "on preference labels, not on targets of the predicted rewards)."
        )
    coverage, n_samples = check_sweep_arguments(
        coverage, pred_type, n_samples, include_noise, "coverage"
    )
    flag("empirical_bayes", empirical_bayes)
    ks = _validate_ks(la, ks)
    tuning = prior_precisions is None and la.posterior.scalar_prior
    k_rule = "smallest k reaching the level among the candidates"
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}.")
    if tuning:
        if generator is None:  # one stream for every pass, drawn from torch's global one
            generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        state, args = generator.get_state(), (coverage, pred_type, n_samples, generator)

        def table(pairs: list) -> list[CoverageRow]:
            generator.set_state(state)  # the same draws at every call
            return _all_ranks(la, calib_loader, pairs, *args, include_noise)

        square_norm = float((la.mean - la.prior_mean).detach().square().sum())
        per_candidate = pred_type == "nn"  # a network evaluation per sample and candidate
        rows, k_rule, chosen = tuned_table(
            table, la.posterior, ks, coverage, square_norm, per_candidate
        )
    else:
        pairs = grid_candidates(la, ks, prior_precisions, empirical_bayes)
        args = (pairs, coverage, pred_type, n_samples, generator, include_noise)
        rows = _all_ranks(la, calib_loader, *args)
    reaching = [r for r in rows if r.coverage >= coverage]
    if tuning and reaching:
        best = chosen if chosen is not None and chosen.coverage >= coverage else None
        best = best or sharpest(reaching)
    elif reaching:
        k_min = min(r.k for r in reaching)
        best = _preferred([r for r in reaching if r.k == k_min], coverage)
    else:
        best = _preferred(rows, coverage)
        warnings.warn(
            f"No k in [{ks[0]}, {ks[-1]}] reaches {coverage:.0%} calibration coverage "
            f"({la.loss_scaling} scaling); best achieved {best.coverage:.3f} at k = {best.k}.",
            CoverageNotReachedWarning,
            stacklevel=2,
        )
    numerical_rank = int((~la.lanczos_info.below_threshold).sum())
    selection = DimensionSelection(
        k=best.k,
        prior_precision=best.prior_precision,
        reached=bool(reaching),
        coverage=best.coverage,
        level=coverage,
        rows=rows,
        loss_scaling=la.loss_scaling,
        pred_type=pred_type,
        include_noise=include_noise,
        likelihood=str(getattr(la.likelihood, "value", la.likelihood)),
        numerical_rank=numerical_rank,
        k_rule=k_rule,
    )
    if selection.reached and selection.beyond_rank:
        warnings.warn(
            f"The selected k = {selection.k} lies beyond the numerical rank "
            f"({numerical_rank}) of the GGN: the coverage comes from directions that "
            "carry the prior's variance, not from resolved curvature.",
            CoverageNotReachedWarning,
            stacklevel=2,
        )
    return selection


def _current_row(
    la: Any,
    loader: Iterable,
    level: float,
    pred_type: str,
    n_samples: int,
    generator: torch.Generator | None,
    include_noise: bool,
) -> CoverageRow:
    fitted_posterior(la, "coverage / interval_width")
    level, n_samples = check_sweep_arguments(level, pred_type, n_samples, include_noise)
    pairs = [(la.n_components, la.posterior.tau, False)]
    return _all_ranks(la, loader, pairs, level, pred_type, n_samples, generator, include_noise)[0]


def _all_ranks(la: Any, loader: Iterable, pairs: list, *args: Any) -> list[CoverageRow]:
    """The coverage rows of ``pairs`` on ``loader``; over every rank's calibration shard
    when the fit was data-parallel (weighted means, one all-reduce with a failure flag
    per rank: a rank whose scoring fails raises on every rank; see
    :func:`laplace_glas.curvature.parallel.collectives.reduce_coverage_rows`).
    """
    posterior = la.posterior
    shards = data_parallel(posterior.process_group)
    rows, n_scored, error = None, 0, None
    try:
        X, y, batch_size = _gather(la, loader)
        rows = coverage_table(la, X, y, pairs, *args, batch_size)
        if la.likelihood == "classification":
            n_scored = int((y != posterior.ignore_index).sum())
        else:
            n_scored = y.numel()
    except Exception as err:
        if shards is None:
            raise
        error = err
    if shards is None:
        return rows
    return reduce_coverage_rows(
        rows, n_scored, shards, posterior.device, n_rows=len(pairs), error=error
    )


def coverage(
    la: Any,
    loader: Iterable,
    level: float = 0.9,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = True,
) -> float:
    """Empirical coverage of the central ``level`` intervals (credible sets) on ``loader``
    at the posterior's current ``n_components`` and prior precision.
    """
    return _current_row(la, loader, level, pred_type, n_samples, generator, include_noise).coverage


def interval_width(
    la: Any,
    loader: Iterable,
    level: float = 0.9,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = True,
) -> float:
    """Mean width of the central ``level`` intervals (mean credible-set size for
    classification) on ``loader``.
    """
    row = _current_row(la, loader, level, pred_type, n_samples, generator, include_noise)
    return row.mean_width
