"""Drop-in comparison of GLAS with laplace-torch's own posteriors, in one run.

:func:`compare_structures` builds every posterior through the same ``Laplace(...)``
factory, on the same trained model and the same train / calibration / test split, and
measures for each one:

* test NLL, RMSE (accuracy for classification), coverage and mean width of the central
  ``coverage`` intervals (mean credible-set size for classification);
* wall time of ``fit``, of the prior-precision optimisation and, for GLAS, of the
  coverage calibration of ``k``;
* wall time of the predictive per 1000 inputs;
* the peak resident memory (RSS) the structure added to the process.

Protocol
--------
* **Prior precision**: every structure is tuned by its own evidence,
  ``optimize_prior_precision(method='marglik')`` (laplace-torch: 100 Adam steps on the
  log marginal likelihood; GLAS: the closed-form 1-D optimum). laplace-torch 0.3's ELLA
  has no marginal likelihood; it falls back to its validation-NLL grid search on the
  calibration split, and the row says so.
* **GLAS** (both loss scalings) is fitted with ``n_components = glas_k_max``, its prior
  tuned by marglik, then ``la.calibrate(calib_loader, coverage)`` chooses ``k`` (and
  the prior precision among the empirical-Bayes optimum at that ``k`` and the marglik
  value) by the coverage of the predictive of **f** on the calibration split (the
  paper's convention, no noise); the selected ``k`` is reported.
* **Test metrics** use, for every structure alike, the predictive of **y**: the
  predictive variance of f plus ``sigma_noise^2``. ``coverage`` and ``mean_width`` are
  those of y-intervals; ``coverage_f`` (f-intervals, noise left out) is kept as well,
  since it shows how much the weight posterior itself contributes.
* **Predictive**: ``pred_type`` ('glm' by default) for the parametric posteriors; ELLA
  is a function-space method and always predicts with ``pred_type='gp'`` (its
  linearised predictive). Classification uses each structure's own ``'probit'`` link,
  which is what its users get by default: for GLAS the probit on differences of logits
  (:func:`~laplace_glas.predictive.links.probit`), for laplace-torch's structures
  ``softmax(kappa * mu)``, so the rows compare pipelines, not posteriors under one link
  (``pred_type='nn'`` uses Monte Carlo for all). Every structure is called on batches of
  ``predict_batch_size`` inputs, for the metrics and for the timing (``n_predict_timing``
  test inputs, tiled, reported per 1000).
* **Failures** do not stop the comparison: a structure that raises gets a row with
  ``status='failed'`` and the error message; a structure whose number of parameters
  under inference exceeds its ``max_params`` (``'full'`` above ``full_max_params``: a
  D x D matrix and a D^3 log-determinant per marglik step) gets ``status='skipped'``.

Peak memory
-----------
``ru_maxrss`` is the process's high-water mark: once one structure has peaked, later
and smaller ones would show no increase at all. On Linux the high-water mark can be
reset: before each structure the harness collects garbage, returns freed heap to the
OS (``malloc_trim``), writes ``5`` to ``/proc/self/clear_refs`` (which resets
``VmHWM``) and reads the current ``VmRSS``; after the structure it reads ``VmHWM``.
``peak_rss_mb`` is the difference: the peak resident memory the structure added on top
of what the process already held, measured in-process (no subprocess, so the model and
loaders need not be picklable). Where the reset is not available, the fallback is the
``ru_maxrss`` increase, a lower bound (0 when an earlier structure peaked higher);
``ComparisonRow.rss_method`` records which method was used.
"""

from __future__ import annotations

import gc
import math
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from laplace import Laplace
from torch import nn

from laplace_glas.curvature.data.batches import split_batch
from laplace_glas.curvature.memory.budget import return_freed_memory
from laplace_glas.curvature.memory.peak import reset_high_water_mark, status_bytes
from laplace_glas.curvature.solvers.eigenpairs import NumericalRankWarning
from laplace_glas.diagnostics.calibration import CoverageNotReachedWarning

