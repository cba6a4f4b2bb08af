"""Backward graphs recorded at a zero cotangent, without the saved tensors that are zero.

The linearised GGN (:mod:`~laplace_glas.curvature.operators.linearized`) builds
``J_b^T u`` with ``create_graph=True`` once per batch, at a dummy cotangent ``u = 0``,
and differentiates it in ``u`` for every product:

.. math::

    J_b v = \\frac{\\partial \\langle J_b^\\top u, v \\rangle}{\\partial u} .

Recording the backward pass, autograd saves for each of its ops the operands that the
derivative in *any* input needs. For a weight gradient ``grad_W = g^T x`` it keeps
``x`` (for the derivative in the output gradient ``g``) and ``g`` (for the derivative
in ``x``). The gradients flowing back, and what the backward pass computes from them,
are linear in ``u``: at ``u = 0`` they are exactly zero. Inside
:func:`zero_free_saving` a saved tensor that is zero in every element is not kept;
autograd unpacks it as a zero-stride zero of its shape, dtype and device (no memory),
which is its value, so every derivative computed from the graph is the one the whole
graph gives (to the sign of a zero). Only the decision reads the tensor (one pass over
it while the backward pass records); nothing depends on why it is zero.

On GPT-2 with LoRA over tokens (``benchmarks/scale.py --cases lora-tokens``) one batch's
saved tensors shrank from 97 to 51 MiB, its forward graph alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["zero_free_saving"]


class _Zero:
    """A saved tensor not kept, because all of it is zero: its shape, dtype and device."""

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device

    def unpacked(self) -> torch.Tensor:
        """A zero of the saved tensor's shape with zero strides (no memory)."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)


def _all_zero(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor whose every element is zero (a NaN is
    not zero; sparse, meta and subclassed tensors are kept as they are).
    """
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return False
    if tensor.layout != torch.strided or tensor.is_meta:
        return False
    return not bool(tensor.any())


@contextlib.contextmanager
def zero_free_saving(
    pack: Callable[[torch.Tensor], Any] = lambda tensor: tensor,
    on_zero: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[None]:
    """A context for recording a backward pass at a zero cotangent (see the module):
    saved tensors that are zero in every element are not kept (they unpack as
    zero-stride zeros), the others go through ``pack`` (default: kept as they are).

    Parameters
    ----------
    pack : callable, optional
        The pack hook for the tensors kept (e.g. one that counts their bytes); its
        results unpack as they are.
    on_zero : callable, optional
        Called with each tensor not kept (e.g. to count them).

    """

    def pack_hook(tensor: torch.Tensor) -> Any:
        if _all_zero(tensor):
            if on_zero is not None:
                on_zero(tensor)
            return _Zero(tensor)
        return pack(tensor)

    def unpack_hook(saved: Any) -> Any:
        return saved.unpacked() if isinstance(saved, _Zero) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
        yield
