"""A context in which GLAS's own forward-mode computations can run on any model.

GLAS differentiates the network in forward mode (``torch.func.jvp`` for the GGN
products and the 'glm' predictive). Some of PyTorch's fused kernels have no
forward-mode derivative; :func:`autodiff_friendly` switches them to differentiable
equivalents around GLAS's own computations only and restores the caller's settings
afterwards. The model also runs in evaluation mode there: the posterior is a
statement about the deterministic network at its MAP, so dropout is off and batch
normalisation uses (and does not update) its running statistics, whatever mode the
caller left the model in.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from laplace_glas.rnn import elementary_rnns

__all__ = ["autodiff_friendly", "evaluation_mode"]


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode inside the block, then restore every submodule's
    own ``training`` flag (a model partly in train mode comes back as it was).
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def autodiff_friendly(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in eval mode (:func:`evaluation_mode`), with its recurrent layers
    off the fused kernels, while the block runs.

    The fused RNN kernels have no forward-mode derivative (``torch.func.jvp`` raises
    ``NotImplementedError: ... mkldnn_rnn_layer`` on the CPU, and ``...
    _thnn_fused_lstm_cell`` on a GPU even with cuDNN off), and the GGN products and the
    'glm' predictive are forward mode. On the CPU, switching oneDNN off is enough;
    LSTM/GRU/RNN layers on any other device run through
    :func:`laplace_glas.rnn.elementary_rnn_forward`. Only models that contain an
    ``nn.RNNBase`` are affected by the kernel switch. Eval mode also keeps ``vmap``
    working (dropout in train mode draws random numbers, which ``vmap`` refuses) and
    batch-norm statistics untouched.
    """
    with evaluation_mode(model):
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
