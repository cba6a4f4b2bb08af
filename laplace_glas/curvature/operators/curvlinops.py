"""The matrix-free operators of curvlinops for the mean loss, without their determinism probe.

:func:`mean_ggn_operator` is curvlinops' ``GGNLinearOperator`` of a loss (the
reference operator of every fit),

.. math::

    G = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

and :func:`curvlinops_operator` builds it, or the ``EFLinearOperator`` /
``HessianLinearOperator`` that laplace-torch's empirical Fisher and Hessian backends
stand for (:mod:`~laplace_glas.curvature.backends`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from curvlinops import EFLinearOperator, GGNLinearOperator, HessianLinearOperator
from torch import nn

__all__ = ["LossOnData", "curvlinops_operator", "mean_ggn_operator"]

_OPERATORS = {"ggn": GGNLinearOperator, "ef": EFLinearOperator, "hessian": HessianLinearOperator}


@dataclass(frozen=True, eq=False)
class LossOnData:
    """A loss of a network's outputs on data: what curvlinops' curvature operators
    take, and the linearised operators
    (:mod:`~laplace_glas.curvature.operators.linearized`,
    :mod:`~laplace_glas.curvature.operators.relinearized`) with them.

    Attributes
    ----------
    model : nn.Module
        The network (in eval mode, with differentiable kernels).
    loss_func : nn.Module
        The loss of the outputs and targets, with ``reduction`` ``'sum'`` or ``'mean'``.
    params : sequence of torch.Tensor
        The trainable parameters, in the order of the ``D``-vector.
    data : iterable
        ``(X, y)`` batches (``X`` a tensor or a mapping of tensors).
    num_data : int
        What ``reduction='mean'`` divides by (the number of points).
    batch_size_fn : callable or None
        The batch size of an ``X`` (``None``: ``X.shape[0]``).

    """

    model: nn.Module
    loss_func: nn.Module
    params: Sequence[torch.Tensor]
    data: Iterable
    num_data: int
    batch_size_fn: Callable | None = None


def curvlinops_operator(
    kind: str, loss: LossOnData, progress_bar: bool = False
) -> GGNLinearOperator | EFLinearOperator | HessianLinearOperator:
    """Curvlinops' GGN (``kind='ggn'``), empirical Fisher (``'ef'``) or Hessian
    (``'hessian'``) operator of ``loss``, without its determinism probe.

    ``check_deterministic`` is switched off: it costs two gradient passes and two
    products and rejects shuffled loaders; the model must be in eval mode instead. For
    the GGN, ``reduction='mean'`` gives the GGN of the mean loss over ``num_data``
    points and ``reduction='sum'`` that of the summed loss, which the caller scales by
    one over the number of likelihood terms (e.g. tokens) to get the mean-loss GGN.
    """
    if kind not in _OPERATORS:
        raise ValueError(f"kind must be one of {sorted(_OPERATORS)}; got {kind!r}.")
    if kind == "ggn" and getattr(loss.loss_func, "reduction", None) not in ("mean", "sum"):
        raise ValueError("The loss needs a `reduction` attribute, 'mean' or 'sum'.")
    return _OPERATORS[kind](
        loss.model,
        loss.loss_func,
        list(loss.params),
        loss.data,
        progressbar=progress_bar,
        check_deterministic=False,
        num_data=loss.num_data,
        batch_size_fn=loss.batch_size_fn,
    )


def mean_ggn_operator(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
    progress_bar: bool = False,
) -> GGNLinearOperator:
    """Curvlinops' GGN operator of a loss (the reference operator of every fit):
    :func:`curvlinops_operator` with ``kind='ggn'`` on the :class:`LossOnData` of the
    arguments before ``progress_bar``.
    """
    loss = LossOnData(model, loss_func, params, data, num_data, batch_size_fn)
    return curvlinops_operator("ggn", loss, progress_bar)
