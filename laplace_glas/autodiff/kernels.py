"""Differentiable kernels for GLAS's forward-mode computations.

GLAS differentiates the network in forward mode (``torch.func.jvp``, under
``torch.func.vmap``) for the GGN products and the 'glm' predictive. Several of
PyTorch's fused kernels have no forward-mode derivative, and PyTorch picks them on its
own for the caller's ordinary modules:

* attention: ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` /
  ``nn.TransformerEncoder`` in evaluation mode take the "fast path"
  (``aten::_native_multi_head_attention``, ``aten::_transformer_encoder_layer_fwd``);
  ``F.scaled_dot_product_attention`` (also inside Hugging Face models) dispatches to
  the flash or memory-efficient kernels (``_scaled_dot_product_flash_attention_for_cpu``
  on the CPU). :func:`differentiable_kernels` switches the fast path off
  (``torch.backends.mha.set_fastpath_enabled(False)``) and restricts SDPA to its math
  kernel (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``), which computes
  ``softmax(Q K^T / sqrt(d) + mask) V`` from elementary, differentiable ops, with the
  same masks (``attn_mask``, ``is_causal``, key padding) as the fused kernels.
* recurrent layers: oneDNN's ``mkldnn_rnn_layer`` on the CPU and cuDNN / the fused
  ``_thnn_fused_*_cell`` kernels elsewhere; with a ``nn.RNNBase`` in the model oneDNN
  and cuDNN are switched off and, off the CPU, the layers run through
  :func:`laplace_glas.autodiff.rnn.elementary_rnn_forward`.

The switches are process-wide flags; they hold inside the block only, and the caller's
settings (the fast-path flag, the enabled SDPA backends, the oneDNN and cuDNN flags) are
restored on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from laplace_glas.autodiff.rnn import elementary_rnns

__all__ = ["attention_math_kernels", "differentiable_kernels", "recurrent_elementary_kernels"]


@contextlib.contextmanager
def attention_math_kernels() -> Iterator[None]:
    """Attention through differentiable kernels inside the block.

    The ``nn.MultiheadAttention`` / ``nn.Transformer*Layer`` fast path is off and
    ``F.scaled_dot_product_attention`` uses its math kernel only; the caller's
    fast-path flag and SDPA backends are restored afterwards.
    """
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


@contextlib.contextmanager
def recurrent_elementary_kernels(model: nn.Module) -> Iterator[None]:
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` of ``model`` off the fused kernels inside the
    block (oneDNN and cuDNN off; elementary forwards off the CPU). A model without a
    recurrent layer is left alone.
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


@contextlib.contextmanager
def differentiable_kernels(model: nn.Module) -> Iterator[None]:
    """Every kernel switch GLAS needs for forward-mode AD of ``model``, inside the block:
    :func:`attention_math_kernels` and :func:`recurrent_elementary_kernels`.
    """
    with attention_math_kernels(), recurrent_elementary_kernels(model):
        yield
