"""peft's LoRA layers with their Jacobian frozen at the linearisation point.

A LoRA layer adds a rank-``r`` update to a frozen base layer,

.. math::

    y = x M + b + s \\, (x A^\\top) B^\\top ,

with ``M`` the base weight as a ``d_in x d_out`` matrix (``W^T`` of an ``nn.Linear``,
the weight of GPT-2's ``Conv1D``), ``A`` (``r x d_in``) and ``B`` (``d_out x r``) the
adapters and ``s`` the scaling. Its vector-Jacobian product, with ``z = s \\bar y B``,

.. math::

    \\bar x = \\bar y M^\\top + z A , \\qquad
    \\bar A = z^\\top x , \\qquad
    \\bar B = \\bar y^\\top (s \\, x A^\\top) ,

is linear in ``\\bar y`` with ``x``, ``s x A^T`` and the weights fixed at the pass's
point, and its derivative in ``\\bar y`` (the linearised GGN's ``J v``, by double
backward) is the layer's Jacobian-vector product

.. math::

    \\dot y = \\dot x M + [\\dot z , \\; s x A^\\top]
        \\begin{bmatrix} B^\\top \\\\ \\dot B^\\top \\end{bmatrix} , \\qquad
    \\dot z = s \\, (\\dot x A^\\top + x \\dot A^\\top) .

Through peft's own forward, autograd differentiates ``B(A(x)) * s`` op by op: the
scaling multiplies a ``d_out``-wide tensor, each of the three rank-``r`` terms writes
one, and each is added separately. Here the scaling acts on the rank side, and the
rank terms enter ``\\dot y`` (or ``\\bar x``) through one ``addmm`` on the base layer's
product. The values are the module's own (checked bit for bit on each call); the first
derivative is the same to rounding. There is no derivative in ``x`` or the weights
(second derivatives through the frozen graph miss those terms silently); GGN products
need none.

Memory: the graph keeps ``x`` (for ``A``'s gradient) and ``s x A^T`` (``r`` numbers a
row, for ``B``'s), what peft's own graph keeps. Where ``x`` is the output of a frozen
layer or RMS norm over its last axis
(:func:`~laplace_glas.autodiff.frozen_norms.normalised_rows`: GPT-2's ``ln_1`` before
``c_attn``, Llama's ``input_layernorm`` before ``q_proj``, ``k_proj`` and ``v_proj``),
where the norm is frozen (its input needs a gradient: not in a transformer's first
block), it keeps the norm's centred input and ``r`` instead, which the norm's graph
keeps anyway, and reads ``x = weight * (centred * r) + bias`` through them:

.. math::

    z^\\top x = \\big((z \\odot r)^\\top c\\big) \\odot \\gamma
        + \\Big(\\sum_n z_n\\Big) \\beta^\\top , \\qquad
    x \\dot A^\\top = r \\odot \\big(c \\, (\\dot A \\odot \\gamma)^\\top\\big)
        + \\beta^\\top \\dot A^\\top ,

rank-``r`` work beside a ``d_in``-wide tensor not kept (GPT-2 + LoRA over tokens: 10%
fewer kept bytes a batch).

Covered: ``peft.tuners.lora.layer.Linear`` (exact type) with one active adapter,
unmerged, plain LoRA (no DoRA or other variant, no ``lora_bias``), dropout that is
``nn.Identity`` or inactive, a base ``nn.Linear`` or ``transformers``' ``Conv1D`` whose
parameters are not trained, and a float32 or float64 input sharing the weights' dtype.
Other calls run the module's own forward. A forward hook on the layer's adapters or base
layer that changes their output fails the check (it is computed from the weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from laplace_glas.autodiff.frozen_norms import normalised_rows
from laplace_glas.autodiff.precomputed import Precomputed

__all__ = ["frozen_lora_forward", "is_frozen_lora"]

_DTYPES = (torch.float32, torch.float64)


def is_frozen_lora(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA ``Linear`` layer (exact type) whose Jacobian
    GLAS may freeze; each call checks the rest (:func:`frozen_lora_forward`).
    """
    cls = type(module)
    return cls.__module__ == "peft.tuners.lora.layer" and cls.__name__ == "Linear"


@dataclass(frozen=True)
class _Parts:
    """A plain LoRA layer's pieces: ``y = x M + b + s (x A^T) B^T``."""

    base: nn.Module
    transposed: bool  # the base weight is stored as W (d_out x d_in): M = W^T
    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def _inactive(dropout: nn.Module) -> bool:
    """Whether a LoRA dropout passes its input through (``nn.Identity``, or an
    ``nn.Dropout`` in eval mode or with ``p = 0``).
    """
    if type(dropout) is nn.Identity:
        return True
    return type(dropout) is nn.Dropout and (not dropout.training or dropout.p == 0)


