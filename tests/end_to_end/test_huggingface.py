"""Hugging Face models (built from configs, no downloads) and peft LoRA adapters.

The transformers/peft tests skip when the ``llm`` extra is not installed; the wrapper's
own tests run everywhere.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import output_jacobian, softmax_ggn
from laplace import Laplace
from torch import nn

from laplace_glas import select_dimension
from laplace_glas.huggingface import LogitsModel, causal_lm_batch

try:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover - depends on the environment
    transformers = None
try:
    import peft
except ImportError:  # pragma: no cover
    peft = None

needs_transformers = pytest.mark.skipif(
    transformers is None,
    reason="transformers is not installed (the 'llm' extra: pip install -e '.[llm]')",
)
needs_peft = pytest.mark.skipif(
    transformers is None or peft is None,
    reason="transformers and peft are not installed (the 'llm' extra: pip install -e '.[llm]')",
)

PAD, VOCAB = 0, 12


# ---------------------------------------------------------------------- helpers
def gpt2(dtype=torch.float64, n_layer=1, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=8,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


def bert_classifier(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=PAD,
    )
    return transformers.BertForSequenceClassification(config).to(dtype).eval()


def padded_tokens(n, length, g):
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def fit(model, data, k, **kw):
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas",
        n_components=k, **kw,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    return la


def explicit_ggn(model, batches, ignore_index=-100):
    """``(1/N) sum`` over non-ignored targets of ``J^T (diag p - p p^T) J``, by
    ``jacrev`` over the trainable parameters only."""
    G, N = 0.0, 0
    for batch in batches:
        G_batch, n = softmax_ggn(*output_jacobian(model, batch), batch["labels"], ignore_index)
        G, N = G + G_batch, N + n
    return G / N


def top(G, k):
    return torch.linalg.eigvalsh(G).flip(0)[:k]


# ---------------------------------------------------------------------- wrapper
class _FakeOutput(dict):
    """Stands in for a ModelOutput (a mapping with attribute access)."""

    __getattr__ = dict.get


class _Fake(nn.Module):
    def __init__(self, with_logits=True):
        super().__init__()
        self.lin = nn.Embedding(VOCAB, 3)
        self.with_logits = with_logits
        self.seen = None

    def forward(self, input_ids, attention_mask=None):
        self.seen = (input_ids, attention_mask)
        out = self.lin(input_ids)
        return _FakeOutput(logits=out) if self.with_logits else SimpleNamespace(hidden=out)


def test_logits_model_passes_the_input_keys_only_and_returns_logits():
    fake = _Fake()
    model = LogitsModel(fake)
    ids, mask = torch.tensor([[3, 4, 0]]), torch.tensor([[1, 1, 0]])
    out = model({"input_ids": ids, "attention_mask": mask, "labels": ids})
    assert out.shape == (1, 3, 3)
    assert fake.seen[0] is ids and fake.seen[1] is mask
    model(ids)  # a tensor is the input_ids, no mask
    assert fake.seen[1] is None


def test_logits_model_errors():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        LogitsModel(lambda x: x)
    with pytest.raises(ValueError, match="input_keys"):
        LogitsModel(_Fake(), input_keys="input_ids")
    with pytest.raises(ValueError, match="none of the input keys"):
        LogitsModel(_Fake())({"tokens": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(TypeError, match="mapping batch or a tensor"):
        LogitsModel(_Fake())([1, 2])
    with pytest.raises(TypeError, match="without a 'logits' tensor"):
        LogitsModel(_Fake(with_logits=False))(torch.zeros(1, 2, dtype=torch.long))


def test_causal_lm_batch_shifts_and_masks_padding():
    ids = torch.tensor([[1, 5, 6, 2], [1, 7, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    batch = causal_lm_batch(ids, mask, ignore_index=-1)
    assert torch.equal(batch["input_ids"], ids[:, :3])
    assert torch.equal(batch["attention_mask"], mask[:, :3])
    assert torch.equal(batch["labels"], torch.tensor([[5, 6, 2], [7, -1, -1]]))
    assert torch.equal(causal_lm_batch(ids)["labels"], ids[:, 1:])
    with pytest.raises(ValueError, match="L >= 2"):
        causal_lm_batch(ids[:, :1])
    with pytest.raises(TypeError, match="integer token ids"):
        causal_lm_batch(ids.float())
    with pytest.raises(ValueError, match="does not match"):
        causal_lm_batch(ids, mask[:, :2])


# ---------------------------------------------------------------------- transformers
@needs_transformers
def test_gpt2_token_ggn_matches_explicit_and_padding_is_left_out():
    g = torch.Generator().manual_seed(0)
    model = LogitsModel(gpt2())
    ids, mask = padded_tokens(4, 7, g)
    batches = [causal_lm_batch(ids[:2], mask[:2]), causal_lm_batch(ids[2:], mask[2:])]
    n_tokens = int(sum((b["labels"] != -100).sum() for b in batches))
    assert n_tokens < 4 * 6  # there is padding
    G = explicit_ggn(model, batches)
    la = fit(model, batches, 3)
    assert la.n_data == n_tokens  # N: padding positions left out
    torch.testing.assert_close(la.eigenvalues, top(G, 3), rtol=1e-7, atol=1e-10)
    # other tokens at the padding positions: the same curvature
    noisy = [
        {**b, "input_ids": b["input_ids"].masked_fill(b["attention_mask"] == 0, 7)} for b in batches
    ]
    torch.testing.assert_close(fit(model, noisy, 3).eigenvalues, la.eigenvalues)
    # the same sequences without any padding, one batch per sequence
    unpadded = [
        causal_lm_batch(ids[i : i + 1, : int(mask[i].sum())], mask[i : i + 1, : int(mask[i].sum())])
        for i in range(4)
    ]
    torch.testing.assert_close(fit(model, unpadded, 3).eigenvalues, la.eigenvalues)


@needs_transformers
def test_bert_classifier_attention_mask_keeps_padding_out():
    """Bidirectional attention: padding would reach every position without the mask."""
    g = torch.Generator().manual_seed(1)
    ids, mask = padded_tokens(8, 6, g)
    labels = torch.randint(0, 3, (8,), generator=g)
    other = ids.masked_fill(mask == 0, 9)
    assert not torch.equal(other, ids)
    model = LogitsModel(bert_classifier())

    def batches(x):
        return [{"input_ids": x, "attention_mask": mask, "labels": labels}]

    la = fit(model, batches(ids), 3)
    torch.testing.assert_close(la.eigenvalues, top(explicit_ggn(model, batches(ids)), 3))
    torch.testing.assert_close(fit(model, batches(other), 3).eigenvalues, la.eigenvalues)
    probs = la(batches(ids)[0], pred_type="glm")
    torch.testing.assert_close(la(batches(other)[0], pred_type="glm"), probs)
    unmasked = LogitsModel(model.model, input_keys=("input_ids",))
    assert not torch.allclose(fit(unmasked, batches(other), 3).eigenvalues, la.eigenvalues)


@needs_transformers
def test_gpt2_predictives_and_calibration_on_dict_batches():
    g = torch.Generator().manual_seed(2)
    model = LogitsModel(gpt2(torch.float32, n_layer=2))
    ids, mask = padded_tokens(16, 7, g)
    train = [causal_lm_batch(ids[i : i + 8], mask[i : i + 8]) for i in (0, 8)]
    la = fit(model, train, 4)
    batch = train[0]
    for kw in ({"pred_type": "glm"}, {"pred_type": "nn", "link_approx": "mc", "n_samples": 10}):
        probs = la(batch, **kw)
        assert probs.shape == (8, 6, VOCAB)
        torch.testing.assert_close(probs.sum(-1), torch.ones(8, 6), rtol=1e-5, atol=1e-5)
    cids, cmask = padded_tokens(8, 7, g)
    calib = [causal_lm_batch(cids[:4, :5], cmask[:4, :5]), causal_lm_batch(cids[4:], cmask[4:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = select_dimension(
            la, calib, 0.9, ks=[1, 4], n_samples=10, generator=torch.Generator().manual_seed(0)
        )
    assert all(0 < row.coverage <= 1 for row in sel.rows)


# ---------------------------------------------------------------------- peft LoRA
def lora(model, task_type="CAUSAL_LM", seed=0):
    config = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["c_attn"],
        lora_dropout=0.0,
        fan_in_fan_out=True,  # GPT-2's Conv1D stores W^T
        task_type=task_type,
    )
    model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero; move off it so every adapter matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return LogitsModel(model).eval()


@needs_peft
@pytest.mark.parametrize("solver", ["auto", "lanczos"])
def test_lora_posterior_lives_on_the_adapters(solver):
    g = torch.Generator().manual_seed(3)
    model = lora(gpt2(n_layer=2))
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids, mask = padded_tokens(8, 6, g)
    batches = [causal_lm_batch(ids[:4], mask[:4]), causal_lm_batch(ids[4:], mask[4:])]
    la = fit(model, batches, 5, solver=solver)
    D = sum(p.numel() for p in adapters)
    assert la.n_params == D and la.mean.shape == (D,) and la.eigenvectors.shape == (D, 5)
    assert la.lanczos_info.operator == ("jacobian" if solver == "auto" else "curvlinops")
    torch.testing.assert_close(la.eigenvalues, top(explicit_ggn(model, batches), 5))
    for n, p in model.named_parameters():
        assert p.grad is None
        if not p.requires_grad:
            assert torch.equal(p, frozen[n])
    probs = la(batches[0], pred_type="glm")
    assert probs.shape == (4, 5, VOCAB)


@needs_peft
def test_the_readmes_hugging_face_snippet_runs_quietly_with_the_stated_shape():
    """The README's snippet, run as written in a fresh interpreter on a right-padded
    batch: nothing on stderr (no warning, e.g. transformers' about special-token ids
    outside the vocabulary) and probabilities of the shape its comment states,
    (batch, seq_len - 1, vocab)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (snippet,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.DOTALL)
        if "causal_lm_batch(" in block
    ]
    assert "(batch, seq_len - 1, vocab)" in snippet
    data = (
        "import torch\n"
        "torch.manual_seed(0)\n"
        "input_ids = torch.randint(1, 40, (3, 7))\n"
        "attention_mask = torch.ones(3, 7, dtype=torch.long)\n"
        "attention_mask[1, 5:] = 0\n"
    )
    check = "\nprint(tuple(probs.shape))\n"
    result = subprocess.run(
        [sys.executable, "-c", data + snippet + check],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # peft's get_peft_model calls transformers' deprecated is_gradient_checkpointing
    # (between those two libraries; nothing the snippet can set)
    foreign = re.compile(r"is_gradient_checkpointing. is deprecated|^\s+warnings\.warn\(")
    printed = [line for line in result.stderr.splitlines() if not foreign.search(line)]
    assert not printed, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "(3, 6, 40)"