__all__ = [
    "ComparisonRow",
    "PeakMemory",
    "Structure",
    "compare_structures",
    "default_structures",
    "format_table",
    "rss_method",
]


@dataclass(frozen=True)
class Structure:
    """One posterior to build with ``Laplace(model, likelihood, subset, hessian, **kwargs)``.

    Attributes
    ----------
    name : str
        Row label.
    subset_of_weights : str
        ``'all'`` or ``'last_layer'`` (laplace-torch's ``subset_of_weights``).
    hessian_structure : str
        ``'glas'``, ``'kron'``, ``'diag'``, ``'full'``, ``'gp'``, ...
    kwargs : Mapping[str, Any]
        Further keyword arguments of the factory (``sigma_noise`` is added by the
        harness). For GLAS, ``n_components`` is clipped to ``D - 1``; for ELLA,
        ``subsample_size`` and ``n_eigenvalues`` are clipped to the training-set size.
    max_params : int, optional
        Skip the structure (``status='skipped'``) when the number of parameters under
        inference exceeds this.

    """

    name: str
    subset_of_weights: str
    hessian_structure: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_params: int | None = None

    @property
    def is_glas(self) -> bool:
        """Whether this is a GLAS posterior."""
        return self.hessian_structure == "glas"

    @property
    def is_ella(self) -> bool:
        """Whether this is laplace-torch's ELLA (function space, Nyström)."""
        return (
            self.hessian_structure == "gp"
            and self.kwargs.get("functional_approximation") == "nystrom"
        )


@dataclass
class ComparisonRow:
    """Measurements of one structure.

    Attributes
    ----------
    name, subset_of_weights, hessian_structure : str
        The structure.
    status : str
        ``'ok'``, ``'failed'`` (see ``error``) or ``'skipped'`` (see ``error``).
    n_params : int
        Parameters under inference (D, or the last layer's size).
    k : int or None
        GLAS: the dimension selected by coverage on the calibration split.
    k_max : int or None
        GLAS: the number of eigenpairs computed by ``fit``.
    calibration_reached : bool or None
        GLAS: whether some ``k <= k_max`` reached the nominal calibration coverage.
    prior_precision : float or None
        The tuned (scalar) prior precision.
    nll : float or None
        Mean test negative log predictive density of y.
    rmse : float or None
        Test RMSE of the predictive mean (regression).
    accuracy : float or None
        Test accuracy (classification).
    coverage : float or None
        Test coverage of the central ``level`` intervals of y (regression) or of the
        ``level`` credible sets of classes (classification).
    coverage_f : float or None
        Test coverage of the central ``level`` intervals of f, noise left out
        (regression).
    mean_width : float or None
        Mean width of the y-intervals (mean credible-set size for classification).
    fit_time : float or None
        Seconds in ``fit``.
    prior_time : float or None
        Seconds in ``optimize_prior_precision`` (marglik; ELLA: grid search).
    calibration_time : float or None
        GLAS: seconds in ``calibrate`` (choice of k by coverage).
    predict_time_per_1000 : float or None
        Seconds of one predictive call, scaled to 1000 inputs.
    peak_rss_mb : float or None
        Peak resident memory added by the structure, MiB (see ``rss_method``).
    rss_method : str
        ``'VmHWM reset'`` or ``'ru_maxrss delta'`` (see the module docstring).
    level : float
        Nominal coverage.
    note : str
        Remarks (fallbacks, calibration not reached, ...).
    error : str or None
        The error message of a failed or skipped structure.

    """

    name: str
    subset_of_weights: str
    hessian_structure: str
    status: str = "ok"
    n_params: int = 0
    k: int | None = None
    k_max: int | None = None
    calibration_reached: bool | None = None
    prior_precision: float | None = None
    nll: float | None = None
    rmse: float | None = None
    accuracy: float | None = None
    coverage: float | None = None
    coverage_f: float | None = None
    mean_width: float | None = None
    fit_time: float | None = None
    prior_time: float | None = None
    calibration_time: float | None = None
    predict_time_per_1000: float | None = None
    peak_rss_mb: float | None = None
    rss_method: str = ""
    level: float = 0.9
    note: str = ""
    error: str | None = None


