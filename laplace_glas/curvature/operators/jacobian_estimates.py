"""The planner's estimates of the stored Jacobians' memory
(:mod:`~laplace_glas.curvature.operators.stored_jacobian`), made before any pass over the data:
the rows the build stores, ``N R D itemsize`` bytes, and one batch's build beside them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from laplace_glas.curvature.operators.factored import unsupported_reason

__all__ = ["estimate_build_bytes", "estimate_jacobian_bytes", "jacobian_bytes"]


def jacobian_bytes(n_examples: int, n_rows: int, n_params: int, itemsize: int) -> int:
    """Bytes of the stored Jacobians: ``N R D itemsize``."""
    return int(n_examples) * int(n_rows) * int(n_params) * int(itemsize)


def estimate_build_bytes(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    likelihood: str,
    out_shape: Sequence[int],
    graph: int,
    largest_batch: int,
    itemsize: int,
) -> int:
    """The planner's estimate of one batch's build temporaries beside the stored rows.

    Both routes hold the largest batch's rows, ``B R D s`` for ``B`` examples (``R``
    rows per example, as :func:`estimate_jacobian_bytes`), until they are copied into
    the stored ones. Beside them, the factored route takes ``6 g`` for a forward graph
    of ``g`` bytes (the batch's factors, graph and backward pass; 5.6 g measured on
    GPT-2); the ``torch.func`` route's ``vmap(jacrev)`` differentiates all
    ``O = prod(out_shape)`` outputs of every example at once, ``O g`` for its backward
    pass beside the batch's full Jacobian, ``B O D s`` (a transformer scored per token,
    ``O = 128``, measured 1.4-1.7 times its rows where ``6 g`` was counted).
    """
    D = sum(p.numel() for p in params)
    example_rows = estimate_jacobian_bytes(1, out_shape, likelihood, D, itemsize, n_examples=1)
    if unsupported_reason(model, params, likelihood) is None:
        return 6 * graph + largest_batch * example_rows
    outputs = 1
    for size in out_shape:
        outputs *= int(size)
    full = outputs * D * itemsize  # an example's full Jacobian
    return max(6 * graph, outputs * graph + largest_batch * full) + largest_batch * example_rows


def estimate_jacobian_bytes(
    n_terms: int,
    out_shape: Sequence[int],
    likelihood: str,
    n_params: int,
    itemsize: int,
    n_examples: int | None = None,
) -> int:
    """The planner's estimate of :func:`jacobian_bytes` before any pass over the data:
    ``R`` rows per example, those the build stores (``prod(out_shape)`` for
    regression, ``P (C - 1)`` for softmax cross-entropy over ``P`` positions of ``C``
    classes), and ``N`` examples: ``n_examples`` where the loader's sizes are known,
    else ``n_terms`` (for an output of ``P`` positions with classification, at least
    ``n_terms / P``: padded targets make it more).
    """
    R = 1
    for size in out_shape:
        R *= int(size)
    C = int(out_shape[-1]) if len(out_shape) else 1
    positions = max(1, R // max(1, C))
    if likelihood == "classification" and C >= 2:
        R = positions * (C - 1)
    if n_examples is None:
        n_examples = int(n_terms)
        if likelihood == "classification" and len(out_shape) > 1:
            n_examples = -(-int(n_terms) // positions)
    return jacobian_bytes(n_examples, R, n_params, itemsize)
