"""Elementwise activations with their derivative frozen at the linearisation point.

The linearised GGN (:mod:`~laplace_glas.curvature.operators.linearized`) differentiates
each batch's backward pass once more for every product (``J v`` by double backward).
An activation written in elementary ops (Hugging Face's ``NewGELUActivation`` of GPT-2,
``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``) then costs a dozen elementwise
kernels per product and direction, although its Jacobian at the kept point is the
fixed diagonal ``diag(f'(x))``: on GPT-2 + LoRA over tokens they took half of every
product. Inside :func:`frozen_first_derivatives` such a module returns the same
``f(x)`` through a function whose backward is

.. math::

    \\bar x = \\bar y \\odot f'(x) , \\qquad f'(x) = \\nabla_x \\textstyle\\sum f(x)
    \\quad (\\text{elementwise } f) ,

with ``f(x)`` the module's own value and ``f'(x)`` computed once from its forward at the
pass's ``x``: by forward mode (``torch.func.jvp`` with a tangent of ones), in chunks of
65,536 numbers of the flattened input, so that the elementary ops' temporaries stay
small and are reused (a reverse pass kept every op's inputs at once: on GPT-2 + LoRA
over tokens each GELU's call raised the resident memory by 21-25 MiB, for 3 MiB it
keeps; in chunks by 3-4 MiB); by a reverse pass where an op has no forward derivative.
The first derivative, all a GGN product uses, is the module's own (to rounding: the same
kernels, summed differently); the backward is linear in ``\\bar y`` with a constant
factor, so its derivative in ``\\bar y`` is the same product, and its graph keeps
``f'(x)`` instead of the elementary ops' inputs. It has no derivative in ``x`` (no
second derivatives of the network: GGN products only).

Covered: activation modules without parameters that act elementwise, by exact type
(``nn.GELU``, ``nn.Tanh``, ``nn.SiLU``, ... and the elementwise classes of
``transformers.activations``); functional calls (``F.gelu``) and other modules are left
alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from laplace_glas.autodiff.frozen_lora import frozen_lora_forward, is_frozen_lora
from laplace_glas.autodiff.frozen_norms import frozen_norm_forward, is_frozen_norm
from laplace_glas.autodiff.precomputed import Precomputed

__all__ = [
    "freezable_modules",
    "frozen_first_derivatives",
    "is_elementwise_activation",
    "switched_forwards",
]

_TORCH_ELEMENTWISE = (
    nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Softplus, nn.ELU, nn.CELU, nn.SELU,
    nn.Mish, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink, nn.Hardswish, nn.Hardsigmoid,
    nn.Hardtanh, nn.ReLU, nn.ReLU6, nn.LeakyReLU,
)  # fmt: skip
_HF_ELEMENTWISE = frozenset(
    {
        "GELUTanh", "NewGELUActivation", "GELUActivation", "SiLUActivation",
        "FastGELUActivation", "QuickGELUActivation", "ClippedGELUActivation",
        "AccurateGELUActivation", "MishActivation", "LaplaceActivation",
        "ReLUSquaredActivation", "SqrtSoftplusActivation", "PytorchGELUTanh",
    }
)  # fmt: skip


def is_elementwise_activation(module: nn.Module) -> bool:
    """Whether ``module`` is a parameter-free elementwise activation GLAS knows (exact
    type: a subclass may act otherwise), not in place (``inplace=True`` writes over its
    input: left to its own graph, which autograd checks).
    """
    cls = type(module)
    known = cls in _TORCH_ELEMENTWISE or (
        cls.__module__ == "transformers.activations" and cls.__name__ in _HF_ELEMENTWISE
    )
    in_place = getattr(module, "inplace", False)  # nn.ReLU(inplace=True): its own graph
    return known and not in_place and next(module.parameters(), None) is None


class _FrozenDerivative(torch.autograd.Function):
    """``y`` (computed outside) as a function of ``x`` with the backward ``g * d``."""

    @staticmethod
    def forward(x: torch.Tensor, y: Precomputed, derivative: torch.Tensor) -> torch.Tensor:
        return y.tensor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (derivative,) = ctx.saved_tensors
        return grad * derivative, None, None


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


_CHUNK_ELEMENTS = 2**16


def _forward_mode_derivative(forward: Callable, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``(f(x), f'(x))`` of an elementwise ``forward``: ``f(x)`` by the forward itself
    over the whole input (its own values: a kernel's vectorised and scalar paths round
    differently at a chunk's edges), ``f'(x)`` by forward mode in chunks of
    ``_CHUNK_ELEMENTS`` numbers of the flattened input (``None`` where ``f(x)`` is not
    a tensor of ``x``'s shape).
    """
    with torch.no_grad():
        y = forward(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return y, None
        if x.numel() <= 2 * _CHUNK_ELEMENTS:
            return y, torch.func.jvp(forward, (x,), (torch.ones_like(x),))[1]
        derivative = torch.empty(x.shape, dtype=y.dtype, device=y.device)
        flat = derivative.view(-1)
        for start, chunk in zip(
            range(0, x.numel(), _CHUNK_ELEMENTS), x.reshape(-1).split(_CHUNK_ELEMENTS)
        ):
            ones = torch.ones_like(chunk)
            flat[start : start + chunk.numel()] = torch.func.jvp(forward, (chunk,), (ones,))[1]
    return y, derivative


def _reverse_mode_derivative(forward: Callable, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``(f(x), f'(x))`` of an elementwise ``forward`` by a reverse pass (``f'`` is
    ``None`` where ``f(x)`` is not a tensor of ``x``'s shape).
    """
    # the derivative's own graph is temporary: not seen by the caller's saved-tensor
    # hooks (the linearised operator counts what its graphs keep)
    hooks = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
    with hooks, torch.enable_grad():
        point = x.detach().requires_grad_(True)
        y = forward(point)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return y, None
        (derivative,) = torch.autograd.grad(y, point, torch.ones_like(y))
    return y.detach(), derivative


def _frozen_forward(module: nn.Module, forward: Any):
    """``module``'s forward through :class:`_FrozenDerivative` where its input needs a
    graph (else the original forward).
    """

    def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or not x.requires_grad:
            return forward(x, *args, **kwargs)
        try:  # forward mode: each op's temporaries go as soon as the next op has run
            y, derivative = _forward_mode_derivative(forward, x.detach())
        except (RuntimeError, NotImplementedError):  # an op without a forward derivative
            y, derivative = _reverse_mode_derivative(forward, x)
        if derivative is None:  # f(x) not of x's shape: not elementwise after all
            return forward(x)
        return _FrozenDerivative.apply(x, Precomputed(y), derivative)

    return wrapped


Freezable = tuple[nn.Module, Callable[[nn.Module, Any], Any]]
"""A module and the function that wraps its forward (:func:`freezable_modules`)."""


def freezable_modules(model: nn.Module) -> tuple[Freezable, ...]:
    """``model``'s elementwise activation modules (:func:`is_elementwise_activation`),
    layer and RMS normalisations
    (:func:`~laplace_glas.autodiff.frozen_norms.is_frozen_norm`) and peft LoRA layers
    (:func:`~laplace_glas.autodiff.frozen_lora.is_frozen_lora`), each with the wrapper
    of its forward; found once, switched by :func:`switched_forwards` as often as needed.
    """
    found: list[Freezable] = []
    for module in model.modules():
        if is_elementwise_activation(module):
            found.append((module, _frozen_forward))
        elif is_frozen_norm(module):
            found.append((module, frozen_norm_forward))
        elif is_frozen_lora(module):
            found.append((module, frozen_lora_forward))
    return tuple(found)


@contextlib.contextmanager
def switched_forwards(modules: tuple[Freezable, ...]) -> Iterator[int]:
    """Inside the block, each of ``modules`` (:func:`freezable_modules`) runs its
    wrapped forward; yields how many. The modules' own ``forward`` is restored on exit,
    also when the block raises.
    """
    own = [m.__dict__.get("forward") for m, _ in modules]  # an instance-level forward
    try:
        for module, freeze in modules:
            module.forward = freeze(module, module.forward)
        yield len(modules)
    finally:
        for (module, _), previous in zip(modules, own, strict=True):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def frozen_first_derivatives(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """Inside the block, ``model``'s elementwise activation modules
    (:func:`is_elementwise_activation`) build graphs whose backward multiplies by
    their derivative at the point of the pass, and its layer and RMS normalisations
    (:mod:`~laplace_glas.autodiff.frozen_norms`) and peft LoRA layers
    (:mod:`~laplace_glas.autodiff.frozen_lora`) graphs whose backward is their
    Jacobian's transpose at that point; yields how many modules were
    switched. The modules' own ``forward`` is restored on exit, also when the block
    raises; graphs built inside keep the frozen derivatives.
    """
    return switched_forwards(freezable_modules(model))
