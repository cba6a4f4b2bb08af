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

:func:`watch_reentrant_checkpoints` records that warning while a differentiated forward
pass runs (every other warning is passed on after it); the operator then calls
:meth:`CheckpointWatch.check` with the fitted parameters the pass left without a graph,
which raises :class:`GradientsDisabledError` naming them when a segment ran without
gradients. Parameters a model does not use, and segments that hold no fitted
parameter (a frozen, checkpointed backbone), raise nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["CheckpointWatch", "GradientsDisabledError", "watch_reentrant_checkpoints"]

CHECKPOINT_WARNING = "None of the inputs have requires_grad=True"
"""The start of the warning a reentrant checkpoint gives when no input needs a gradient."""


class GradientsDisabledError(ValueError):
    """A reentrant activation checkpoint ran its segment without gradients, leaving
    fitted parameters out of the graph GLAS differentiates (their curvature would be
    silently zero).
    """


def _is_checkpoint_warning(record: warnings.WarningMessage) -> bool:
    return issubclass(record.category, UserWarning) and str(record.message).startswith(
        CHECKPOINT_WARNING
    )


@dataclass
class CheckpointWatch:
    """What :func:`watch_reentrant_checkpoints` records: ``records``, the warnings
    raised in the block so far.
    """

    records: list[warnings.WarningMessage] = field(default_factory=list)

    @property
    def segments(self) -> int:
        """Reentrant checkpoints that ran without gradients so far."""
        return sum(_is_checkpoint_warning(r) for r in self.records)

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
def watch_reentrant_checkpoints() -> Iterator[CheckpointWatch]:
    """Record the reentrant checkpoints that run without gradients inside the block
    (:attr:`CheckpointWatch.segments`, live).

    torch's warning for them is recorded whatever filters or earlier occurrences say
    (it is not shown); every other warning raised inside the block is passed on
    afterwards through :func:`warnings.warn_explicit`, under the filters in force.
    Warning filters are process-wide: warnings other threads raise meanwhile are passed
    on too, from this thread.
    """
    records: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=CHECKPOINT_WARNING, category=UserWarning)
            try:
                yield CheckpointWatch(caught)
            finally:
                records = list(caught)
    finally:  # also where the block raised: its warnings are not lost
        for record in records:
            if not _is_checkpoint_warning(record):
                warnings.warn_explicit(
                    record.message,
                    record.category,
                    record.filename,
                    record.lineno,
                    source=record.source,
                )
