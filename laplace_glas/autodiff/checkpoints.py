"""Reentrant activation checkpointing in the forward passes GLAS differentiates.

A GGN built by reverse mode sees a parameter only through the autograd graph of the
model's output. Reentrant activation checkpointing
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``) runs its segment
without gradients and recomputes it in the backward pass only where one of the
segment's inputs needs a gradient. Where none does (a network's first segment, whose
input is the data; adapters inside a segment on a frozen base), the segment's
parameters are left out of the graph, and their curvature came out as zero without an
error. Measured on a 3-8 tanh layer under such a segment, then an elementwise scale and
an 8-1 layer (64 regression points, the linearised operator, float64): the summed GGN's
top eigenvalues 127.8, 40.6, 26.8 against 146.8, 56.2, 41.6, the only sign torch's
warning "None of the inputs have requires_grad=True". Where an input does need a
gradient, ``torch.autograd.grad`` refuses the segment itself. Non-reentrant
checkpointing (``use_reentrant=False``) runs the segment with gradients and is
differentiated exactly.

:func:`watch_reentrant_checkpoints` counts such segments while a differentiated forward
pass runs (torch's ``check_backward_validity``, which the reentrant checkpoint calls with
the segment's inputs, is wrapped for the block; the warning itself is left to torch);
the operator then calls :meth:`CheckpointWatch.check` with the fitted parameters the pass
left without a graph, which raises :class:`GradientsDisabledError` naming them when a
segment ran without gradients. Parameters a model does not use, and segments that hold
no fitted parameter (a frozen, checkpointed backbone), raise nothing. The wrapper is
process-wide: a segment another thread runs meanwhile is counted too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

__all__ = [
    "CheckpointWatch",
    "GradientsDisabledError",
    "outside_posterior",
    "watch_reentrant_checkpoints",
]

_OUTSIDE: ContextVar[frozenset[int]] = ContextVar("glas_outside_posterior", default=frozenset())


class GradientsDisabledError(ValueError):
    """A reentrant activation checkpoint ran its segment without gradients, leaving
    fitted parameters out of the graph GLAS differentiates (their curvature would be
    silently zero).
    """


@dataclass
class CheckpointWatch:
    """What :func:`watch_reentrant_checkpoints` counts: ``segments``, the reentrant
    checkpoints that ran without gradients in the block so far.
    """

    segments: int = 0

    def check(self, model: nn.Module, missing: Sequence[torch.Tensor]) -> None:
        """Raise :class:`GradientsDisabledError` if a segment ran without gradients and
        ``missing``, the fitted parameters the pass left without a graph, is not empty.

        Parameters
        ----------
        model : nn.Module
            The network (for the parameters' names).
        missing : sequence of tensors
            Fitted parameters that the differentiated output does not reach.

        """
        missing = [p for p in missing if id(p) not in _OUTSIDE.get()]
        if not self.segments or not missing:
            return
        names = {id(p): name for name, p in model.named_parameters()}
        listed = [names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in missing]
        shown = ", ".join(listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
        raise GradientsDisabledError(
            f"Reentrant activation checkpointing (torch.utils.checkpoint.checkpoint with "
            f"use_reentrant=True) ran a segment without gradients, so the fitted "
            f"parameters {shown} are not in the graph GLAS differentiates and would get "
            "no curvature. Use use_reentrant=False, which GLAS differentiates exactly, or "
            "leave these parameters out of the posterior (requires_grad_(False))."
        )


@contextlib.contextmanager
def outside_posterior(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Parameters the block's passes differentiate although the posterior does not
    cover them (the weights outside a subnetwork): :meth:`CheckpointWatch.check` leaves
    them out (a context variable: this thread or task only).
    """
    token = _OUTSIDE.set(frozenset(id(p) for p in params))
    try:
        yield
    finally:
        _OUTSIDE.reset(token)


@contextlib.contextmanager
def watch_reentrant_checkpoints() -> Iterator[CheckpointWatch]:
    """Count the reentrant checkpoints that run without gradients inside the block
    (:attr:`CheckpointWatch.segments`, live); torch's own function is back on exit,
    also where the block raises.
    """
    watch = CheckpointWatch()
    original = torch_checkpoint.check_backward_validity

    def counting(inputs: Any) -> None:
        inputs = tuple(inputs)
        if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            watch.segments += 1
        original(inputs)

    torch_checkpoint.check_backward_validity = counting
    try:
        yield watch
    finally:
        torch_checkpoint.check_backward_validity = original
