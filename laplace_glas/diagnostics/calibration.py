"""Choosing the subspace dimension k and the prior precision by empirical coverage.

For every candidate ``(k, tau)`` the predictive distribution of a fitted GLAS posterior
truncated to its leading ``k`` eigenpairs is evaluated on held-out calibration data:

* regression: central ``1 - alpha`` intervals of ``f(x)`` (of ``y = f(x) + noise``
  with ``include_noise=True``); coverage is the fraction of targets inside;
* classification: the smallest set of classes whose predictive mass reaches
  ``1 - alpha``; coverage is the fraction of points whose label is in their set.

The selection is the smallest ``k`` whose coverage reaches the nominal level, the
prior precision chosen jointly among the candidates (the empirical-Bayes optimum at
that ``k``, the posterior's current value and an optional grid), ties broken by the
narrowest interval (smallest set). The sweep is vectorised over ``k``: the linearised
predictive computes ``J U`` once for all ``k`` and accumulates the variance along the
eigen-directions; the sampling predictive draws one set of ``z`` and truncates it.

A posterior with a layerwise or diagonal prior precision is swept at that prior (the
candidate ``prior_precision=None`` in the table), through the posterior's own
predictive truncated to each ``k`` (``z`` is correlated there: no shared draw); scalar
grid values and the scalar empirical-Bayes optimum remain candidates beside it.

A subnetwork posterior (scalar prior) is swept through its hooks: the directions
embedded in the network's weights, the network's MAP weights as the point of
linearisation, the subnetwork's Jacobian Gram for ``complement='prior'`` and
complement draws put on the subnetwork's weights.

Why observation noise is left out by default (the paper's convention): under
mean-loss scaling each retained direction ``u_j`` with ``lambda_j >> tau`` adds about
``(J u_j)^2 / lambda_j`` of variance at a training input, whose average is
``sigma^2`` whatever N is, so a few directions cover the data; with summed-loss
scaling each adds ``sigma^2 / N``. With the noise added (the usual predictive of y),
coverage is often reached at k = 1 under either scaling and says little about the
weight posterior.

After a data-parallel fit (:mod:`laplace_glas.curvature.distributed`) each rank passes
its shard of the calibration data; coverage, width and NLL of every candidate are
combined as means weighted by the shards' numbers of scored targets (one all-reduce),
so every rank selects the same ``(k, tau)``.
"""

from __future__ import annotations

import copy
import math
import numbers
import statistics
import warnings
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.batches import batch_size as batch_rows
from laplace_glas.curvature.batches import concatenate_inputs, split_batch
from laplace_glas.curvature.distributed import data_parallel, reduce_coverage_rows
from laplace_glas.curvature.fitting import check_labels
from laplace_glas.posterior.closed_forms import optimal_prior_precision
from laplace_glas.predictive.jvp import (
    batched_outputs,
    jvp_directions,
    row_chunks,
)
from laplace_glas.predictive.links import gaussian_samples
from laplace_glas.validation import positive_int

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


@dataclass(frozen=True)
class CoverageRow:
    """Calibration metrics of one candidate ``(k, prior_precision)``.

    ``mean_width`` is the mean interval width (regression) or mean credible-set
    size (classification); ``nll`` the mean negative log predictive density of the
    targets (regression: Gaussian with the predictive variance of f plus
    ``sigma^2``; classification: ``-log p(y)``).
    """

    k: int
    prior_precision: float | None  # None: the posterior's layerwise / diagonal prior
    coverage: float
    mean_width: float
    nll: float
    empirical_bayes: bool = False


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
    la._check_H_init()
    la._check_fitted_weights()
    Xs, ys = [], []
    for data in loader:
        X, y = split_batch(data, la.dict_key_y)
        if not isinstance(X, (torch.Tensor, MutableMapping)):
            raise TypeError(
                "Calibration needs (X, y) batches with tensor inputs or mapping batches "
                f"(e.g. input_ids, attention_mask, labels), got inputs of type {type(X).__name__}."
            )
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
    X = {k: v.to(la._device) for k, v in X.items()} if isinstance(X, dict) else X.to(la._device)
    y = torch.cat(ys).to(la._device)
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


