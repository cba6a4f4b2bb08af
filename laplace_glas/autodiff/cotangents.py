"""Backward graphs recorded at a zero cotangent, without the saved tensors that are zero.

The linearised GGN (:mod:`~laplace_glas.curvature.operators.linearized`) builds
``J_b^T u`` with ``create_graph=True`` once per batch, at a dummy cotangent ``u = 0``,
and differentiates it in ``u`` for every product:

.. math::

    J_b v = \\frac{\\partial \\langle J_b^\\top u, v \\rangle}{\\partial u} .

Recording the backward pass, autograd saves for each of its ops the operands that the
derivative in *any* input needs. For a weight gradient ``grad_W = g^T x`` it keeps
``x`` (for the derivative in the output gradient ``g``) and ``g`` (for the derivative
in ``x``). The gradients flowing back are linear in ``u``, so at ``u = 0`` they are
exactly zero (other saved tensors may be zero too: an all-false mask, zero indices, a
zero LoRA factor). Inside :func:`zero_free_saving` a saved tensor that is zero in every
element, at the moment it is saved, is not kept; autograd unpacks it as a zero-stride
zero of its shape, dtype and device (no memory: a view of a zero scalar made when it
was saved, so that an unpacking allocates nothing; an LSTM tagger's products
0.35 -> 0.33 s against a fresh scalar each time), which is that value, so the
derivatives computed from the graph are the whole graph's (to the sign of a zero).
Only the decision reads the tensor, once, while the backward pass records; nothing
depends on why it is zero. Two differences remain, both outside what autograd allows
or assumes: a saved tensor written in place after it was saved (which autograd refuses
without hooks) keeps its value at saving, and custom code that reads a saved tensor's
memory layout (``as_strided``, raw pointers) sees zero strides. The test reads each
saved tensor once (on a GPU, a synchronisation each, while the batch is linearised).

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
    """A saved tensor not kept, because all of it is zero: its shape and a zero scalar
    of its dtype and device, made when it is saved.
    """

    __slots__ = ("scalar", "shape")

    def __init__(self, tensor: torch.Tensor):
        self.shape = tensor.shape
        self.scalar = torch.zeros((), dtype=tensor.dtype, device=tensor.device)

    def unpacked(self) -> torch.Tensor:
        """A zero of the saved tensor's shape with zero strides (no memory): a view of
        this tensor's own scalar, so that an unpacking allocates nothing. Like any
        saved tensor it is its graph's: custom code that writes to it (``fill_``
        and the like are allowed on such views) changes it for later passes, and for
        no other saved tensor.
        """
        return self.scalar.expand(self.shape)


def _all_zero(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor whose every element is zero (a NaN is
    not zero). Tensor subclasses (also wrapped in a parameter), sparse, nested,
    quantized and meta tensors are kept as they are.
    """
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if tensor.layout != torch.strided or tensor.is_meta or tensor.is_nested:
        return False
    if tensor.is_quantized:
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
