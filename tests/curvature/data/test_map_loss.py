"""The data side of fit (``laplace_glas.curvature.data.map_loss``), checked directly.

``curvature_loss`` must return a loss and a factor ``c`` such that ``c`` times
curvlinops' GGN of that loss is the unit-noise mean-loss GGN
``G_1 = (1/N) sum_n J_n^T Lambda_n J_n``; the reference forms it densely from
``torch.func`` Jacobians and the loss's Hessian in the outputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CountingLoader, loader
from test_custom_loss import explicit_loss_ggn
from torch import nn

from laplace_glas.curvature.data.batches import XYBatches
from laplace_glas.curvature.data.map_loss import count_terms, curvature_loss, loss_at_map
from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator
from laplace_glas.progress import progress

PAD = 0


class TinyTagger(nn.Module):
    """Embedding -> linear: per-token logits ``(batch, seq_len, vocab)``."""

    def __init__(self, vocab: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, 3)
        self.out = nn.Linear(3, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.embed(x)))


def _dense(operator, D: int) -> torch.Tensor:
    return operator @ torch.eye(D, dtype=torch.float64)


def _regression_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(10, 2, dtype=torch.float64)
    return model, X, torch.randn(10, 3, dtype=torch.float64)


def test_regression_factor_gives_unit_noise_mean_ggn():
    """MSELoss('mean') averages over the C = 3 outputs and drops the 1/2: c = C/2."""
    model, X, y = _regression_problem()
    summary = loss_at_map(model, loader(X, y, 4), "regression", dtype=torch.float64)
    assert summary.n_terms == 10 and summary.out_shape == (3,)
    assert float(summary.loss) == pytest.approx(0.5 * float((model(X).detach() - y).square().sum()))
    loss, scale, num_data = curvature_loss("regression", summary.n_terms, summary.out_shape)
    assert scale == pytest.approx(1.5)
    operator = mean_ggn_operator(
        model, loss, list(model.parameters()), XYBatches(loader(X, y, 4)), num_data
    )
    D = sum(p.numel() for p in model.parameters())
    half_sse = nn.MSELoss(reduction="sum")
    expected = explicit_loss_ggn(model, half_sse, X, y, 10) / 2  # (1/N) sum J^T J
    torch.testing.assert_close(scale * _dense(operator, D), expected, rtol=1e-10, atol=1e-12)


def test_token_classification_counts_tokens_and_scales_by_them():
    torch.manual_seed(1)
    model = TinyTagger().double()
    x = torch.randint(1, 5, (6, 4))
    y = torch.randint(1, 5, (6, 4))
    y[:, -1] = PAD  # padding: not a likelihood term
    y[0, 1:] = PAD
    n_tokens = int((y != PAD).sum())
    summary = loss_at_map(
        model, loader(x, y, 4), "classification", ignore_index=PAD, dtype=torch.float64
    )
    assert summary.n_terms == n_tokens == count_terms(loader(x, y, 3), "classification", PAD)
    assert summary.out_shape == (4, 5)
    loss, scale, _ = curvature_loss(
        "classification", summary.n_terms, summary.out_shape, ignore_index=PAD
    )
    assert scale == pytest.approx(1 / n_tokens)
    operator = mean_ggn_operator(
        model, loss, list(model.parameters()), XYBatches(loader(x, y, 4)), n_tokens
    )
    D = sum(p.numel() for p in model.parameters())

    def token_ce(out, target):
        return nn.functional.cross_entropy(
            out.reshape(-1, 5), target.reshape(-1), reduction="sum", ignore_index=PAD
        )

    expected = explicit_loss_ggn(model, token_ce, x, y, n_tokens)
    torch.testing.assert_close(scale * _dense(operator, D), expected, rtol=1e-10, atol=1e-12)


def test_user_loss_is_copied_to_the_dtype_and_scaled_by_one_over_n():
    weight = torch.tensor([1.0, 2.0, 0.5])
    user_loss = nn.CrossEntropyLoss(weight=weight, reduction="sum")
    loss, scale, num_data = curvature_loss(
        "classification", 40, torch.Size([3]), loss_fn=user_loss, dtype=torch.float64
    )
    assert loss is not user_loss and loss.weight.dtype == torch.float64
    assert user_loss.weight.dtype == torch.float32
    assert scale == pytest.approx(1 / 40) and num_data == 40


@pytest.mark.parametrize(
    "likelihood, X, y, match",
    [
        ("regression", torch.randn(4, 2), torch.randn(4), r"do not match the model output"),
        ("classification", torch.randn(4, 2), torch.tensor([0, 1, 3, 0]), r"lie in \[0, 2\]"),
        ("classification", torch.randn(4, 2), torch.rand(4), r"integer class labels"),
    ],
)
def test_bad_training_data_is_named(likelihood, X, y, match):
    model = nn.Linear(2, 1 if likelihood == "regression" else 3)
    with pytest.raises(ValueError, match=match):
        loss_at_map(model, loader(X, y), likelihood)


def test_empty_loader_and_all_padding_are_refused():
    model = TinyTagger()
    with pytest.raises(ValueError, match="empty"):
        loss_at_map(model, [], "classification")
    x = torch.randint(1, 5, (2, 3))
    with pytest.raises(ValueError, match="ignore_index"):
        loss_at_map(model, loader(x, torch.zeros_like(x)), "classification", ignore_index=PAD)


@pytest.mark.parametrize("out_shape", [(8,), (8, 4, 2)])
def test_regression_outputs_must_be_batch_by_outputs(out_shape):
    """A (batch,) output or a sequence output (batch, T, C) in regression is refused by
    name (the Gaussian normaliser counts batch * C terms; it was an IndexError or a
    silently wrong evidence)."""

    class Shaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, int(torch.Size(out_shape[1:]).numel()) or 1)

        def forward(self, x):
            return self.lin(x).reshape(x.shape[0], *out_shape[1:])

    X = torch.randn(*out_shape[:1], 3)
    y = torch.randn(out_shape)
    with pytest.raises(ValueError, match=r"Regression needs model outputs of shape \(batch"):
        loss_at_map(Shaped(), loader(X, y), "regression")


@pytest.mark.parametrize("show", [False, True])
def test_a_pass_starts_one_iterator_with_or_without_a_progress_bar(show):
    # tqdm.auto's bar called iter() when built and again when iterated: two iterators
    # (with num_workers > 0, two sets of worker processes) per pass over a DataLoader
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, generator=g), torch.randn(12, 2))
    model = nn.Linear(3, 2)
    CountingLoader.started = 0
    counting = CountingLoader(data, batch_size=4)
    result = loss_at_map(model, counting, "regression", progress_bar=show)
    assert CountingLoader.started == 1
    assert result.n_terms == 12
    bar = progress(counting, "pass", show)
    assert (bar is counting) != show
    assert len(list(bar)) == 3 and CountingLoader.started == 2
