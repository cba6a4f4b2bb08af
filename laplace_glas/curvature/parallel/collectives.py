"""Collectives after a data-parallel fit: the calibration's coverage rows and the
prior-precision grid search over every rank's held-out shard.

Each rank scores the candidates on its shard; the means over the whole held-out set
are ``sum_r n_r m_r / sum_r n_r``, from one all-reduce per sweep that also carries one
failure flag per rank (:func:`~laplace_glas.curvature.parallel.distributed.flagged_sum`): a rank
whose scoring fails (its loader raises, its targets are NaN, ...) raises its error and
the others a ``RuntimeError`` naming it, instead of waiting for it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torchmetrics
from laplace.utils.utils import validate

from laplace_glas.curvature.parallel.distributed import Shards, flagged_sum

__all__ = ["gridsearch", "reduce_coverage_rows"]


def _not_distributed() -> bool:
    """A torchmetrics ``distributed_available_fn`` that sees no process group."""
    return False


def reduce_coverage_rows(
    rows: Sequence[Any] | None,
    n_local: int,
    shards: Shards | None,
    device: torch.device | str = "cpu",
    *,
    n_rows: int | None = None,
    error: Exception | None = None,
) -> list[Any]:
    """Coverage rows of the whole calibration set from every rank's rows.

    Each row's ``coverage``, ``mean_width`` and ``nll`` are means over the ``n_r``
    scored targets of rank ``r``; the global mean is ``sum_r n_r m_r / sum_r n_r``
    (one all-reduce of ``3 * len(rows) + 3 + W`` float64). The rows (candidates) must
    be the same on every rank. ``error``: scoring failed on this rank (``rows`` is
    ``None``; ``n_rows`` gives their number); raised on every rank (a ``RuntimeError``
    naming it on the others).
    """
    if shards is None:
        if error is not None:
            raise error
        return list(rows)
    if error is not None:
        local = torch.zeros(n_rows + 1, 3, dtype=torch.float64)
    else:
        local = torch.tensor(
            [[n_local * r.coverage, n_local * r.mean_width, n_local * r.nll] for r in rows]
            + [[float(n_local), 0.0, 0.0]],
            dtype=torch.float64,
        )
    step = "scoring the calibration's coverage"
    total = flagged_sum(local.to(device), shards, error=error, step=step).cpu()
    n = float(total[-1, 0])
    return [
        replace(r, coverage=float(t[0]) / n, mean_width=float(t[1]) / n, nll=float(t[2]) / n)
        for r, t in zip(rows, total[:-1], strict=True)
    ]


def _local_grid(
    la: Any, interval: Sequence[Any], val_loader: Any, loss: Any, **kwargs: Any
) -> tuple[list[float], int]:
    """The validation losses ``m_r(tau)`` of this rank over the grid and its ``n_r``.

    A torchmetrics ``loss`` is scored on a copy that does not synchronise over the
    process group (its ``compute`` would otherwise gather the ranks' states itself: a
    collective that a rank whose scoring failed never joins).
    """
    if isinstance(loss, torchmetrics.Metric):
        loss = copy.deepcopy(loss)
        # public attributes only: the constructor's ``sync_on_compute`` and
        # ``distributed_available_fn`` (compute's sync returns early without a group)
        loss.sync_on_compute, loss.distributed_available_fn = False, _not_distributed
    results = []
    for tau in interval:
        la.prior_precision = tau
        try:
            results.append(
                float(validate(la, val_loader, loss, dict_key_y=la.dict_key_y, **kwargs))
            )
        except np.linalg.LinAlgError:  # laplace-torch's handling of a failed grid point
            results.append(float("inf"))
        except RuntimeError as err:
            if "not positive definite" not in str(err):
                raise
            results.append(float("inf"))
    n_local = 0
    for data in val_loader:
        y = data[la.dict_key_y] if isinstance(data, MutableMapping) else data[1]
        n_local += int(y.shape[0])
    return results, n_local


def gridsearch(
    la: Any,
    shards: Shards,
    loss: Any,
    interval: Sequence[Any],
    val_loader: Any,
    pred_type: Any,
    link_approx: Any,
    n_samples: int,
    check: Callable[[], None] | None = None,
) -> Any:
    """laplace-torch's prior-precision grid search over every rank's validation shard.

    Each rank scores every prior precision ``tau`` with laplace-torch's ``validate`` on
    its shard (``m_r(tau)``, a mean over its ``n_r`` points); the grid's losses
    ``sum_r n_r m_r(tau) / sum_r n_r`` come from one all-reduce of ``len(interval) + 1
    + W`` float64, so every rank picks the same ``tau``. ``loss`` must be a mean over
    the validation points (laplace-torch's defaults, MSE and NLL, are). ``check``: this
    rank's checks of its shard, run first; a failure there or in the scoring is raised
    on every rank (a ``RuntimeError`` naming the rank on the others).
    """
    error, local = None, torch.zeros(len(interval) + 1, dtype=torch.float64)
    try:
        if check is not None:
            check()
        results, n_local = _local_grid(
            la,
            interval,
            val_loader,
            loss,
            pred_type=pred_type,
            link_approx=link_approx,
            n_samples=n_samples,
        )
        local = torch.tensor([*(n_local * r for r in results), n_local], dtype=torch.float64)
    except Exception as err:
        error = err
    step = "scoring the grid search's validation shard"
    total = flagged_sum(local.to(la.posterior.device), shards, error=error, step=step).cpu()
    means = total[:-1] / total[-1]
    return interval[int(torch.argmin(means))]
