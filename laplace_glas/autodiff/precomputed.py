"""A value computed outside a custom autograd function, returned as its output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Precomputed"]


@dataclass(frozen=True)
class Precomputed:
    """A tensor handed to a custom autograd function out of autograd's sight.

    The frozen modules (:mod:`~laplace_glas.autodiff.frozen_activations`) compute their output
    outside their function and return it from ``forward``. Passed as a tensor argument,
    it would come back as a view of that input, which autograd forbids changing in
    place (``nn.ReLU(inplace=True)`` after a frozen layer would raise); wrapped, it
    comes back as the function's own output.
    """

    tensor: torch.Tensor
