"""The data side of ``ActiveSubspaceLaplace.fit``: what the eigen-solve needs to know
about the training data and the loss, apart from the solve itself.

* :func:`loss_at_map`: one pass over the training data that validates it (finite
  inputs, targets and outputs; target shapes; label ranges) and returns laplace-torch's
  loss at the MAP, the number ``N`` of likelihood terms (data points, or tokens that
  are not ``ignore_index``) and the output shape of one point.
* :func:`count_terms`: ``N`` of a loader from its targets alone (for subsamples).
* :func:`curvature_loss`: the loss whose GGN the eigen-solve takes and the factor ``c``
  that turns curvlinops' GGN of that loss into the unit-noise mean-loss GGN

  .. math::

      G_1 = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

  with ``Lambda_n = I`` (regression, unit noise), the softmax Hessian
  ``diag(p_n) - p_n p_n^T`` (classification), or the Hessian in the outputs of a
  user's ``loss_fn``.
* :func:`validate_loss_fn`, :func:`check_loss_fn`, :func:`loss_fn_name`: a user's loss.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.batches import (
    batch_size,
    check_finite,
    check_input_dtype,
    split_batch,
    split_batch_to,
)
from laplace_glas.curvature.data.losses import TokenCrossEntropy, count_targets
from laplace_glas.curvature.data.replay import BatchKeeper, ReplayedBatches
from laplace_glas.progress import progress
from laplace_glas.validation import check_model_output

__all__ = [
    "MapLoss",
    "check_labels",
    "check_loss_fn",
    "count_terms",
    "curvature_loss",
    "likelihood_loss",
    "loss_at_map",
    "loss_fn_name",
    "loss_fn_on",
    "validate_loss_fn",
]


class MapLoss(NamedTuple):
    """What one pass over the training data at the MAP yields."""

    loss: torch.Tensor
    """laplace-torch's loss: ``0.5 * SSE`` (regression) or summed cross-entropy."""
    n_terms: int
    """``N``: data points, or for sequence outputs the targets not ``ignore_index``."""
    out_shape: torch.Size
    """The model output of one data point, e.g. ``(C,)`` or ``(seq_len, vocab)``."""
    first_batch: Any = None
    """The loader's first item as it came (``None`` where not kept): the planner's
    one-batch measurements reuse it rather than start another iterator of the loader."""
    kept: ReplayedBatches | None = None
    """Every item of the pass, where ``keep_bytes`` held them (``None`` otherwise): the
    fit's later passes replay them (:mod:`~laplace_glas.curvature.data.replay`)."""


def likelihood_loss(likelihood: str, reduction: str, ignore_index: int) -> nn.Module:
    """MSE for regression; cross-entropy over the last output axis, without
    ``ignore_index`` targets, for classification (outputs ``(batch, C)`` or
    ``(batch, seq_len, C)``).
    """
    if likelihood == "regression":
        return nn.MSELoss(reduction=reduction)
    return TokenCrossEntropy(reduction=reduction, ignore_index=ignore_index)


@torch.no_grad()
def loss_at_map(
    model: nn.Module,
    loader: Iterable,
    likelihood: str,
    *,
    ignore_index: int = -100,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    loss_fn: nn.Module | None = None,
    progress_bar: bool = False,
    keep_bytes: int = 0,
) -> MapLoss:
    """One pass: validate the data and sum laplace-torch's loss at the model's weights.

    The loss is ``0.5 * sum ||f_n - y_n||^2`` for regression and
    ``sum_n -log softmax(f_n)[y_n]`` for classification. ``loss_fn`` (if given) is
    tried on the first batch so that a loss that cannot take these outputs fails
    here, with the shapes in the message, rather than inside curvlinops. The items
    are kept (``MapLoss.kept``) where all of them take at most ``keep_bytes``.
    """
    lossfunc = likelihood_loss(likelihood, "sum", ignore_index)
    factor = 0.5 if likelihood == "regression" else 1.0
    total = torch.zeros((), device=device, dtype=dtype)
    n_terms, n_points, out_shape, first_batch = 0, 0, None, None
    keeper = BatchKeeper(keep_bytes)
    batches = progress(loader, "[GLAS] loss at MAP", progress_bar)
    for i, data in enumerate(batches):
        if i == 0:
            first_batch = data  # kept for the planner's one-batch checks
        keeper.add(data)
        X, y = split_batch_to(data, device, dict_key_y)
        check_finite("The training inputs", X, i)
        check_input_dtype("The training inputs", X, dtype, i)
        check_finite("The training targets", y, i)
        with autodiff_friendly(model):
            out = check_model_output(model(X))
        check_finite("The model output", out, i)
        if i == 0 and loss_fn is not None:
            check_loss_fn(loss_fn_on(loss_fn, device, dtype), out, y)
        if likelihood == "regression":
            if not y.is_floating_point():
                raise TypeError(
                    f"Regression targets must be floating point, got {y.dtype} (batch {i}): "
                    "convert them with y.float() (or use likelihood='classification' for "
                    "class labels)."
                )
            if out.ndim != 2:
                raise ValueError(
                    "Regression needs model outputs of shape (batch, outputs), got "
                    f"{tuple(out.shape)} (batch {i}): return (batch, 1) for a scalar "
                    "target, and flatten sequence or image outputs in the model."
                )
            if y.shape != out.shape:
                raise ValueError(
                    f"Regression targets of shape {tuple(y.shape)} do not match the "
                    f"model output of shape {tuple(out.shape)} (batch {i})."
                )
            n_terms += batch_size(X, dict_key_x)
        else:
            n_terms += check_labels(out, y, ignore_index, i)
        total += factor * lossfunc(out, y).to(dtype)
        n_points += batch_size(X, dict_key_x)
        out_shape = out.shape[1:]
    if n_points == 0:
        raise ValueError("The training loader is empty: there is no data to fit.")
    if n_terms == 0:
        raise ValueError("Every training target equals ignore_index: nothing to fit.")
    return MapLoss(total, n_terms, out_shape, first_batch, keeper.kept())


