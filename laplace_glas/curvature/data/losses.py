"""Loss modules whose GGN is the one GLAS needs.

:class:`TokenCrossEntropy` is softmax cross-entropy over the LAST axis of the model
output, for outputs ``(batch, classes)`` and sequence outputs
``(batch, seq_len, vocab)`` alike, summed over every target that is not
``ignore_index`` (padding). ``torch.nn.CrossEntropyLoss`` expects the classes on
axis 1, which for ``(batch, seq_len, vocab)`` outputs would silently treat the
sequence axis as classes; flattening here avoids that. With ``reduction='sum'`` the
GGN of the mean loss over ``T`` tokens is ``(1/T) * GGN(sum)``: the caller scales.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TokenCrossEntropy", "count_targets", "summed_unit_noise_loss"]


class TokenCrossEntropy(nn.Module):
    """Cross-entropy over the last output axis, ignoring ``ignore_index`` targets.

    ``loss(f, y) = sum_{t: y_t != ignore} -log softmax(f_t)[y_t]`` (or the mean over
    those ``t`` for ``reduction='mean'``), ``f`` of shape ``(..., C)``, ``y`` of shape
    ``(...)``.
    """

    def __init__(self, reduction: str = "sum", ignore_index: int = -100):
        super().__init__()
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}.")
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of ``output (..., C)`` against integer ``target (...)``."""
        return F.cross_entropy(
            output.reshape(-1, output.shape[-1]),
            target.reshape(-1),
            reduction=self.reduction,
            ignore_index=self.ignore_index,
        )


def count_targets(target: torch.Tensor, ignore_index: int = -100) -> int:
    """Number of targets that are not ``ignore_index``."""
    return int((target != ignore_index).sum())


def summed_unit_noise_loss(likelihood: str) -> tuple[nn.Module, float]:
    """``(loss, factor)``: the summed loss whose GGN times ``factor`` is the unit-noise
    GGN, for the libraries that take a loss module (BackPACK, curvlinops' KFAC).

    Regression: ``MSELoss(reduction='sum')`` is ``||f - y||^2``, twice the unit-noise
    ``0.5 ||f - y||^2``, so ``factor = 0.5``; classification: the summed cross-entropy,
    ``factor = 1``.
    """
    if likelihood == "regression":
        return nn.MSELoss(reduction="sum"), 0.5
    return nn.CrossEntropyLoss(reduction="sum"), 1.0
