"""A context in which GLAS's own forward-mode computations can run on any model.

GLAS differentiates the network in forward mode (``torch.func.jvp`` for the GGN
products and the 'glm' predictive). Some of PyTorch's fused kernels have no
forward-mode derivative; :func:`autodiff_friendly` switches them to differentiable
equivalents around GLAS's own computations only and restores the caller's settings
afterwards.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from laplace_glas.rnn import elementary_rnns

__all__ = ["autodiff_friendly"]


@contextlib.contextmanager
def autodiff_friendly(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s recurrent layers without fused kernels while the block runs.

    The fused RNN kernels have no forward-mode derivative (``torch.func.jvp`` raises
    ``NotImplementedError: ... mkldnn_rnn_layer`` on the CPU, and ``...
    _thnn_fused_lstm_cell`` on a GPU even with cuDNN off), and the GGN products and the
    'glm' predictive are forward mode. On the CPU, switching oneDNN off is enough;
    LSTM/GRU/RNN layers on any other device run through
    :func:`laplace_glas.rnn.elementary_rnn_forward`. Only models that contain an
    ``nn.RNNBase`` are affected; for the others this is a no-op.
    """
    if not any(isinstance(m, nn.RNNBase) for m in model.modules()):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*TF32 acceleration on top of oneDNN.*")
        with (
            torch.backends.mkldnn.flags(enabled=False),
            torch.backends.cudnn.flags(enabled=False),
            elementary_rnns(model),
        ):
            yield