def _candidates(
    la: Any, ks: Sequence[int], prior_precisions: Iterable[float] | None, empirical_bayes: bool
) -> list[tuple[int, float, bool]]:
    # every candidate k, also those above the posterior's current n_components
    curvature = la._curvature_up_to(max(ks)).detach()
    square_norm = float((la.mean - la.prior_mean).detach().square().sum())
    if prior_precisions is not None:
        grid = [float(t) for t in prior_precisions]
    else:  # the posterior's own prior: tau, or None for a layerwise / diagonal one
        grid = [_own_tau(la)]
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
                taus[optimal_prior_precision(curvature[:k], square_norm)] = True
            except ValueError:
                pass
        pairs.extend((k, t, eb) for t, eb in taus.items())
    return pairs


def _own_tau(la: Any) -> float | None:
    """The posterior's own scalar prior precision, None for a layerwise / diagonal one."""
    tau = la._prior.tau
    return None if tau is None else float(tau)


def _validate_ks(la: Any, ks: Sequence[int] | None) -> list[int]:
    la._check_H_init()
    available = la.lanczos_info.k
    if ks is not None and (
        isinstance(ks, str)
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


def _standard_normal(shape, la: Any, generator: torch.Generator | None) -> torch.Tensor:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}.")
    device = generator.device if generator is not None else la._device
    return torch.randn(*shape, generator=generator, device=device, dtype=la._dtype).to(la._device)


def coverage_table(
    la: Any,
    X: torch.Tensor,
    y: torch.Tensor,
    pairs: Sequence[tuple[int, float, bool]],
    level: float = 0.9,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = False,
    batch_size: int | None = None,
) -> list[CoverageRow]:
    """Coverage, mean width and NLL for each ``(k, tau, is_empirical_bayes)``.

    Uses the eigenpairs already in ``la`` (truncation only, no recomputation) and one
    draw of standard normals shared by all candidates. The network sees at most
    ``batch_size`` rows of ``X`` at a time (default: all), so the memory of the JVPs
    and sample evaluations is that of one batch; only the outputs are kept.
    """
    if not 0 < level < 1:
        raise ValueError(f"The coverage level must lie in (0, 1), got {level}.")
    if pred_type not in ("nn", "glm"):
        raise ValueError(f"pred_type must be 'nn' or 'glm', got {pred_type!r}.")
    if n_samples < 2:
        raise ValueError("n_samples must be >= 2.")
    batch_size = positive_int("batch_size", batch_size)
    k_max = max(k for k, _, _ in pairs)
    # U over the posterior's weights (complement draws), V over the network's (the
    # same tensor unless the posterior is a subnetwork's: V embeds U)
    U = la.H[0][:, :k_max]
    V = la._network_directions_up_to(k_max)
    a = la._curvature_up_to(k_max).detach()
    sigma2 = float(la.sigma_noise.square()) if la.likelihood == "regression" else 0.0
    prior_complement = la.complement == "prior"
    theta = la._network_weights().detach()
    rows = []
    with torch.no_grad(), autodiff_friendly(la.model):
        if la.likelihood == "regression" and pred_type == "glm":
            f, JU = _linearised(la, X, V, batch_size)
            if f.shape != y.shape:
                raise ValueError(
                    f"Calibration targets of shape {tuple(y.shape)} do not match the model "
                    f"output of shape {tuple(f.shape)}."
                )
            gram_diag = None
            if prior_complement and any(t is not None for _, t, _ in pairs):
                rows_at_once = 32 if batch_size is None else min(32, batch_size)
                gram_diag = la._prior_gram_diagonal(X, theta, rows_at_once)
            JU2 = JU.square()
            z_score = statistics.NormalDist().inv_cdf(0.5 + level / 2)

            def gaussian_row(k: int, tau: float | None, eb: bool, var_f: torch.Tensor) -> None:
                var_f = var_f.clamp(min=0)
                var = var_f + sigma2 if include_noise else var_f
                half = z_score * var.sqrt()
                covered = ((y - f).abs() <= half).double().mean()
                nll = _gaussian_nll(y, f, var_f + sigma2)
                rows.append(CoverageRow(k, tau, float(covered), float(2 * half.mean()), nll, eb))

            for tau in sorted({t for _, t, _ in pairs if t is not None}):
                weights = 1.0 / (a + tau)
                if prior_complement:
                    weights = weights - 1.0 / tau
                cumulative = torch.cumsum(JU2 * weights, dim=-1)
                for k, t, eb in pairs:
                    if t != tau:
                        continue
                    var_f = cumulative[..., k - 1]
                    if gram_diag is not None:
                        var_f = var_f + gram_diag / tau
                    gaussian_row(k, tau, eb, var_f)
            for k, t, eb in pairs:
                if t is None:  # the posterior's own layerwise / diagonal prior
                    moments = _own_prior_moments(la, X, k, batch_size)
                    gaussian_row(
                        k, None, eb, moments[1].diagonal(dim1=-2, dim2=-1).reshape(y.shape)
                    )
        else:
            rows = _sampled_rows(
                la,
                X,
                y,
                U,
                V,
                a,
                pairs,
                level,
                pred_type,
                n_samples,
                generator,
                include_noise,
                batch_size,
            )
    order = {(k, t): i for i, (k, t, _) in enumerate(pairs)}
    return sorted(rows, key=lambda r: order[(r.k, r.prior_precision)])


