"""Recurrent layers written out in elementary ops, for forward-mode autodiff.

``torch.func.jvp`` needs a forward-mode derivative for every op. PyTorch's recurrent
layers dispatch to fused kernels that have none: oneDNN's ``mkldnn_rnn_layer`` on the
CPU (switched off by ``torch.backends.mkldnn.flags(enabled=False)``, after which the
CPU path is elementary), cuDNN on a GPU, and, with cuDNN off, the fused cells
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` that every non-CPU device uses.
:func:`elementary_rnn_forward` computes the same outputs as ``nn.LSTM``, ``nn.GRU``
and ``nn.RNN`` from ``F.linear``, ``sigmoid`` and ``tanh``, one time step at a time,
reading the weights from the module (so ``torch.func.functional_call`` can substitute
them). With gates in PyTorch's order:

* LSTM: ``i, f, g, o = s(W_ii x + b_ii + W_hi h + b_hi), s(.), tanh(.), s(.)``,
  ``c' = f c + i g``, ``h' = o tanh(c')`` (then ``h' = W_hr h'`` with ``proj_size``);
* GRU: ``r, z = s(W_ir x + b_ir + W_hr h + b_hr), s(.)``,
  ``n = tanh(W_in x + b_in + r (W_hn h + b_hn))``, ``h' = (1 - z) n + z h``;
* RNN: ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``, ``act`` = tanh or relu.

:func:`elementary_rnns` swaps this in as the ``forward`` of every such module of a model
while a block runs.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

__all__ = ["elementary_rnn_forward", "elementary_rnns"]

_SUPPORTED = (nn.LSTM, nn.GRU, nn.RNN)


def _cell(
    module: nn.RNNBase, x_proj: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, sfx: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of the recurrence; ``x_proj = W_ih x + b_ih`` is precomputed."""
    h_proj = F.linear(
        h,
        getattr(module, f"weight_hh{sfx}"),
        getattr(module, f"bias_hh{sfx}") if module.bias else None,
    )
    if isinstance(module, nn.LSTM):
        i, f, g, o = (x_proj + h_proj).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if module.proj_size > 0:
            h = F.linear(h, getattr(module, f"weight_hr{sfx}"))
        return h, c
    if isinstance(module, nn.GRU):
        x_r, x_z, x_n = x_proj.chunk(3, dim=-1)
        h_r, h_z, h_n = h_proj.chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (1 - z) * n + z * h, None
    act = torch.tanh if module.nonlinearity == "tanh" else torch.relu
    return act(x_proj + h_proj), None


def elementary_rnn_forward(
    module: nn.RNNBase,
    input: torch.Tensor,
    hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """``module(input, hx)`` for an ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN``, in elementary ops.

    Same signature, shapes and return values as the module's own ``forward`` (batched
    or unbatched input, ``batch_first``, stacked layers, ``bidirectional``, ``bias``,
    LSTM ``proj_size``, inter-layer dropout in training mode).

    Raises
    ------
    TypeError
        For another module type.
    NotImplementedError
        For a ``PackedSequence`` input.

    """
    if not isinstance(module, _SUPPORTED):
        raise TypeError(f"Expected nn.LSTM, nn.GRU or nn.RNN, got {type(module).__name__}.")
    if isinstance(input, PackedSequence):
        raise NotImplementedError(
            f"{type(module).__name__} with a PackedSequence input has no forward-mode "
            "derivative off the CPU; pass padded tensors (padding targets are left out "
            "through ignore_index)."
        )
    is_lstm = isinstance(module, nn.LSTM)
    unbatched = input.dim() == 2
    if unbatched:  # time-major (T, B, F) inside
        x = input.unsqueeze(1)
    elif module.batch_first:
        x = input.transpose(0, 1)
    else:
        x = input
    n_dirs = 2 if module.bidirectional else 1
    T, B = x.shape[0], x.shape[1]
    h_size = module.proj_size if is_lstm and module.proj_size > 0 else module.hidden_size
    if hx is None:
        h0 = x.new_zeros(module.num_layers * n_dirs, B, h_size)
        c0 = x.new_zeros(module.num_layers * n_dirs, B, module.hidden_size) if is_lstm else None
    else:
        h0, c0 = hx if is_lstm else (hx, None)
        if unbatched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
    h_last, c_last = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(n_dirs):
            sfx = f"_l{layer}" + ("_reverse" if direction else "")
            index = layer * n_dirs + direction
            x_proj = F.linear(
                x,
                getattr(module, f"weight_ih{sfx}"),
                getattr(module, f"bias_ih{sfx}") if module.bias else None,
            )
            h, c = h0[index], c0[index] if c0 is not None else None
            steps = range(T - 1, -1, -1) if direction else range(T)
            out_t = [None] * T
            for t in steps:
                h, c = _cell(module, x_proj[t], h, c, sfx)
                out_t[t] = h
            outputs.append(torch.stack(out_t))
            h_last.append(h)
            if c is not None:
                c_last.append(c)
        x = torch.cat(outputs, dim=-1) if n_dirs == 2 else outputs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    h_n = torch.stack(h_last)
    c_n = torch.stack(c_last) if is_lstm else None
    if unbatched:
        x, h_n = x.squeeze(1), h_n.squeeze(1)
        c_n = c_n.squeeze(1) if c_n is not None else None
    elif module.batch_first:
        x = x.transpose(0, 1)
    return x, ((h_n, c_n) if is_lstm else h_n)


@contextlib.contextmanager
def elementary_rnns(model: nn.Module, only_off_cpu: bool = True) -> Iterator[None]:
    """Run every ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` of ``model`` through
    :func:`elementary_rnn_forward` inside the block (the original ``forward`` is put
    back afterwards).

    With ``only_off_cpu`` (default), modules whose weights are on the CPU keep their
    own forward: with oneDNN switched off PyTorch's CPU path is already elementary (and
    faster, one matrix product for all four gates of every step).
    """
    patched = []
    for module in model.modules():
        if not isinstance(module, _SUPPORTED) or "forward" in module.__dict__:
            continue
        weight = next(module.parameters(), None)
        if only_off_cpu and (weight is None or weight.device.type == "cpu"):
            continue
        module.forward = types.MethodType(elementary_rnn_forward, module)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
