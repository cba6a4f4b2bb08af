"""A context in which GLAS's own forward-mode computations can run on any model.

GLAS differentiates the network in forward mode (``torch.func.jvp`` for the GGN
products and the 'glm' predictive). Some of PyTorch's fused kernels have no
forward-mode derivative (attention's fast path and fused SDPA kernels, oneDNN/cuDNN
RNNs; see :mod:`laplace_glas.autodiff.kernels`); :func:`autodiff_friendly` switches them to
differentiable equivalents around GLAS's own computations only and restores the caller's settings
afterwards. The model also runs in evaluation mode there: the posterior is a
statement about the deterministic network at its MAP, so dropout is off and batch
normalisation uses (and does not update) its running statistics, whatever mode the
caller left the model in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from laplace_glas.autodiff.kernels import differentiable_kernels

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
    """Run ``model`` in eval mode (:func:`evaluation_mode`) with differentiable kernels
    (:func:`laplace_glas.autodiff.kernels.differentiable_kernels`) while the block runs.

    Fused kernels without a forward-mode derivative are switched off: the attention
    fast path and SDPA's flash / memory-efficient kernels (``torch.func.jvp`` raises
    ``NotImplementedError: Trying to use forward AD with
    aten::_transformer_encoder_layer_fwd``), oneDNN's and cuDNN's RNN kernels (``...
    mkldnn_rnn_layer``). The caller's settings come back on exit. Eval mode also keeps
    ``vmap`` working (dropout in train mode draws random numbers, which ``vmap``
    refuses) and batch-norm statistics untouched.
    """
    with evaluation_mode(model), differentiable_kernels(model):
        yield