def _plain_parts(module: nn.Module) -> _Parts | None:
    """The layer's pieces where it computes plain LoRA on a frozen base, else None."""
    if getattr(module, "disable_adapters", True) or getattr(module, "merged", True):
        return None
    active = [a for a in module.active_adapters if a in module.lora_A.keys()]
    if len(active) != 1 or active[0] in getattr(module, "lora_variant", {}):
        return None
    name = active[0]
    lora_A, lora_B = module.lora_A[name], module.lora_B[name]
    dropout = module.lora_dropout[name]
    base = module.base_layer
    base_params = [base.weight, getattr(base, "bias", None)]
    plain = (
        type(lora_A) is nn.Linear
        and type(lora_B) is nn.Linear
        and lora_A.bias is None
        and lora_B.bias is None
        and _inactive(dropout)
        and (type(base) is nn.Linear or _is_conv1d(base))
        and not any(p is not None and p.requires_grad for p in base_params)
        and isinstance(module.scaling[name], (int, float))
    )
    if not plain:
        return None
    scaling = float(module.scaling[name])
    return _Parts(base, type(base) is nn.Linear, lora_A, lora_B, scaling)


def _plain_lora(parts: _Parts, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base(x) + B(A(x)) * s, A(x))`` from the weights, in the order and with the
    kernels of peft's and the base layer's own forward (``F.linear``, GPT-2's
    ``Conv1D`` as one ``addmm``), so equal to them bit for bit where they compute plain
    LoRA; not through the submodules, so that what a forward hook on them does shows
    as a difference.
    """
    base = parts.base
    if parts.transposed:
        out = F.linear(x, base.weight, base.bias)
    else:
        rows = torch.addmm(base.bias, x.reshape(-1, x.shape[-1]), base.weight)
        out = rows.view(*x.shape[:-1], base.weight.shape[1])
    ax = F.linear(x, parts.lora_A.weight)
    # in place: the same roundings as `out + B(A(x)) * s`, two temporaries
    return out.add_(F.linear(ax, parts.lora_B.weight).mul_(parts.scaling)), ax


def _base_matrix(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``M`` (``d_in x d_out``) of ``y = x M + b``."""
    return weight.t() if transposed else weight


Input = tuple
"""A LoRA layer's input as its backward pass reads it, in rows: ``(x,)``, or where it
is a frozen norm's output (:func:`~laplace_glas.autodiff.frozen_norms.normalised_rows`)
``(centred, rstd, weight, bias)`` with ``x = weight * (centred * rstd) + bias``."""


def _rows(parts: Input, width: int) -> Input:
    """``parts`` with the tensors of the rows as 2-d matrices (``(n, d_in)``, ``(n, 1)``)."""
    if len(parts) <= 1:  # x, or nothing (A is not trained)
        return tuple(t.reshape(-1, width) for t in parts)
    centred, rstd, weight, bias = parts
    return centred.reshape(-1, width), rstd.reshape(-1, 1), weight, bias


def _transposed_times(z: torch.Tensor, parts: Input) -> torch.Tensor:
    """``z^T x`` (``r x d_in``); for a norm's output
    ``((z * rstd)^T centred) * weight + (sum_n z_n) bias^T``.
    """
    if len(parts) == 1:
        return z.t() @ parts[0]
    centred, rstd, weight, bias = parts
    out = (z * rstd).t() @ centred
    if weight is not None:
        out.mul_(weight)
    if bias is not None:
        out.addr_(z.sum(0), bias)
    return out


def _times(parts: Input, matrix: torch.Tensor) -> torch.Tensor:
    """``x matrix`` (``n x r``, ``matrix`` ``d_in x r``); for a norm's output
    ``rstd * (centred (weight * matrix)) + bias^T matrix``.
    """
    if len(parts) == 1:
        return parts[0] @ matrix
    centred, rstd, weight, bias = parts
    scaled = matrix if weight is None else matrix * weight[:, None]
    out = (centred @ scaled).mul_(rstd)
    if bias is not None:
        out.add_(bias @ matrix)
    return out