def _linearised(
    la: Any, X: torch.Tensor, directions: torch.Tensor, batch_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``f(X; theta*)`` and ``J(X) V`` for ``(D, m)`` directions ``V``, over row chunks
    of ``X`` (``la.jvp_chunk_size`` directions at a time).
    """
    names, shapes, theta = la._param_names, la._param_shapes, la._network_weights().detach()
    parts = [
        jvp_directions(la.model, names, shapes, theta, rows, directions, la.jvp_chunk_size)
        for rows in row_chunks(X, batch_size, la.dict_key_x)
    ]
    return torch.cat([f for f, _ in parts]), torch.cat([JV for _, JV in parts])


def _sampled_outputs(
    la: Any, thetas: torch.Tensor, X: torch.Tensor, batch_size: int | None
) -> torch.Tensor:
    """``(S, n, ...)`` network outputs at weight samples ``thetas`` ``(S, D)``,
    ``la.sample_chunk_size`` samples and ``batch_size`` rows of ``X`` at a time.
    """
    names, shapes = la._param_names, la._param_shapes
    chunk = la.sample_chunk_size
    return torch.cat(
        [
            torch.cat(
                [
                    batched_outputs(la.model, names, shapes, thetas[i : i + chunk], rows)
                    for rows in row_chunks(X, batch_size, la.dict_key_x)
                ],
                dim=1,
            )
            for i in range(0, thetas.shape[0], chunk)
        ]
    )


def _gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> float:
    var = var.clamp(min=torch.finfo(var.dtype).tiny)
    nll = 0.5 * (torch.log(2 * math.pi * var) + (y - mean).square() / var)
    return float(nll.mean())


def _sampled_rows(
    la: Any,
    X: torch.Tensor,
    y: torch.Tensor,
    U: torch.Tensor,
    V: torch.Tensor,
    a: torch.Tensor,
    pairs: Sequence[tuple[int, float, bool]],
    level: float,
    pred_type: str,
    n_samples: int,
    generator: torch.Generator | None,
    include_noise: bool,
    batch_size: int | None,
) -> list[CoverageRow]:
    """Coverage from predictive samples that share one draw of ``z``.

    ``U`` ``(n_params, k_max)``: the eigenvectors over the posterior's weights (the
    complement draws are projected with them); ``V`` ``(D, k_max)``: the same over the
    network's weights (embedded for a subnetwork posterior).
    """
    theta = la._network_weights().detach()
    k_max = U.shape[1]
    z = _standard_normal((n_samples, k_max), la, generator)
    e = None
    if la.complement == "prior":
        e = _standard_normal((n_samples, U.shape[0]), la, generator)
    classification = la.likelihood == "classification"
    ignore_index = getattr(la, "ignore_index", -100)
    f0, JU = (None, None)
    if pred_type == "glm":
        f0, JU = _linearised(la, X, V, batch_size)
    noise = None
    if include_noise and not classification:
        noise = la.sigma_noise * _standard_normal((n_samples, *y.shape), la, generator)
    sigma2 = float(la.sigma_noise.square()) if not classification else 0.0
    alpha = 1.0 - level
    if classification:
        # one credible set per target: tokens of sequence outputs are flattened,
        # padding (ignore_index) is left out
        labels = y.reshape(-1)
        keep = labels != ignore_index
        labels = labels[keep]

    rows = []
    for k, tau, eb in pairs:
        if tau is None:  # the posterior's own layerwise / diagonal prior
            fs = _own_prior_draws(la, X, k, pred_type, n_samples, generator, batch_size)
        elif pred_type == "glm":
            fs = f0 + torch.einsum("...k,sk->s...", JU[..., :k], _coefficients(z, a, k, tau))
            if e is not None:
                complement = la._embed_weight_draws(_complement_draws(e, U, k, tau))
                _, Je = _linearised(la, X, complement.T, batch_size)
                fs = fs + Je.movedim(-1, 0)
        else:
            thetas = theta + _coefficients(z, a, k, tau) @ V[:, :k].T
            if e is not None:
                thetas = thetas + la._embed_weight_draws(_complement_draws(e, U, k, tau))
            fs = _sampled_outputs(la, thetas, X, batch_size)
        if classification:
            if not rows:  # every candidate has the same output shape: check the labels once
                _check_calibration_labels(fs, y, ignore_index)
            probs = torch.softmax(fs, dim=-1).mean(0).reshape(-1, fs.shape[-1])[keep]
            covered, size = _credible_sets(probs, labels, level)
            nll = float(-torch.log(probs.gather(1, labels.reshape(-1, 1)).clamp(min=1e-12)).mean())
            rows.append(CoverageRow(k, tau, covered, size, nll, eb))
            continue
        if fs.shape[1:] != y.shape:
            raise ValueError(
                f"Calibration targets of shape {tuple(y.shape)} do not match the model "
                f"output of shape {tuple(fs.shape[1:])}."
            )
        draws = fs + noise if noise is not None else fs
        lo = torch.quantile(draws, alpha / 2, dim=0)
        hi = torch.quantile(draws, 1 - alpha / 2, dim=0)
        covered = ((y >= lo) & (y <= hi)).double().mean()
        nll = _gaussian_nll(y, fs.mean(0), fs.var(0) + sigma2)
        rows.append(CoverageRow(k, tau, float(covered), float((hi - lo).mean()), nll, eb))
    return rows


def _coefficients(z: torch.Tensor, a: torch.Tensor, k: int, tau: float) -> torch.Tensor:
    """``z_j / sqrt(a_j + tau)`` for ``j <= k``: ``(S, k)`` subspace coefficients."""
    return z[:, :k] * (1.0 / (a[:k] + tau)).sqrt()


def _complement_draws(e: torch.Tensor, U: torch.Tensor, k: int, tau: float) -> torch.Tensor:
    """``(I - U_k U_k^T) e / sqrt(tau)``: ``(S, D)`` draws of the prior complement."""
    Uk = U[:, :k]
    return (e - (e @ Uk) @ Uk.T) / math.sqrt(tau)


def _truncated(la: Any, k: int) -> Any:
    """A shallow copy of ``la`` using its leading ``k`` eigenpairs (nothing recomputed)."""
    view = copy.copy(la)
    view._n_components = k
    return view


def _own_prior_moments(
    la: Any, X: torch.Tensor, k: int, batch_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """'glm' mean ``(n, C)``, covariance ``(n, C, C)`` and leading output shape of
    ``la`` truncated to ``k`` under its own (layerwise or diagonal) prior, over row
    chunks of ``X``.
    """
    view = _truncated(la, k)
    parts = [view._glm_moments(rows) for rows in row_chunks(X, batch_size)]
    lead = torch.Size([sum(p[2][0] for p in parts), *parts[0][2][1:]])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), lead


def _own_prior_draws(
    la: Any,
    X: torch.Tensor,
    k: int,
    pred_type: str,
    n_samples: int,
    generator: torch.Generator | None,
    batch_size: int | None,
) -> torch.Tensor:
    """``(S, n, ..., C)`` draws of ``f(X)`` of ``la`` truncated to ``k`` under its own
    prior: network outputs at weight samples ('nn'), or Gaussian draws of the
    linearised model ('glm').
    """
    view = _truncated(la, k)
    if pred_type == "nn":
        return _sampled_outputs(view, view.sample(n_samples, generator), X, batch_size)
    f_mu, f_var, lead = _own_prior_moments(la, X, k, batch_size)
    draws = gaussian_samples(f_mu, f_var, n_samples, generator)
    return draws.reshape(n_samples, *lead, f_mu.shape[-1])


def _check_calibration_labels(fs: torch.Tensor, y: torch.Tensor, ignore_index: int) -> None:
    """Labels ``y`` fit the sampled outputs ``fs`` ``(S, batch, ..., C)``, as in ``fit``."""
    if fs.shape[1:-1] != y.shape:
        raise ValueError(
            f"Calibration labels of shape {tuple(y.shape)} do not match the model "
            f"output of shape {tuple(fs.shape[1:])}."
        )
    if check_labels(fs[0], y, ignore_index, 0) == 0:
        raise ValueError(
            "Every calibration target equals ignore_index: there is nothing to measure coverage on."
        )


def _credible_sets(probs: torch.Tensor, y: torch.Tensor, level: float) -> tuple[float, float]:
    """Coverage and mean size of the smallest class sets with mass >= ``level``."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    in_set_sorted = mass_before < level  # include classes until the mass reaches level
    in_set = torch.zeros_like(in_set_sorted).scatter(-1, order, in_set_sorted)
    covered = in_set.gather(1, y.reshape(-1, 1)).double().mean()
    return float(covered), float(in_set.sum(-1).double().mean())


