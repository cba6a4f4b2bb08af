"""The matrix-free operators of curvlinops for the mean loss, without their determinism probe.

:func:`mean_ggn_operator` is curvlinops' ``GGNLinearOperator`` of a loss (the
reference operator of every fit),

.. math::

    G = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

and :func:`curvlinops_operator` the ``EFLinearOperator`` / ``HessianLinearOperator`` that
laplace-torch's empirical Fisher and Hessian backends stand for
(:mod:`~laplace_glas.curvature.backends`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from curvlinops import EFLinearOperator, GGNLinearOperator, HessianLinearOperator
from torch import nn

__all__ = ["curvlinops_operator", "mean_ggn_operator"]

_OPERATORS = {"ef": EFLinearOperator, "hessian": HessianLinearOperator}


def mean_ggn_operator(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
    progress_bar: bool = False,
) -> GGNLinearOperator:
    """Curvlinops' GGN operator of a loss, without its determinism probe.

    ``reduction='mean'`` gives the GGN of the mean loss over ``num_data`` points;
    ``reduction='sum'`` the GGN of the summed loss, which the caller scales by one
    over the number of likelihood terms (e.g. tokens) to get the mean-loss GGN.
    ``check_deterministic`` is switched off: it costs two gradient passes and two
    products and rejects shuffled loaders; the model must be in eval mode instead.
    """
    if getattr(loss_func, "reduction", None) not in ("mean", "sum"):
        raise ValueError("The loss needs a `reduction` attribute, 'mean' or 'sum'.")
    return GGNLinearOperator(
        model,
        loss_func,
        list(params),
        data,
        progressbar=progress_bar,
        check_deterministic=False,
        num_data=num_data,
        batch_size_fn=batch_size_fn,
    )


def curvlinops_operator(
    kind: str,
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    data: Iterable,
    num_data: int,
    batch_size_fn: Callable | None = None,
) -> EFLinearOperator | HessianLinearOperator:
    """The empirical Fisher (``kind='ef'``) or Hessian (``'hessian'``) operator of
    curvlinops for ``loss_func``, without its determinism probe.
    """
    return _OPERATORS[kind](
        model,
        loss_func,
        list(params),
        data,
        check_deterministic=False,
        num_data=num_data,
        batch_size_fn=batch_size_fn,
    )
