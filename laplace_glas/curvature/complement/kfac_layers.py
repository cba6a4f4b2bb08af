"""Which parameters KFAC's Kronecker blocks cover, and how blocks are checked and combined.

``complement='kron'`` needs every trainable parameter in a layer curvlinops' KFAC covers
(:data:`KFAC_LAYERS`: ``nn.Linear``, ``nn.Conv2d``); ``complement='kron_diag'`` takes
KFAC's blocks for the parameters that are (:func:`kfac_parameters`) and leaves an empty
block ``[]`` for every other trainable parameter, whose curvature is the exact GGN
diagonal. One block per trainable parameter tensor, in the order of
``model.parameters()``: ``[B, A]`` for a weight (``K_W = B (x) A``), ``[B]`` for a bias,
``[]`` for a parameter the diagonal covers. Two data sets' factors combine exactly
(:func:`union_of_factors`): ``A`` averages over the examples, ``B`` sums.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from laplace.utils.matrix import Kron
from torch import nn

__all__ = [
    "KFAC_LAYERS",
    "blocks_over",
    "check_kron_factors",
    "kfac_parameters",
    "kron_diag_refusal",
    "kron_refusal",
    "parameter_owners",
    "union_of_factors",
]


KFAC_LAYERS = (nn.Linear, nn.Conv2d)
"""The layers curvlinops' ``KFACLinearOperator`` covers (its documented list)."""


def kron_refusal(model: nn.Module) -> str | None:
    """Why :func:`ggn_kron` cannot serve ``model`` (None: it can): a trainable parameter
    outside the layers curvlinops' KFAC covers (``nn.Linear``, ``nn.Conv2d``). A
    data-parallel fit is served too: the factors are summed over the ranks.
    """
    for owners in parameter_owners(model).values():
        if len(owners) > 1:
            return (
                f"complement='kron' takes each parameter's KFAC block from one layer, and "
                f"{owners[0]!r} and {owners[1]!r} are one tied parameter (its curvature "
                "comes from both uses). Use complement='kron_diag' or 'diag'."
            )
    for name, module in model.named_modules():
        if isinstance(module, KFAC_LAYERS):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                where = f"{name}.{param_name}" if name else param_name
                return (
                    f"complement='kron' needs every trainable parameter in an nn.Linear or "
                    f"nn.Conv2d (the layers KFAC covers); {where!r} sits in a "
                    f"{type(module).__name__}. Use complement='diag', 'zero' or 'prior'."
                )
    return None


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """``id(param) -> [names]``: where modules hold each trainable parameter (two or more
    names: a parameter tied across modules, whose curvature comes from every use).
    """
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                where = f"{name}.{param_name}" if name else param_name
                if where not in owners.setdefault(id(param), []):
                    owners[id(param)].append(where)
    return owners


def kfac_parameters(model: nn.Module) -> list[str]:
    """Names of the trainable parameters held by the layers KFAC covers
    (:data:`KFAC_LAYERS`), in the order of ``model.named_parameters()``; a parameter tied
    across modules is left out (KFAC takes one use of it; the diagonal takes both).
    """
    owners = parameter_owners(model)
    covered = {
        id(param)
        for module in model.modules()
        if isinstance(module, KFAC_LAYERS)
        for param in module.parameters(recurse=False)
        if len(owners.get(id(param), [])) == 1
    }
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) in covered]


def kron_diag_refusal(model: nn.Module) -> str | None:
    """Why ``complement='kron_diag'`` cannot serve ``model`` (None: it can): no trainable
    parameter sits in a layer KFAC covers (the complement would be ``'diag'``'s).
    """
    if kfac_parameters(model):
        return None
    return (
        "complement='kron_diag' takes KFAC's factors for the trainable parameters in an "
        "nn.Linear or nn.Conv2d, and this model has none. Use complement='diag'."
    )