def default_structures(
    glas_k_max: int = 50,
    full_max_params: int = 5000,
    ella_subsample_size: int = 500,
    ella_n_eigenvalues: int = 20,
) -> list[Structure]:
    """The structures of the comparison, in table order.

    GLAS with mean-loss and with summed-loss scaling; laplace-torch's
    ``('all', 'kron')``, ``('all', 'diag')``, ``('all', 'full')`` (skipped above
    ``full_max_params`` parameters), ``('last_layer', 'kron')``,
    ``('last_layer', 'full')``; ELLA (``hessian_structure='gp'``,
    ``functional_approximation='nystrom'``).

    Parameters
    ----------
    glas_k_max : int, default=50
        Eigenpairs computed by the GLAS fits (the calibration sweeps ``1..k_max``).
    full_max_params : int, default=5000
        Largest ``D`` for which ``('all', 'full')`` runs.
    ella_subsample_size, ella_n_eigenvalues : int
        ELLA's Nyström subset size and rank (clipped to the training-set size).

    Returns
    -------
    list of Structure

    """
    return [
        Structure(
            "GLAS mean",
            "all",
            "glas",
            {"n_components": glas_k_max, "loss_scaling": "mean", "complement": "zero"},
        ),
        Structure(
            "GLAS sum",
            "all",
            "glas",
            {"n_components": glas_k_max, "loss_scaling": "sum", "complement": "zero"},
        ),
        Structure("all / kron", "all", "kron"),
        Structure("all / diag", "all", "diag"),
        Structure("all / full", "all", "full", max_params=full_max_params),
        Structure("last_layer / kron", "last_layer", "kron"),
        Structure("last_layer / full", "last_layer", "full"),
        Structure(
            "ELLA",
            "all",
            "gp",
            {
                "functional_approximation": "nystrom",
                "subsample_size": ella_subsample_size,
                "n_eigenvalues": ella_n_eigenvalues,
            },
        ),
    ]


# ---------------------------------------------------------------------- memory
def _status_kib(key: str) -> int | None:
    value = status_bytes(key)
    return None if value is None else value // 1024


def rss_method() -> str:
    """The peak-memory method available in this process (see the module docstring)."""
    if _status_kib("VmHWM") is not None and reset_high_water_mark():
        return "VmHWM reset"
    return "ru_maxrss delta"


def _maxrss_kib() -> float:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value / 1024 if sys.platform == "darwin" else float(value)  # bytes on macOS


def _trim_heap() -> None:
    gc.collect()
    return_freed_memory()


class PeakMemory:
    """Context manager: peak resident memory added inside the block, in MiB.

    On entry: garbage collection, ``malloc_trim(0)``, reset of the high-water mark
    (``/proc/self/clear_refs``) and the current ``VmRSS``; on exit ``peak_mb`` is
    ``VmHWM`` minus that. Without the reset, the ``ru_maxrss`` increase (a lower bound).

    Examples
    --------
    >>> with PeakMemory() as probe:
    ...     x = bytearray(50 * 2**20)
    >>> probe.peak_mb  # doctest: +SKIP
    50.1

    """

    def __init__(self) -> None:
        self.method = rss_method()
        self.peak_mb: float | None = None

    def __enter__(self) -> PeakMemory:
        _trim_heap()
        if self.method == "VmHWM reset":
            reset_high_water_mark()
            self._start = float(_status_kib("VmRSS") or 0)
        else:
            self._start = _maxrss_kib()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.method == "VmHWM reset":
            end = float(_status_kib("VmHWM") or 0)
        else:
            end = _maxrss_kib()
        self.peak_mb = max(end - self._start, 0.0) / 1024


