"""Layer and RMS normalisation with their Jacobian frozen at the linearisation point.

A normalisation layer over the last ``n`` axes,

.. math::

    y = \\gamma \\odot \\hat x + \\beta , \\qquad
    \\hat x = r \\, (x - \\mu) , \\qquad
    r = (\\sigma^2 + \\epsilon)^{-1/2}

(``nn.LayerNorm``; ``nn.RMSNorm`` has ``\\mu = 0``, ``\\sigma^2`` the mean square and
no ``\\beta``), has the vector-Jacobian product

.. math::

    \\bar x = r \\big( \\bar h - \\langle \\bar h \\rangle
        - \\hat x \\odot \\langle \\bar h \\odot \\hat x \\rangle \\big) , \\qquad
    \\bar h = \\gamma \\odot \\bar y , \\qquad
    \\bar\\gamma = \\sum \\bar y \\odot \\hat x , \\qquad
    \\bar\\beta = \\sum \\bar y ,

with ``<.>`` the mean over the normalised axes (without the ``<h>`` term for RMS
normalisation) and the sums over the others. It is linear in ``\\bar y``, with ``r``,
``\\hat x`` and ``\\gamma`` fixed at the pass's point.

The linearised GGN (:mod:`~laplace_glas.curvature.operators.linearized`) records each
batch's backward pass and differentiates it once more in ``\\bar y`` for every product
(``J v`` by double backward). Through torch's own layer norm that derivative is
``NativeLayerNormBackwardBackward0``, torch's general second-order formula: on
GPT-2 + LoRA over tokens (``benchmarks/scale.py``'s
``lora-tokens``) ``J v`` took 27 ms a batch with it and 23 ms through
``_FrozenNormalization``, whose derivative in ``\\bar y`` is the adjoint of the
few kernels above, ``\\mu`` and ``r`` fixed (a layer norm's from torch's forward
kernel; an RMS norm's computed as its kernel does). The values are the module's own
(the same kernel) and the first derivative the same to rounding. There is no
derivative in ``x``: second derivatives through the frozen graph miss those terms
silently, and forward-mode transforms (``torch.func.jvp``, ``vmap`` of the forward)
refuse it; GGN products need neither.

Memory: a layer norm's graph keeps ``x - mu`` where torch's keeps ``x``, the same
bytes, unless another op saves ``x`` as well (a branch that reads the norm's input),
then one tensor of the input's size more. A norm over the last axis marks its output
with what it keeps (:func:`normalised_rows`), so that a frozen LoRA layer reading the
output (:mod:`~laplace_glas.autodiff.frozen_lora`) keeps those instead of the output
itself (where the norm is frozen: not where its input needs no gradient, as in a
transformer's first block).

Covered, by exact type (a subclass may act otherwise): ``nn.LayerNorm``, ``nn.RMSNorm``
and Hugging Face's RMS norms written as Llama's (``LlamaRMSNorm``, ``MistralRMSNorm``,
``Qwen2RMSNorm``, ...: ``weight * (x * r)``, checked on each call, float32 only), where
the input and parameters share a float32 or float64 dtype; others (half precision, mixed dtypes
under autocast), other normalisations (Gemma's ``1 + weight``, ...) and functional
calls are left alone. On a 4-layer, 128-wide Llama with LoRA over 32 x 46 tokens,
freezing its RMS norms made a product 3-6% faster and kept 9% fewer bytes a batch
(62.4 against 68.4 MB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from laplace_glas.autodiff.precomputed import Precomputed

__all__ = ["NormalisedRows", "frozen_norm_forward", "is_frozen_norm", "normalised_rows"]

_NORMS = (nn.LayerNorm, nn.RMSNorm)
_HF_RMS_NORMS = frozenset(
    {
        "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm",
        "Qwen3RMSNorm", "Phi3RMSNorm", "T5LayerNorm",
    }
)  # fmt: skip  # Llama's code: weight * (x * rsqrt(mean(x^2) + variance_epsilon)), in float32
_DTYPES = (torch.float32, torch.float64)  # torch's kernels compute these in their own dtype


_ROWS = "_glas_normalised_rows"


@dataclass(frozen=True)
class NormalisedRows:
    """A frozen norm's output over the last axis from the tensors its graph keeps:
    ``weight * (centred * rstd) + bias`` (``weight``, ``bias`` ``None`` where absent).
    """

    centred: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    version: int  # the output's version counter when marked


def normalised_rows(x: torch.Tensor) -> NormalisedRows | None:
    """The :class:`NormalisedRows` of ``x`` where it is the output of a norm over its
    last axis frozen by :func:`frozen_norm_forward`, not modified in place since, else
    ``None``. A layer that reads ``x`` in its backward pass (a frozen LoRA layer,
    :mod:`~laplace_glas.autodiff.frozen_lora`) may keep these instead of ``x``.
    """
    rows = getattr(x, _ROWS, None)
    # torch's version counter: an in-place op on x since (x.mul_(2)) changes its values
    if rows is None or rows.version != x._version:
        return None
    return rows


def is_frozen_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer whose Jacobian GLAS can freeze:
    ``nn.LayerNorm`` or ``nn.RMSNorm``, or one of Hugging Face's RMS norms written as
    Llama's (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ...; exact type).
    """
    cls = type(module)
    if cls in _NORMS:
        return True
    return (
        cls.__module__.startswith("transformers.models.")
        and cls.__name__ in _HF_RMS_NORMS
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.ndim == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _layout(module: nn.Module) -> tuple[tuple[int, ...], float | None]:
    """The normalised shape and ``epsilon`` of a norm :func:`is_frozen_norm` accepts."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return tuple(module.normalized_shape), module.eps
    return tuple(module.weight.shape), module.variance_epsilon


class _FrozenNormalization(torch.autograd.Function):
    """``y`` (computed outside) as a function of ``x``, ``gamma`` and ``beta`` with the
    backward of the module docstring, ``r`` and the centred input ``x - mu`` fixed.

    With ``c = x - mu`` (``x`` for RMS normalisation) the backward is written
    ``x_bar = r h_bar - r <h_bar> - c (r^3 <h_bar c>)``, so that the graph a recorded
    backward pass keeps holds ``c``, already kept for the forward's backward, and
    per-position scalars, rather than a new tensor ``x_hat``. For a layer norm, a
    backward pass that is not recorded (a product's ``J^T w``) runs torch's fused
    layer-norm backward kernel on ``c`` with a zero mean, the same formula.
    """

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        y: Precomputed,
        centred: torch.Tensor,
        rstd: torch.Tensor,
        normalized_shape: tuple[int, ...],
        subtracts_mean: bool,
    ) -> torch.Tensor:
        return y.tensor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, weight, bias, _, centred, rstd, normalized_shape, subtracts_mean = inputs
        ctx.save_for_backward(centred, rstd, weight, bias)
        ctx.normalized_shape, ctx.subtracts_mean = normalized_shape, subtracts_mean

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        centred, rstd, weight, bias = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if ctx.subtracts_mean and not torch.is_grad_enabled():  # not recorded: fused
            zero_mean = torch.zeros_like(rstd)
            grads = torch.ops.aten.native_layer_norm_backward(
                grad, centred, ctx.normalized_shape, zero_mean, rstd, weight, bias, list(wanted)
            )
            return (*(g if w else None for g, w in zip(grads, wanted, strict=True)), *none)
        axes = tuple(range(-len(ctx.normalized_shape), 0))
        grad_x = grad_weight = grad_bias = None
        if wanted[0]:
            h = grad if weight is None else grad * weight
            grad_x = rstd * h - centred * (rstd.pow(3) * (h * centred).mean(axes, keepdim=True))
            if ctx.subtracts_mean:
                grad_x = grad_x - rstd * h.mean(axes, keepdim=True)
        if wanted[1]:  # summed over the other axes (none for an input without a batch axis)
            grad_weight = ((grad * rstd) * centred).sum_to_size(weight.shape)
        if wanted[2]:
            grad_bias = grad.sum_to_size(bias.shape)
        return grad_x, grad_weight, grad_bias, *none


def _statistics(
    module: nn.Module, x: torch.Tensor, shape: tuple[int, ...], eps: float | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(c, r, subtracts_mean)`` of ``module`` at ``x``: the centred input ``x - mu``
    (``x`` itself for RMS normalisation) and ``r`` with the normalised axes kept as ones.
    """
    if isinstance(module, nn.LayerNorm):
        _, mean, rstd = torch.native_layer_norm(x, shape, module.weight, module.bias, eps)
        return x - mean, rstd, True
    axes = tuple(range(-len(shape), 0))
    eps = eps if eps is not None else torch.finfo(x.dtype).eps
    return x.detach(), torch.rsqrt(x.pow(2).mean(axes, keepdim=True) + eps), False


def frozen_norm_forward(module: nn.Module, forward: Callable) -> Callable:
    """``module``'s forward through ``_FrozenNormalization`` where the output
    needs a graph and the input and parameters share a float32 or float64 dtype (else
    the original forward: half-precision and mixed-dtype norms compute their statistics
    in float32 inside torch's kernels). A Hugging Face RMS norm is frozen only on a
    float32 input (it computes in float32 whatever its input) and where its output
    equals ``weight * (x * r)`` bit for bit; otherwise its own forward runs, with its
    graph.
    """
    shape, eps = _layout(module)
    own = type(module) in _NORMS  # torch's; else a Hugging Face norm, float32 and checked

    def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        params = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
        frozen = (
            isinstance(x, torch.Tensor)
            and x.dtype in (_DTYPES if own else (torch.float32,))
            and all(p.dtype == x.dtype for p in params)
            and (x.requires_grad or any(p.requires_grad for p in params))
        )
        if args or kwargs or not frozen or not torch.is_grad_enabled():
            return forward(x, *args, **kwargs)
        with torch.no_grad():
            y = forward(x)
            centred, rstd, subtracts_mean = _statistics(module, x, shape, eps)
            matches = own or torch.equal(y, module.weight * (x * rstd))
        if not matches:  # the module's own forward, with its graph
            return forward(x)
        bias = getattr(module, "bias", None)
        out = _FrozenNormalization.apply(
            x, module.weight, bias, Precomputed(y), centred, rstd, shape, subtracts_mean
        )
        if len(shape) == 1:
            rows = NormalisedRows(centred, rstd, module.weight, bias, out._version)
            setattr(out, _ROWS, rows)
        return out

    return wrapped
