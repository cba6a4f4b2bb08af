"""Coverage of a fitted posterior's predictive on held-out data, for many ``(k, tau)``
candidates at once (the table that :func:`~laplace_glas.diagnostics.calibration.select_dimension`
chooses from).

For a candidate ``(k, tau)`` the posterior truncated to its leading ``k`` eigenpairs has,
along ``u_j``, the variance ``v_j = 1 / (a_j + tau)``. The linearised predictive of a
regression computes ``J U`` once and accumulates

.. math::

    \\mathrm{Var}[f(x)] = \\sum_{j \\le k} v_j \\, (J(x) u_j)^2
    \\;\\big(+\\; \\tau^{-1} \\|J(x)\\|^2 - \\tau^{-1} \\sum_{j \\le k} (J(x) u_j)^2
    \\text{ for } \\texttt{complement='prior'}\\big);

the sampling predictive draws one set of ``z`` (and of complement draws) shared by all
candidates and truncates it. Only the view ``la.posterior`` and public methods are read.
"""

from __future__ import annotations

import copy
import math
import numbers
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.map_loss import check_labels
from laplace_glas.posterior.hyperparameters import CURVATURE_COMPLEMENTS
from laplace_glas.predictive.jvp import batched_outputs, jvp_directions, row_chunks
from laplace_glas.predictive.links import gaussian_samples
from laplace_glas.validation import ArgumentTypeError, choice, flag, positive_int, scalar_value

__all__ = ["CoverageRow", "check_sweep_arguments", "coverage_table"]


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


def _standard_normal(shape, la: Any, generator: torch.Generator | None) -> torch.Tensor:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}.")
    posterior = la.posterior
    device = generator.device if generator is not None else posterior.device
    draws = torch.randn(*shape, generator=generator, device=device, dtype=posterior.dtype)
    return draws.to(posterior.device)