def check_labels(out: torch.Tensor, y: torch.Tensor, ignore_index: int, batch_index: int) -> int:
    """Validate class labels against the outputs; return the number of targets."""
    if out.ndim not in (2, 3):
        raise ValueError(
            "Classification needs model outputs of shape (batch, classes) or "
            f"(batch, seq_len, classes); got {tuple(out.shape)}."
        )
    if out.shape[-1] < 2:
        raise ValueError(
            "Classification needs at least 2 logits per target (softmax over classes); "
            f"the model outputs {out.shape[-1]}. For a binary problem output 2 logits."
        )
    if y.shape != out.shape[:-1] or y.is_floating_point():
        raise ValueError(
            "Classification targets must be integer class labels of shape (batch,) "
            "for outputs (batch, classes), or (batch, seq_len) for outputs "
            f"(batch, seq_len, classes); expected {tuple(out.shape[:-1])}, got "
            f"{tuple(y.shape)} of dtype {y.dtype} (batch {batch_index})."
        )
    valid = y[y != ignore_index]
    if valid.numel() and (valid.min() < 0 or valid.max() >= out.shape[-1]):
        raise ValueError(
            f"Class labels must lie in [0, {out.shape[-1] - 1}] (batch {batch_index})."
        )
    return int(valid.numel())


def count_terms(
    loader: Iterable,
    likelihood: str,
    ignore_index: int = -100,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
) -> int:
    """Likelihood terms in ``loader`` (targets only, no forward pass)."""
    n = 0
    for data in loader:
        X, y = split_batch(data, dict_key_y)
        if likelihood == "regression":
            n += batch_size(X, dict_key_x)
        else:
            n += count_targets(y, ignore_index)
    return n


def curvature_loss(
    likelihood: str,
    n_terms: int,
    out_shape: torch.Size,
    *,
    ignore_index: int = -100,
    loss_fn: nn.Module | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, float, int]:
    """The loss for curvlinops' ``GGNLinearOperator``, the factor ``c`` with
    ``G_1 = c * GGN(loss)``, and the ``num_data`` to give curvlinops.

    * ``loss_fn``: the user's summed loss over the ``N`` terms, ``c = 1/N``.
    * regression: ``MSELoss(reduction='mean')`` also averages over the ``C`` outputs
      and drops the factor 1/2, so its GGN is ``2/(N C) sum_n J_n^T J_n``; ``c = C/2``.
    * classification: summed cross-entropy over the ``N`` targets (tokens), ``c = 1/N``
      (curvlinops does not use ``num_data`` with ``reduction='sum'``).
    """
    if loss_fn is not None:
        return loss_fn_on(loss_fn, device, dtype), 1.0 / n_terms, n_terms
    if likelihood == "regression":
        return likelihood_loss(likelihood, "mean", ignore_index), out_shape.numel() / 2.0, n_terms
    return likelihood_loss(likelihood, "sum", ignore_index), 1.0 / n_terms, n_terms


def loss_fn_name(loss_fn: nn.Module | None) -> str:
    """A marker of ``loss_fn`` for the saved state (``''`` for the likelihood's loss)."""
    return "" if loss_fn is None else type(loss_fn).__qualname__


def loss_fn_on(loss_fn: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """A copy of ``loss_fn`` with its buffers on ``device`` in ``dtype`` (the user's
    module is left untouched).
    """
    return copy.deepcopy(loss_fn).to(device, dtype)


def validate_loss_fn(loss_fn: Any, ignore_index: int | None) -> None:
    """``loss_fn`` must be a summed loss module (curvlinops calls it functionally) that
    leaves out the same targets as GLAS's count N (``ignore_index=None``: regression,
    nothing to compare).
    """
    if loss_fn is None:
        return
    if not isinstance(loss_fn, nn.Module):
        raise TypeError(
            "loss_fn must be a torch.nn.Module (curvlinops evaluates it functionally), "
            f"got {type(loss_fn).__name__}."
        )
    reduction = getattr(loss_fn, "reduction", None)
    if reduction != "sum":
        raise ValueError(
            f"loss_fn must sum over the targets (reduction='sum'), got reduction="
            f"{reduction!r}: GLAS divides by the number N of likelihood terms itself, "
            "e.g. pass nn.CrossEntropyLoss(reduction='sum')."
        )
    own = getattr(loss_fn, "ignore_index", None)
    if ignore_index is not None and own is not None and own != ignore_index:
        raise ValueError(
            f"loss_fn ignores targets equal to {own} but GLAS's ignore_index is "
            f"{ignore_index}: the GGN and the count N would disagree on which targets "
            "are padding. Give both the same value."
        )


def check_loss_fn(loss_fn: nn.Module, out: torch.Tensor, y: torch.Tensor) -> None:
    """``loss_fn`` evaluates to a scalar on the first batch (clear error if not)."""
    try:
        value = loss_fn(out, y)
    except Exception as err:
        raise ValueError(
            f"loss_fn failed on the first training batch (model outputs "
            f"{tuple(out.shape)}, targets {tuple(y.shape)}): {err}"
        ) from err
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
        raise ValueError(f"loss_fn must return a scalar (the summed loss), got {shape}.")