# ---------------------------------------------------------------------- helpers
def _gather(loader: Iterable) -> tuple[torch.Tensor, torch.Tensor]:
    Xs, ys = [], []
    for data in loader:
        X, y = split_batch(data)
        if not isinstance(X, torch.Tensor):
            raise TypeError("compare_structures supports tensor (X, y) batches only.")
        Xs.append(X)
        ys.append(y)
    if not Xs:
        raise ValueError("A loader of the comparison is empty.")
    return torch.cat(Xs), torch.cat(ys)


def _n_data(loader: Iterable) -> int:
    return sum(int(split_batch(data)[0].shape[0]) for data in loader)


def _last_layer_size(model: nn.Module) -> int:
    """Parameters of the last module that holds parameters (laplace-torch's last layer)."""
    last = None
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            last = own
    return sum(p.numel() for p in last) if last else 0


def _resolve_kwargs(structure: Structure, n_params: int, n_train: int) -> dict[str, Any]:
    kwargs = dict(structure.kwargs)
    if structure.is_glas and "n_components" in kwargs:
        kwargs["n_components"] = max(1, min(int(kwargs["n_components"]), n_params - 1))
    if structure.is_ella:
        subsample = min(int(kwargs.get("subsample_size", n_train)), n_train)
        kwargs["subsample_size"] = subsample
        kwargs["n_eigenvalues"] = min(int(kwargs.get("n_eigenvalues", subsample)), subsample)
    return kwargs


def _z_score(level: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + level / 2)


def _predict(la: Any, X: torch.Tensor, structure: Structure, pred_type: str, likelihood: str):
    if structure.is_ella:
        return la(X, pred_type="gp", link_approx="probit")
    if likelihood == "classification":
        link = "mc" if pred_type == "nn" else "probit"
        return la(X, pred_type=pred_type, link_approx=link)
    return la(X, pred_type=pred_type)


def _regression_variance(f_var: torch.Tensor, n: int, n_out: int) -> torch.Tensor:
    """Marginal variances ``(n, C)`` from laplace-torch's ``(n, C, C)`` or ``(n, C)``."""
    if f_var.ndim == 3:
        f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
    return f_var.reshape(n, n_out)


def _evaluate(
    la: Any,
    X: torch.Tensor,
    y: torch.Tensor,
    structure: Structure,
    pred_type: str,
    likelihood: str,
    sigma2: float,
    level: float,
    batch: int,
) -> dict[str, float]:
    """Test metrics from the predictive of y (f plus noise for regression)."""
    z = _z_score(level)
    sums = {"nll": 0.0, "se": 0.0, "cov": 0.0, "cov_f": 0.0, "width": 0.0, "acc": 0.0}
    n_total, n_values = 0, 0
    with torch.no_grad():
        for start in range(0, X.shape[0], batch):
            xb, yb = X[start : start + batch], y[start : start + batch]
            out = _predict(la, xb, structure, pred_type, likelihood)
            if likelihood == "classification":
                probs = out.clamp(min=1e-12)
                p_true = probs.gather(1, yb.reshape(-1, 1)).squeeze(1)
                sums["nll"] += float(-p_true.log().sum())
                sums["acc"] += float((probs.argmax(-1) == yb).sum())
                sorted_p, order = probs.sort(dim=-1, descending=True)
                in_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < level
                in_set = torch.zeros_like(in_sorted).scatter(-1, order, in_sorted)
                sums["cov"] += float(in_set.gather(1, yb.reshape(-1, 1)).sum())
                sums["width"] += float(in_set.sum())
                n_total += xb.shape[0]
                continue
            f_mu, f_var = out
            yb = yb.reshape(f_mu.shape)
            var_f = _regression_variance(f_var, *f_mu.shape).clamp(min=0)
            var_y = var_f + sigma2
            resid = yb - f_mu
            nll = 0.5 * (torch.log(2 * math.pi * var_y) + resid.square() / var_y)
            sums["nll"] += float(nll.sum())
            sums["se"] += float(resid.square().sum())
            sums["cov"] += float((resid.abs() <= z * var_y.sqrt()).sum())
            sums["cov_f"] += float((resid.abs() <= z * var_f.sqrt()).sum())
            sums["width"] += float((2 * z * var_y.sqrt()).sum())
            n_total += xb.shape[0]
            n_values += resid.numel()
    if likelihood == "classification":
        return {
            "nll": sums["nll"] / n_total,
            "accuracy": sums["acc"] / n_total,
            "coverage": sums["cov"] / n_total,
            "mean_width": sums["width"] / n_total,
        }
    return {
        "nll": sums["nll"] / n_total,  # summed over outputs, averaged over points
        "rmse": math.sqrt(sums["se"] / n_values),
        "coverage": sums["cov"] / n_values,
        "coverage_f": sums["cov_f"] / n_values,
        "mean_width": sums["width"] / n_values,
    }


