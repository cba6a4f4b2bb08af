"""Backward graphs that keep only what their derivative in the cotangent reads.

The linearised GGN (:mod:`~laplace_glas.curvature.operators.linearized`) builds
``J_b^T u`` with ``create_graph=True`` once per batch and differentiates it in the dummy
cotangent ``u`` alone, for every product:

.. math::

    J_b v = \\frac{\\partial \\langle J_b^\\top u, v \\rangle}{\\partial u} .

Recording the backward pass, autograd saves for each of its ops the operands that the
derivative in *any* input needs. For a weight gradient ``grad_W = g^T x`` it keeps
``x`` (for the derivative in the output gradient ``g``) and ``g`` (for the derivative
in ``x``). The tensors that depend on ``u`` (the gradients flowing back, and what is
computed from them) serve only derivatives in the op's other inputs: ``J_b^T u`` is
linear in ``u``, so no op of its graph multiplies two tensors that both depend on
``u``, and an op's derivative in its ``u``-dependent input reads only the operands
that do not. A derivative in ``u`` never computes the others: autograd evaluates an
op's derivative only along edges that lead to the requested input. Those saved
tensors are never read; inside :func:`cotangent_free_saving` they are not kept.

Autograd still *unpacks* every saved tensor of an op it runs, also the ones the
requested derivatives do not read, so a dropped tensor unpacks as a zero-stride zero
of its shape, dtype and device (no memory). The callers check the result once
(``<u, J v> = <J^T u, v>`` on the first batch, which a dropped operand that was read
after all would fail) and build without dropping where it fails.

On GPT-2 with LoRA over tokens (``benchmarks/scale.py --cases lora-tokens``) one batch's
kept graphs shrank from 97 to 54 MiB, with ``J v`` bit for bit the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["cotangent_free_saving"]


class _Dropped:
    """A saved tensor not kept: its shape, dtype and device."""

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, tensor: torch.Tensor):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device

    def unpacked(self) -> torch.Tensor:
        """A zero of the saved tensor's shape with zero strides (no memory)."""
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)


class _Reaches:
    """Whether an autograd node's graph reaches the leaf ``target`` (memoised over the
    nodes seen, iteratively: a recurrent network's graph may be deeper than Python's
    recursion allows).
    """

    def __init__(self, target: torch.Tensor):
        self.target = target
        self.memo: dict[Any, bool] = {}

    def _is_target(self, node: Any) -> bool:
        return getattr(node, "variable", None) is self.target

    def __call__(self, start: Any) -> bool:
        memo = self.memo
        stack = [start]
        while stack:
            node = stack[-1]
            if node in memo:
                stack.pop()
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            pending = [child for child in children if child not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[node] = self._is_target(node) or any(memo[child] for child in children)
            stack.pop()
        return memo[start]


@contextlib.contextmanager
def cotangent_free_saving(
    cotangent: torch.Tensor,
    pack: Callable[[torch.Tensor], Any] = lambda tensor: tensor,
    on_drop: Callable[[torch.Tensor], None] | None = None,
) -> Iterator[None]:
    """A context for recording a backward pass whose graph is differentiated in
    ``cotangent`` only (see the module): saved tensors that depend on ``cotangent`` are
    not kept, the others go through ``pack`` (default: kept as they are). The nodes
    seen while deciding are let go on exit (the graph's saved tensors hold the hooks).

    Parameters
    ----------
    cotangent : torch.Tensor
        The leaf ``u`` (``requires_grad=True``) that the backward pass starts from.
    pack : callable, optional
        The pack hook for the tensors kept (e.g. one that counts their bytes); its
        results unpack as they are.
    on_drop : callable, optional
        Called with each tensor not kept (e.g. to count them).

    """
    reaches = _Reaches(cotangent)

    def pack_hook(tensor: torch.Tensor) -> Any:
        if tensor.grad_fn is not None and reaches(tensor.grad_fn):
            if on_drop is not None:
                on_drop(tensor)
            return _Dropped(tensor)
        return pack(tensor)

    def unpack_hook(saved: Any) -> Any:
        return saved.unpacked() if isinstance(saved, _Dropped) else saved

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
            yield
    finally:
        reaches.memo.clear()