def _lora_vjp(
    grad: torch.Tensor,
    parts: Input,
    scaled_ax: torch.Tensor,
    matrices: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
    wanted: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(x_bar, A_bar, B_bar)`` of the module docstring for ``grad`` (``y_bar``), the
    tensors as 2-d row matrices (``(n, d_out)``, :func:`_rows`, ``(n, r)``).
    """
    M, A, B = matrices
    z = (grad @ B).mul_(scaling) if wanted[0] or wanted[1] else None
    grad_x = (grad @ M.t()).addmm_(z, A) if wanted[0] else None
    grad_A = _transposed_times(z, parts) if wanted[1] else None
    grad_B = grad.t() @ scaled_ax if wanted[2] else None
    return grad_x, grad_A, grad_B


class _LoRAPullback(torch.autograd.Function):
    """The recorded backward pass of :class:`_FrozenLoRA`: ``y_bar -> (x_bar, A_bar,
    B_bar)``, differentiable in ``y_bar`` only (the docstring's ``y_dot``).
    """

    @staticmethod
    def forward(grad, scaled_ax, M, A, B, scaling, wanted, *parts):
        return _lora_vjp(grad, parts, scaled_ax, (M, A, B), scaling, wanted)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        _, scaled_ax, M, A, B, scaling, wanted, *parts = inputs
        ctx.save_for_backward(scaled_ax, M, A, B, *parts)
        ctx.scaling, ctx.wanted = scaling, wanted
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dot_x, dot_A, dot_B) -> tuple:
        scaled_ax, M, A, B, *parts = ctx.saved_tensors
        dot_z = None
        if dot_x is not None:
            dot_z = dot_x @ A.t()
        if dot_A is not None:
            from_A = _times(parts, dot_A.t())
            dot_z = from_A if dot_z is None else dot_z.add_(from_A)
        rows, cols = [], []
        if dot_z is not None:
            rows.append(dot_z.mul_(ctx.scaling))
            cols.append(B.t())
        if dot_B is not None:
            rows.append(scaled_ax)
            cols.append(dot_B.t())
        dot_y = None if dot_x is None else dot_x @ M
        if rows:
            low = (torch.cat(rows, 1), torch.cat(cols, 0)) if len(rows) > 1 else (rows[0], cols[0])
            dot_y = low[0] @ low[1] if dot_y is None else dot_y.addmm_(*low)
        return dot_y, *(None,) * (6 + len(parts))


class _FrozenLoRA(torch.autograd.Function):
    """``y`` (computed outside) as a function of ``x``, ``A`` and ``B`` with the
    backward of the module docstring; ``parts`` (:data:`Input`) are what it keeps of
    ``x``.
    """

    @staticmethod
    def forward(x, lora_A, lora_B, y, scaled_ax, base_weight, transposed, scaling, *parts):
        return y.tensor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, lora_A, lora_B, _, scaled_ax, base_weight, transposed, scaling, *parts = inputs
        # x (or the norm's tensors) only for A's gradient, s x A^T only for B's: a layer
        # with one of them not trained keeps no more than peft's own graph
        parts = parts if lora_A.requires_grad else []
        scaled_ax = scaled_ax if lora_B.requires_grad else None
        ctx.save_for_backward(scaled_ax, base_weight, lora_A, lora_B, *parts)
        ctx.transposed, ctx.scaling, ctx.width = transposed, scaling, inputs[0].shape[-1]
        ctx.input_shape, ctx.n_inputs = inputs[0].shape, len(inputs)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scaled_ax, base_weight, lora_A, lora_B, *parts = ctx.saved_tensors
        none = (None,) * (ctx.n_inputs - 3)
        if grad is None:
            return None, None, None, *none
        wanted = tuple(ctx.needs_input_grad[:3])
        M = _base_matrix(base_weight, ctx.transposed)
        rows = grad.reshape(-1, grad.shape[-1])
        parts = _rows(parts, ctx.width)
        if torch.is_grad_enabled():  # recorded: its derivative in grad is _LoRAPullback's
            detached = [
                None if t is None else t.detach() for t in (scaled_ax, M, lora_A, lora_B, *parts)
            ]
            grads = _LoRAPullback.apply(rows, *detached[:4], ctx.scaling, wanted, *detached[4:])
        else:
            grads = _lora_vjp(rows, parts, scaled_ax, (M, lora_A, lora_B), ctx.scaling, wanted)
        grad_x, grad_A, grad_B = grads
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.input_shape)
        return grad_x, grad_A, grad_B, *none


def _kept_input(x: torch.Tensor) -> Input:
    """What the backward pass keeps of ``x`` (:data:`Input`): a frozen norm's
    tensors where ``x`` is its output over the last axis (they are kept anyway), else
    ``x``.
    """
    rows = normalised_rows(x)
    if rows is None or rows.centred.shape != x.shape:
        return (x,)
    return rows.centred, rows.rstd, rows.weight, rows.bias


def frozen_lora_forward(module: nn.Module, forward: Callable) -> Callable:
    """``module``'s forward through ``_FrozenLoRA`` where it computes plain LoRA on a
    frozen base (see the module docstring), its output needs a graph and equals
    ``base(x) + B(A(x)) * s`` bit for bit; else the module's own forward.
    """

    def wrapped(x: Any, *args: Any, **kwargs: Any) -> Any:
        parts = _plain_parts(module)
        if args or kwargs or parts is None or not isinstance(x, torch.Tensor):
            return forward(x, *args, **kwargs)
        A, B = parts.lora_A.weight, parts.lora_B.weight
        weights = [A, B, parts.base.weight, getattr(parts.base, "bias", None)]
        frozen = (
            torch.is_grad_enabled()
            and x.dtype in _DTYPES
            and all(w is None or w.dtype == x.dtype for w in weights)
            and (x.requires_grad or A.requires_grad or B.requires_grad)
        )
        if not frozen:
            return forward(x, *args, **kwargs)
        with torch.no_grad():
            y = forward(x)
            mine, ax = _plain_lora(parts, x)
            matches = torch.equal(y, mine)
            del mine
        if not matches:  # the module's own forward, with its graph
            return forward(x)
        scaled_ax = (ax * parts.scaling).reshape(-1, ax.shape[-1])
        base = (parts.base.weight, parts.transposed, parts.scaling)
        return _FrozenLoRA.apply(x, A, B, Precomputed(y), scaled_ax, *base, *_kept_input(x))

    return wrapped