def union_of_factors(stored: Kron, n_stored: int, new: Kron, n_new: int | None) -> Kron:
    """KFAC's factors of the union of two data sets from those of each.

    .. math::

        A = \\frac{N_1 A_1 + N_2 A_2}{N_1 + N_2}, \\qquad B = B_1 + B_2,

    exact, since ``A`` averages the layer inputs' outer products over the examples and
    ``B`` sums the output sensitivities' (both at the same weights): the factors
    ``fit(loader_1); fit(loader_2, override=False)`` stores equal one fit on both.
    Empty blocks (``complement='kron_diag'``) stay empty.
    """
    if n_new is None:
        raise ValueError("Adding KFAC's factors needs the new data's count.")
    if len(stored.kfacs) != len(new.kfacs) or any(
        len(a) != len(b) for a, b in zip(stored.kfacs, new.kfacs)
    ):
        raise ValueError(
            "fit(override=False): KFAC's factors of the new data do not match the stored "
            "fit's blocks (another model layout?): refit with override=True."
        )
    total = n_stored + n_new
    blocks = []
    for old, fresh in zip(stored.kfacs, new.kfacs):
        if not old:
            blocks.append([])
            continue
        B = old[0] + fresh[0].to(old[0])
        if len(old) == 1:
            blocks.append([B])
        else:
            blocks.append([B, (n_stored * old[1] + n_new * fresh[1].to(old[1])) / total])
    return Kron(blocks)


def blocks_over(blocks: list, params: list[torch.Tensor], trainable: list[torch.Tensor]) -> list:
    """``blocks`` over ``params`` laid out over ``trainable`` (``[]`` for the others and for
    the layers the forward pass never called): the layout of ``complement='kron_diag'``.
    """
    by_param = {id(p): block for p, block in zip(params, blocks)}
    return [by_param.get(id(p)) or [] for p in trainable]


def check_kron_factors(
    blocks: Any,
    shapes: list[torch.Size],
    what: str = "the Kronecker factors",
    partial: bool = False,
) -> list[list[torch.Tensor]]:
    """``blocks`` as a list of ``[B, A]`` / ``[B]`` square, symmetric, finite factors
    whose Kronecker sizes are those of ``shapes`` (with ``partial`` also ``[]``: a
    parameter the GGN diagonal covers); a ``ValueError`` naming ``what`` otherwise.
    """
    if not isinstance(blocks, (list, tuple)) or len(blocks) != len(shapes):
        n = len(blocks) if isinstance(blocks, (list, tuple)) else type(blocks).__name__
        raise ValueError(
            f"{what} must hold one block per parameter tensor ({len(shapes)}), got {n}."
        )
    checked = []
    for i, (block, shape) in enumerate(zip(blocks, shapes)):
        if partial and isinstance(block, (list, tuple)) and len(block) == 0:
            checked.append([])
            continue
        if not isinstance(block, (list, tuple)) or len(block) not in (1, 2):
            raise ValueError(f"{what}: block {i} must be [B, A] or [B].")
        size = 1
        for F in block:
            if not isinstance(F, torch.Tensor) or F.ndim != 2 or F.shape[0] != F.shape[1]:
                raise ValueError(f"{what}: block {i} holds a factor that is not a square matrix.")
            if not torch.isfinite(F).all():
                raise ValueError(f"{what}: block {i} holds NaN or inf.")
            largest = float(F.abs().max()) if F.numel() else 0.0
            rounding = math.sqrt(torch.finfo(F.dtype).eps) if F.is_floating_point() else 0.0
            if not torch.allclose(F, F.T, rtol=0.0, atol=rounding * max(largest, 1e-30)):
                raise ValueError(f"{what}: block {i} holds a factor that is not symmetric.")
            size *= F.shape[0]
        if size != math.prod(shape):
            raise ValueError(
                f"{what}: block {i} has Kronecker size {size}, but parameter {i} has "
                f"{math.prod(shape)} entries (shape {tuple(shape)})."
            )
        checked.append(list(block))
    return checked
