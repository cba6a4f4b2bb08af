"""Joining the batches' recorded factors of the factored GGN into one factor per layer.

A batch's forward pass (:mod:`~laplace_glas.curvature.operators.factors`) records, per
layer and call, tuples ``(kind, offset, a, g, ...)``; here a layer's calls are merged
along the positions axis (a layer called ``T`` times per example), the batches are
concatenated along the example axis (positions zero-padded to the longest), and the
result is assembled into :class:`~laplace_glas.curvature.operators.factors.OuterFactor`,
:class:`~laplace_glas.curvature.operators.factors.EmbeddingFactor` and
:class:`~laplace_glas.curvature.operators.factors.ExplicitFactor`. The sizes helpers
(``factor_bytes``, ``layer_factor_bytes``, ``widest_product_columns``) feed the memory budget.
"""

from __future__ import annotations

import torch

from laplace_glas.curvature.operators.factors import (
    EmbeddingFactor,
    ExplicitFactor,
    OuterFactor,
    explicit_rows_numel,
)

__all__ = [
    "assemble_factors",
    "concatenate_batches",
    "factor_bytes",
    "layer_factor_bytes",
    "widest_product_columns",
]


def _merge_calls(calls: list) -> tuple:
    """Several calls of one module: concatenate the positions (axis ``T``)."""
    if len(calls) == 1:
        return calls[0]
    kind, off = calls[0][:2]
    if kind == "outer":
        a = torch.cat([c[2] for c in calls], 1)
        return kind, off, a, torch.cat([c[3] for c in calls], 2), calls[0][4]
    return (
        kind,
        off,
        calls[0][2],
        torch.cat([c[3] for c in calls], 1),
        torch.cat([c[4] for c in calls], 2),
    )


def _call_positions(calls: list) -> int | None:
    """The positions ``T_c`` shared by every call in ``calls`` (None if they differ)."""
    sizes = {c[2].shape[1] for c in calls}
    return sizes.pop() if len(sizes) == 1 else None


def assemble_factors(layers: dict, explicit: list, positions: dict | None = None) -> list:
    """Factor objects of one batch (or of the concatenated batches, whose calls'
    ``positions`` per module the caller gives).
    """
    factors = []
    for module, calls in layers.items():
        merged = _merge_calls(calls)
        if merged[0] == "outer":
            T = _call_positions(calls) if positions is None else positions[module]
            factors.append(
                OuterFactor(merged[1], merged[2].contiguous(), merged[3].contiguous(), merged[4], T)
            )
        else:
            factors.append(EmbeddingFactor(merged[1], merged[2], merged[3], merged[4].contiguous()))
    if explicit:
        summed: dict[int, torch.Tensor] = {}
        for off, J in explicit:  # repeated calls of one module add up
            summed[off] = summed[off] + J if off in summed else J
        offs = sorted(summed)
        J = torch.cat([summed[o] for o in offs], dim=-1)
        index = torch.cat([torch.arange(o, o + summed[o].shape[-1]) for o in offs]).to(J.device)
        factors.append(ExplicitFactor(index, J.contiguous()))
    return factors


def factor_bytes(layers: dict, explicit: list) -> int:
    """Bytes of one batch's factors: every layer's (:func:`layer_factor_bytes`) and the
    explicit Jacobian blocks.
    """
    total = sum(J.numel() * J.element_size() for _, J in explicit)
    return total + sum(layer_factor_bytes(calls) for calls in layers.values())


def layer_factor_bytes(calls: list) -> int:
    """Bytes of one layer's factors (all its calls), with the explicit Jacobian rows its
    products will form where they pay
    (:meth:`~laplace_glas.curvature.operators.factors.OuterFactor.explicit_rows`).
    """
    stored = sum(
        t.numel() * t.element_size() for c in calls for t in c if isinstance(t, torch.Tensor)
    )
    if calls[0][0] != "outer":
        return stored
    a, g, bias = calls[0][2], calls[0][3], calls[0][4] is not None
    T = sum(c[2].shape[1] for c in calls)
    (N, d_in), (R, d_out) = (a.shape[0], a.shape[-1]), (g.shape[1], g.shape[-1])
    return stored + explicit_rows_numel(N, T, d_in, d_out, R, bias) * a.element_size()


def widest_product_columns(layers: dict) -> int:
    """Largest ``B T d_out`` of a weight layer: numbers per column of a product's GEMM."""
    widest = 1
    for calls in layers.values():
        for c in calls:
            if c[0] == "outer":
                widest = max(widest, c[2].shape[0] * c[2].shape[1] * c[3].shape[-1])
    return widest


def _pad_positions(tensors: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
    """Zero-pad the position axis to the longest batch (sequences of varying length)."""
    T = max(t.shape[axis] for t in tensors)
    out = []
    for t in tensors:
        if t.shape[axis] < T:
            shape = list(t.shape)
            shape[axis] = T - t.shape[axis]
            t = torch.cat([t, t.new_zeros(shape)], axis)
        out.append(t)
    return out


def concatenate_batches(all_layers: dict, all_explicit: list, release=lambda: None) -> list:
    """Join the batches' factors along the example axis (emptying ``all_layers``, so
    that the peak is the factors plus one layer's, not twice the factors; ``release()``
    runs after each layer, once its batches are freed).
    """
    layers, positions = {}, {}
    for module in list(all_layers):  # popped: each layer's batches are freed once joined
        per_batch = all_layers.pop(module)
        if per_batch[0][0][0] == "outer":
            positions[module] = _call_positions([c for calls in per_batch for c in calls])
        merged = [_merge_calls(calls) for calls in per_batch]
        kind, off = merged[0][:2]
        if kind == "outer":
            a = torch.cat(_pad_positions([m[2] for m in merged], 1))
            g = torch.cat(_pad_positions([m[3] for m in merged], 2))
            layers[module] = [(kind, off, a, g, merged[0][4])]
        else:
            idx = torch.cat(_pad_positions([m[3] for m in merged], 1))
            g = torch.cat(_pad_positions([m[4] for m in merged], 2))
            layers[module] = [(kind, off, merged[0][2], idx, g)]
        del merged, per_batch
        release()
    factors = assemble_factors(layers, [], positions)
    if all_explicit and all_explicit[0]:
        per_batch = [assemble_factors({}, e)[0] for e in all_explicit]
        factors.append(ExplicitFactor(per_batch[0].index, torch.cat([f.J for f in per_batch])))
    return factors