def check_sweep_arguments(
    level: Any, pred_type: Any, n_samples: Any, include_noise: Any, level_name: str = "level"
) -> tuple[float, int]:
    """The coverage level and sample count of a sweep, checked by type and range.

    Parameters
    ----------
    level : float
        Nominal coverage, in ``(0, 1)``.
    pred_type : {'glm', 'nn'}
        The predictive.
    n_samples : int
        Number of samples, at least 2.
    include_noise : bool
        Whether the observation noise is added.
    level_name : str, default='level'
        The name of ``level`` in the caller's signature (used in the messages).

    Returns
    -------
    tuple of (float, int)
        ``level`` and ``n_samples`` as Python numbers.

    Raises
    ------
    ArgumentTypeError
        When an argument has the wrong type (a string for a number, a float count).
    ValueError
        When an argument is out of its range or not one of the accepted strings.

    """
    number = scalar_value(level_name, level)
    if not 0 < number < 1:
        raise ValueError(
            f"{level_name} (the nominal coverage level) must lie in (0, 1), got {number}."
        )
    choice("pred_type", pred_type, ("glm", "nn"))
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral):
        raise ArgumentTypeError(
            f"n_samples must be an int >= 2, got {type(n_samples).__name__} ({n_samples!r})."
        )
    if n_samples < 2:
        raise ValueError(f"n_samples must be an int >= 2, got {n_samples}.")
    flag("include_noise", include_noise)
    return number, int(n_samples)


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
    level, n_samples = check_sweep_arguments(level, pred_type, n_samples, include_noise)
    batch_size = positive_int("batch_size", batch_size)
    k_max = max(k for k, _, _ in pairs)
    # U over the posterior's weights (complement draws), V over the network's (the
    # same tensor unless the posterior is a subnetwork's: V embeds U)
    posterior = la.posterior
    U = posterior.eigenvectors[:, :k_max]
    V = posterior.network_directions(k_max)
    a = posterior.curvature[:k_max].detach()
    sigma2 = float(la.sigma_noise.square()) if la.likelihood == "regression" else 0.0
    prior_complement = la.complement == "prior"
    # complement='diag' / 'kron': every candidate through the posterior's own predictive at that
    # (k, tau) (the complement's variance depends on k through P = I - U_k U_k^T)
    own = la.complement in CURVATURE_COMPLEMENTS
    theta = posterior.network_weights.detach()
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
            if not own and prior_complement and any(t is not None for _, t, _ in pairs):
                rows_at_once = 32 if batch_size is None else min(32, batch_size)
                gram_diag = posterior.prior_gram_diagonal(X, theta, rows_at_once)
            JU2 = JU.square()
            z_score = statistics.NormalDist().inv_cdf(0.5 + level / 2)

            def gaussian_row(k: int, tau: float | None, eb: bool, var_f: torch.Tensor) -> None:
                var_f = var_f.clamp(min=0)
                var = var_f + sigma2 if include_noise else var_f
                half = z_score * var.sqrt()
                covered = ((y - f).abs() <= half).double().mean()
                nll = _gaussian_nll(y, f, var_f + sigma2)
                rows.append(CoverageRow(k, tau, float(covered), float(2 * half.mean()), nll, eb))

            for tau in sorted({t for _, t, _ in pairs if t is not None and not own}):
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
                if t is None or own:  # the posterior's own prior / complement
                    moments = _own_prior_moments(la, X, k, batch_size, t)
                    gaussian_row(k, t, eb, moments[1].diagonal(dim1=-2, dim2=-1).reshape(y.shape))
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
    posterior = la.posterior
    names, shapes = posterior.param_names, posterior.param_shapes
    theta = posterior.network_weights.detach()
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
    posterior = la.posterior
    names, shapes = posterior.param_names, posterior.param_shapes
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
    posterior = la.posterior
    theta = posterior.network_weights.detach()
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
        if tau is None or la.complement in CURVATURE_COMPLEMENTS:  # its own prior / complement
            fs = _own_prior_draws(la, X, k, pred_type, n_samples, generator, batch_size, tau)
        elif pred_type == "glm":
            fs = f0 + torch.einsum("...k,sk->s...", JU[..., :k], _coefficients(z, a, k, tau))
            if e is not None:
                complement = posterior.embed_weight_draws(_complement_draws(e, U, k, tau))
                _, Je = _linearised(la, X, complement.T, batch_size)
                fs = fs + Je.movedim(-1, 0)
        else:
            thetas = theta + _coefficients(z, a, k, tau) @ V[:, :k].T
            if e is not None:
                thetas = thetas + posterior.embed_weight_draws(_complement_draws(e, U, k, tau))
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


def _truncated(la: Any, k: int, tau: float | None = None) -> Any:
    """A shallow copy of ``la`` using its leading ``k`` eigenpairs (nothing recomputed)
    and, when ``tau`` is given, the scalar prior precision ``tau``.
    """
    view = copy.copy(la)
    view.n_components = k
    if tau is not None:
        view.prior_precision = tau
    return view


def _own_prior_moments(
    la: Any, X: torch.Tensor, k: int, batch_size: int | None, tau: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """'glm' mean ``(n, C)``, covariance ``(n, C, C)`` and leading output shape of
    ``la`` truncated to ``k`` under its own (layerwise or diagonal) prior, over row
    chunks of ``X``.
    """
    view = _truncated(la, k, tau)
    glm_moments = view.posterior.glm_moments
    parts = [glm_moments(rows) for rows in row_chunks(X, batch_size, la.dict_key_x)]
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
    tau: float | None = None,
) -> torch.Tensor:
    """``(S, n, ..., C)`` draws of ``f(X)`` of ``la`` truncated to ``k`` under its own
    prior: network outputs at weight samples ('nn'), or Gaussian draws of the
    linearised model ('glm').
    """
    view = _truncated(la, k, tau)
    if pred_type == "nn":
        return _sampled_outputs(view, view.sample(n_samples, generator), X, batch_size)
    f_mu, f_var, lead = _own_prior_moments(la, X, k, batch_size, tau)
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
