"""``torch.func.functional_call`` that leaves the model as it was, whatever its graph.

GLAS evaluates the network at substituted weights (a JVP's primal, a per-example VJP,
a posterior sample) with :func:`torch.func.functional_call`, which swaps the given
tensors into the module's parameter slots for the call and swaps the originals back
afterwards. For a model that calls one module object at two places
(``nn.Sequential(a, act, a)``) torch's swap-back of the tied aliases (``0.weight`` and
``2.weight`` name one slot) restores the slot twice, the second time with the
substituted tensor: the module keeps a plain tensor (under ``vmap``, a functorch
wrapper) instead of its ``nn.Parameter``, the user's model loses its gradients and every
later transform fails. :func:`module_call` records each module's parameters and buffers
(``named_parameters`` / ``named_buffers`` of the module itself) before the call and sets
back any that the call left changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["module_call"]


def module_call(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor] | tuple[Mapping[str, torch.Tensor], ...],
    args: Any,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """``functional_call(model, tensors, args, kwargs)`` with every parameter and buffer
    slot of ``model`` as it was before the call, also where a module is called twice.

    Parameters
    ----------
    model : torch.nn.Module
        The network (not modified).
    tensors : mapping or tuple of mappings
        The substituted parameters (and buffers), by qualified name, as
        :func:`torch.func.functional_call` takes them.
    args, kwargs :
        The forward pass's arguments.

    Returns
    -------
    Any
        The model's output at the substituted tensors.

    """
    slots = [
        (module, name, value)
        for module in model.modules()
        for members in (module.named_parameters, module.named_buffers)
        for name, value in members(recurse=False, remove_duplicate=False)
    ]
    try:
        return functional_call(model, tensors, args, kwargs)
    finally:
        for module, name, value in slots:
            if getattr(module, name) is not value:
                setattr(module, name, value)  # a Parameter re-registers, a buffer is reset