def _time_predictive(
    la: Any,
    X: torch.Tensor,
    structure: Structure,
    pred_type: str,
    likelihood: str,
    n: int,
    batch: int,
) -> float:
    """Seconds to predict ``n`` inputs (test inputs tiled) in calls of ``batch``, per 1000."""
    reps = -(-n // X.shape[0])
    Xt = X.repeat(reps, *([1] * (X.ndim - 1)))[:n]
    with torch.no_grad():
        _predict(la, Xt[: min(8, n)], structure, pred_type, likelihood)  # warm-up
        start = time.perf_counter()
        for i in range(0, n, batch):
            _predict(la, Xt[i : i + batch], structure, pred_type, likelihood)
        elapsed = time.perf_counter() - start
    return elapsed * 1000.0 / n


def _short(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _run_one(
    structure: Structure,
    row: ComparisonRow,
    model: nn.Module,
    likelihood: str,
    train_loader: Iterable,
    calib_loader: Iterable,
    X_test: torch.Tensor,
    y_test: torch.Tensor,
    *,
    n_train: int,
    sigma_noise: float,
    level: float,
    pred_type: str,
    n_predict_timing: int,
    eval_batch: int,
    progress: bool,
) -> None:
    kwargs = _resolve_kwargs(structure, row.n_params, n_train)
    factory_kwargs = dict(kwargs)
    if likelihood == "regression":
        factory_kwargs["sigma_noise"] = sigma_noise
    la = Laplace(
        model,
        likelihood,
        subset_of_weights=structure.subset_of_weights,
        hessian_structure=structure.hessian_structure,
        **factory_kwargs,
    )
    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalRankWarning)
        warnings.simplefilter("ignore", CoverageNotReachedWarning)
        start = time.perf_counter()
        la.fit(train_loader)
        row.fit_time = time.perf_counter() - start

        start = time.perf_counter()
        if structure.is_ella:
            la.optimize_prior_precision(
                pred_type="gp", method="gridsearch", val_loader=calib_loader
            )
            notes.append("no marglik in laplace-torch ELLA: prior by val-NLL grid on calib")
        else:
            la.optimize_prior_precision(method="marglik")
        row.prior_time = time.perf_counter() - start

        if structure.is_glas:
            row.k_max = la.n_components
            calib_pred = pred_type if pred_type in ("glm", "nn") else "glm"
            start = time.perf_counter()
            selection = la.calibrate(calib_loader, coverage=level, pred_type=calib_pred)
            row.calibration_time = time.perf_counter() - start
            row.k = selection.k
            row.calibration_reached = selection.reached
            if getattr(selection, "beyond_rank", False):
                notes.append(f"k beyond the GGN's numerical rank ({selection.numerical_rank})")
            if not selection.reached:
                notes.append(
                    f"calib. {level:.0%} f-coverage not reached for k <= {row.k_max} "
                    f"(best {selection.coverage:.2f})"
                )

    prior = la.prior_precision
    if isinstance(prior, torch.Tensor):
        prior = prior.detach()
        prior = float(prior) if prior.numel() == 1 else float(prior.mean())
    row.prior_precision = float(prior)

    sigma2 = sigma_noise**2 if likelihood == "regression" else 0.0
    metrics = _evaluate(
        la, X_test, y_test, structure, pred_type, likelihood, sigma2, level, eval_batch
    )
    for key, value in metrics.items():
        setattr(row, key, value)
    if n_predict_timing > 0:
        row.predict_time_per_1000 = _time_predictive(
            la, X_test, structure, pred_type, likelihood, n_predict_timing, eval_batch
        )
    row.note = "; ".join(notes)
    if progress:
        print(f"[compare] {structure.name}: done", flush=True)
    del la


def compare_structures(
    model: nn.Module,
    likelihood: str,
    train_loader: Iterable,
    calib_loader: Iterable,
    test_loader: Iterable,
    *,
    structures: Sequence[Structure] | None = None,
    sigma_noise: float | None = None,
    coverage: float = 0.9,
    glas_k_max: int = 50,
    full_max_params: int = 5000,
    pred_type: str = "glm",
    n_predict_timing: int = 1000,
    predict_batch_size: int = 100,
    progress: bool = False,
) -> list[ComparisonRow]:
    """Fit, tune and evaluate each structure on the same model and data.

    See the module docstring for the protocol (prior by marglik, GLAS's ``k`` by
    calibration coverage, y-predictive test metrics, in-process peak-RSS method).

    Parameters
    ----------
    model : torch.nn.Module
        The trained network (the MAP); its weights are restored after every structure.
    likelihood : {'regression', 'classification'}
        The likelihood.
    train_loader, calib_loader, test_loader : iterable of (X, y)
        Training data (for ``fit``), held-out calibration data (GLAS's choice of
        ``k``; ELLA's prior grid search), test data (the metrics).
    structures : sequence of Structure, optional
        Default :func:`default_structures` ``(glas_k_max, full_max_params)``.
    sigma_noise : float, optional
        Observation noise (regression), the same for every structure. Default: the
        MAP's training RMSE (a plug-in estimate).
    coverage : float, default=0.9
        Nominal level of the intervals (and of GLAS's calibration).
    glas_k_max : int, default=50
        Eigenpairs computed by the default GLAS structures.
    full_max_params : int, default=5000
        ``('all', 'full')`` of the default structures is skipped above this D.
    pred_type : {'glm', 'nn'}, default='glm'
        Predictive of the parametric posteriors (ELLA always uses 'gp').
    n_predict_timing : int, default=1000
        Inputs (test inputs, tiled) of the timed predictive; 0 skips the timing.
    predict_batch_size : int, default=100
        Inputs per predictive call, for the metrics and the timing alike.
        laplace-torch forms Jacobians with ``jacrev`` of the batch output, whose time and
        memory grow like ``batch^2 * D``: one call of 1000 inputs would penalise it
        (and GLAS's JVPs are linear in the batch either way).
    progress : bool, default=False
        Print one line per finished structure.

    Returns
    -------
    list of ComparisonRow
        One row per structure, failures and skips included.

    """
    if likelihood not in ("regression", "classification"):
        raise ValueError(
            f"likelihood must be 'regression' or 'classification', got {likelihood!r}."
        )
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must lie in (0, 1), got {coverage}.")
    if pred_type not in ("glm", "nn"):
        raise ValueError(f"pred_type must be 'glm' or 'nn', got {pred_type!r}.")
    if predict_batch_size < 1:
        raise ValueError(f"predict_batch_size must be >= 1, got {predict_batch_size}.")
    if structures is None:
        structures = default_structures(glas_k_max, full_max_params)
    model.eval()
    X_test, y_test = _gather(test_loader)
    n_train = _n_data(train_loader)
    if sigma_noise is None:
        if likelihood == "regression":
            X_train, y_train = _gather(train_loader)
            with torch.no_grad():
                sigma_noise = float((model(X_train) - y_train).square().mean().sqrt())
        else:
            sigma_noise = 1.0
    D = sum(p.numel() for p in model.parameters() if p.requires_grad)
    D_last = _last_layer_size(model)
    snapshot = {name: t.detach().clone() for name, t in model.state_dict().items()}

    rows = []
    for structure in structures:
        n_params = D_last if structure.subset_of_weights == "last_layer" else D
        row = ComparisonRow(
            name=structure.name,
            subset_of_weights=structure.subset_of_weights,
            hessian_structure=structure.hessian_structure,
            n_params=n_params,
            level=coverage,
        )
        rows.append(row)
        if structure.max_params is not None and n_params > structure.max_params:
            row.status = "skipped"
            row.error = (
                f"{n_params} parameters > max_params = {structure.max_params} "
                f"(a {n_params} x {n_params} matrix and its log-determinant per marglik step)"
            )
            continue
        probe = PeakMemory()
        row.rss_method = probe.method
        try:
            with probe:
                _run_one(
                    structure,
                    row,
                    model,
                    likelihood,
                    train_loader,
                    calib_loader,
                    X_test,
                    y_test,
                    n_train=n_train,
                    sigma_noise=float(sigma_noise),
                    level=coverage,
                    pred_type=pred_type,
                    n_predict_timing=n_predict_timing,
                    eval_batch=predict_batch_size,
                    progress=progress,
                )
        except Exception as err:  # a failing structure is a result, not a crash
            row.status = "failed"
            row.error = _short(err)
            if progress:
                print(f"[compare] {structure.name}: FAILED ({row.error})", flush=True)
        finally:
            model.load_state_dict(snapshot)
            model.eval()
        row.peak_rss_mb = probe.peak_mb
    return rows


# ---------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """Markdown table of :func:`compare_structures`' rows (one line per structure).

    Regression shows RMSE, classification accuracy (a column appears when any row
    has it). Failed and skipped rows keep their line, with the reason in the notes.
    Times are seconds; ``pred/1000`` is one predictive call scaled to 1000 inputs;
    memory is the peak RSS the structure added (MiB).
    """
    if not rows:
        return ""
    level = rows[0].level
    has_rmse = any(r.rmse is not None for r in rows)
    has_acc = any(r.accuracy is not None for r in rows)
    has_cov_f = any(r.coverage_f is not None for r in rows)
    header = ["structure", "D", "k", "prior prec.", "test NLL"]
    header += ["RMSE"] if has_rmse or not has_acc else []
    header += ["acc."] if has_acc else []
    unit = "set size" if has_acc and not has_rmse else "width"
    header += [f"cov. {level:.0%} (y)"]
    header += [f"cov. {level:.0%} (f)"] if has_cov_f else []
    header += [
        f"mean {unit}",
        "fit [s]",
        "prior opt. [s]",
        "k calib. [s]",
        "pred / 1000 [s]",
        "peak RSS [MiB]",
        "notes",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        k = "–" if r.k is None else (f"{r.k} / {r.k_max}" if r.k_max else str(r.k))
        cells = [r.name, str(r.n_params), k, _fmt(r.prior_precision, ".3g"), _fmt(r.nll, ".3f")]
        cells += [_fmt(r.rmse, ".3f")] if has_rmse or not has_acc else []
        cells += [_fmt(r.accuracy, ".3f")] if has_acc else []
        cells += [_fmt(r.coverage, ".3f")]
        cells += [_fmt(r.coverage_f, ".3f")] if has_cov_f else []
        cells += [
            _fmt(r.mean_width, ".3f"),
            _fmt(r.fit_time, ".3g"),
            _fmt(r.prior_time, ".3g"),
            _fmt(r.calibration_time, ".3g"),
            _fmt(r.predict_time_per_1000, ".3g"),
            _fmt(r.peak_rss_mb, ".0f"),
        ]
        note = r.note
        if r.status != "ok":
            note = f"{r.status.upper()}: {r.error}" + (f"; {note}" if note else "")
        cells.append(note.replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    methods = sorted({r.rss_method for r in rows if r.rss_method})
    if methods:
        lines.append("")
        lines.append(
            f"Peak RSS: {', '.join(methods)} (in-process, per structure). "
            f"Coverage and width of y include sigma^2; k = selected / computed."
        )
    return "\n".join(lines)