def select_dimension(
    la: Any,
    calib_loader: Iterable,
    coverage: float = 0.9,
    ks: Sequence[int] | None = None,
    prior_precisions: Iterable[float] | None = None,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = False,
    empirical_bayes: bool = True,
) -> DimensionSelection:
    """Smallest ``k`` (and its prior precision) whose calibration coverage reaches ``coverage``.

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
        Grid of prior precisions (default: the posterior's current one). The
        empirical-Bayes optimum at each ``k`` is added when ``empirical_bayes``.
    pred_type : {'glm', 'nn'}, default='glm'
        Linearised or sampling predictive (the default agrees with ``coverage``,
        ``interval_width`` and the posterior's ``__call__``). 'glm' pushes ``J U``
        through once for all candidates (regression: closed form, no sampling);
        'nn' evaluates the network at shared samples once per ``(k, tau)``.
    n_samples : int, default=200
        Samples for 'nn' (and for 'glm' in classification).
    generator : torch.Generator, optional
        Controls the samples.
    include_noise : bool, default=False
        Regression only: add the observation noise (intervals of y instead of f).
    empirical_bayes : bool, default=True
        Add each ``k``'s evidence-maximising prior precision to the candidates.

    Returns
    -------
    DimensionSelection
        ``reached=False`` (with a :class:`CoverageNotReachedWarning`) when no
        candidate reaches the level; the best coverage achieved is then selected.

    """
    if la.likelihood not in ("regression", "classification"):
        raise ValueError(
            f"calibrate / select_dimension need regression or classification targets; "
            f"likelihood={la.likelihood!r} has none to cover (reward models are trained "
            "on preference labels, not on targets of the predicted rewards)."
        )
    ks = _validate_ks(la, ks)
    X, y, batch_size = _gather(la, calib_loader)
    pairs = _candidates(la, ks, prior_precisions, empirical_bayes)
    rows = coverage_table(
        la, X, y, pairs, coverage, pred_type, n_samples, generator, include_noise, batch_size
    )
    rows = _all_ranks(la, rows, y)
    reaching = [r for r in rows if r.coverage >= coverage]
    if reaching:
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
    la._check_H_init()
    X, y, batch_size = _gather(la, loader)
    tau = _own_tau(la)
    pairs = [(la.n_components, tau, False)]
    rows = coverage_table(
        la, X, y, pairs, level, pred_type, n_samples, generator, include_noise, batch_size
    )
    return _all_ranks(la, rows, y)[0]


def _all_ranks(la: Any, rows: list[CoverageRow], y: torch.Tensor) -> list[CoverageRow]:
    """The rows over every rank's calibration shard when the fit was data-parallel
    (weighted means, one all-reduce; see
    :func:`laplace_glas.curvature.distributed.reduce_coverage_rows`).
    """
    shards = data_parallel(getattr(la, "_process_group", None))
    if shards is None:
        return rows
    if la.likelihood == "classification":
        n_scored = int((y != getattr(la, "ignore_index", -100)).sum())
    else:
        n_scored = y.numel()
    return reduce_coverage_rows(rows, n_scored, shards, la._device)


def coverage(
    la: Any,
    loader: Iterable,
    level: float = 0.9,
    pred_type: str = "glm",
    n_samples: int = 200,
    generator: torch.Generator | None = None,
    include_noise: bool = False,
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
    include_noise: bool = False,
) -> float:
    """Mean width of the central ``level`` intervals (mean credible-set size for
    classification) on ``loader``.
    """
    row = _current_row(la, loader, level, pred_type, n_samples, generator, include_noise)
    return row.mean_width
