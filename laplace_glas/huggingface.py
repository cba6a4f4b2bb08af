"""Hugging Face ``transformers`` models (and ``peft`` LoRA adapters) under GLAS.

laplace-torch's convention for such models, which GLAS follows: the loader yields
mappings (``input_ids``, ``attention_mask``, ``labels``), the whole mapping is passed
to the model, ``dict_key_x`` names the entry whose first axis is the batch and
``dict_key_y`` the target; the model returns one tensor of logits. A
``transformers`` model returns a ``ModelOutput``; :class:`LogitsModel` is the thin
wrapper that returns its ``logits``::

    model = LogitsModel(AutoModelForCausalLM.from_config(config))
    batch = causal_lm_batch(input_ids, attention_mask)  # labels: next tokens, -100 at padding

For a causal language model the logits ``(batch, seq_len, vocab)`` at position ``t``
predict token ``t + 1``; :func:`causal_lm_batch` shifts the targets accordingly (a
``transformers`` model computing its own loss shifts inside; GLAS needs the outputs
and targets aligned) and sets the targets of padding positions to ``ignore_index``,
so that they enter neither ``N`` nor the GGN

.. math::

    G_1 = \\frac{1}{N} \\sum_{n,t:\\, y_{nt} \\neq \\text{ignore}} J_{nt}^\\top
          (\\operatorname{diag} p_{nt} - p_{nt} p_{nt}^\\top) J_{nt} .

The attention mask keeps padding out of the other positions' outputs (and hence out
of their Jacobians).

With ``peft``, only the adapter weights have ``requires_grad=True``; GLAS (like
laplace-torch) takes ``D`` to be the trainable parameters, so the posterior lives on
the adapters and nothing of the frozen base's size is allocated beyond the forward
passes. Nothing here imports ``transformers`` or ``peft``: the wrapper works with any
model that returns an object with a ``logits`` entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from laplace_glas.curvature.data.batches import MissingKeyError

__all__ = ["LogitsModel", "causal_lm_batch"]


class LogitsModel(nn.Module):
    """``model(**inputs).logits`` as a plain ``nn.Module`` returning a tensor.

    The forward takes a mapping batch, or a tensor of ``input_ids`` (no attention
    mask). Inputs are moved to the model's device.

    Parameters
    ----------
    model : nn.Module
        A ``transformers`` model (or ``peft`` model), called with keyword arguments.
    input_keys : sequence of str, default=('input_ids', 'attention_mask')
        Entries of a mapping batch passed to ``model`` (when present; the first is
        required, a batch without it raises
        :class:`~laplace_glas.curvature.data.batches.MissingKeyError`); others, such as the
        ``labels``, are not (the model would compute its own loss).

    """

    def __init__(
        self, model: nn.Module, input_keys: Sequence[str] = ("input_ids", "attention_mask")
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if isinstance(input_keys, str) or not input_keys:
            raise ValueError(
                f"input_keys must be a non-empty sequence of key names, got {input_keys!r}."
            )
        self.model = model
        self.input_keys = tuple(input_keys)

    def _check_keys(self, data: Mapping[str, Any]) -> None:
        """Raise :class:`MissingKeyError` when the batch lacks the first input key."""
        required = self.input_keys[0]
        if required in data:
            return
        present = sorted(map(str, data.keys()))
        if not any(key in data for key in self.input_keys):
            problem = f"The batch has none of the input keys {list(self.input_keys)}"
        else:
            problem = f"The batch has no {required!r}"
        raise MissingKeyError(
            f"{problem}: the model's input {required!r} (the first of input_keys) is "
            f"required; the batch's keys are {present}."
        )

    def forward(self, data: Mapping[str, Any] | torch.Tensor) -> torch.Tensor:
        """The logits of ``model`` on the batch."""
        device = next(self.model.parameters()).device
        if isinstance(data, torch.Tensor):
            inputs = {self.input_keys[0]: data.to(device)}
        elif isinstance(data, Mapping):
            self._check_keys(data)
            inputs = {
                key: data[key].to(device) if isinstance(data[key], torch.Tensor) else data[key]
                for key in self.input_keys
                if key in data
            }
        else:
            raise TypeError(
                f"Expected a mapping batch or a tensor of input ids, got {type(data).__name__}."
            )
        out = self.model(**inputs)
        if isinstance(out, torch.Tensor):
            return out
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(
                f"The wrapped model returned a {type(out).__name__} without a 'logits' tensor."
            )
        return logits


def causal_lm_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """A next-token batch: inputs ``x_{0..L-2}``, targets ``x_{1..L-1}``.

    Parameters
    ----------
    input_ids : torch.Tensor
        ``(batch, L)`` token ids, right-padded (``L >= 2``).
    attention_mask : torch.Tensor, optional
        ``(batch, L)``, 1 at tokens and 0 at padding (default: all ones).
    ignore_index : int, default=-100
        Target of padding positions (GLAS's ``ignore_index``).

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask`` ``(batch, L - 1)``, and ``labels``
        ``(batch, L - 1)`` with ``labels[:, t] = input_ids[:, t + 1]`` where
        ``attention_mask[:, t + 1] = 1`` and ``ignore_index`` elsewhere.

    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise ValueError(
            f"input_ids must be a (batch, L) tensor with L >= 2, got {shape or type(input_ids)}."
        )
    if input_ids.is_floating_point():
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match "
            f"input_ids of shape {tuple(input_ids.shape)}."
        )
    labels = input_ids[:, 1:].clone()
    labels[attention_mask[:, 1:] == 0] = ignore_index
    return {
        "input_ids": input_ids[:, :-1],
        "attention_mask": attention_mask[:, :-1],
        "labels": labels,
    }
