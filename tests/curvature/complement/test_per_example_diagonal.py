"""The per-example GGN diagonal against the explicit GGN ``sum_n J_n^T Lambda_n J_n``
(``jacrev``), on one small model of each layer kind BackPACK does not cover."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import output_jacobian, softmax_ggn
from torch import nn
from torch.nn import functional as F

from laplace_glas.curvature.complement.diagonal import ggn_diagonal, shared_parameters
from laplace_glas.curvature.complement.per_example_diagonal import (
    batch_ggn_diagonal,
    loss_hessian_columns,
    per_example_ggn_diagonal,
)

DOUBLE = torch.float64


class LSTMClassifier(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.rnn = nn.LSTM(2, 5, batch_first=True)
        self.head = nn.Linear(5, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class TinyTransformer(nn.Module):
    def __init__(self, outputs: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class FunctionalWeights(nn.Module):
    """A layer's weights read through ``F.linear`` by its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.inner.weight, self.inner.bias)))


class Tied(nn.Module):
    """One ``nn.Linear`` used twice (shared weight and bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.second.weight, self.second.bias = self.first.weight, self.first.bias
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(torch.tanh(self.first(x))))


def _hf_conv1d_model() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    del transformers
    return nn.Sequential(Conv1D(4, 3), nn.Tanh(), nn.Linear(4, 2))


CASES = {
    "lstm": (LSTMClassifier, (7, 4, 2), "classification"),
    "gru": (lambda: nn.Sequential(), None, None),  # placeholder replaced below
    "transformer": (TinyTransformer, (7, 4, 3), "regression"),
    "layernorm": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Tanh(), nn.Linear(4, 3)),
        (7, 3),
        "classification",
    ),
    "embedding": (
        lambda: nn.Sequential(nn.Embedding(6, 2), nn.Flatten(), nn.Linear(6, 2)),
        "tokens",
        "regression",
    ),
    "functional": (FunctionalWeights, (7, 3), "classification"),
    "tied": (Tied, (7, 3), "regression"),
    "conv1d_hf": (_hf_conv1d_model, (7, 3), "regression"),
}
del CASES["gru"]


def _explicit_diagonal(model: nn.Module, X: torch.Tensor, y: torch.Tensor, likelihood: str):
    out, J = output_jacobian(model, X)
    if likelihood == "regression":
        return torch.einsum("tcd,tcd->d", J, J)
    return torch.diagonal(softmax_ggn(out, J, y)[0])


def _data(case: str, gen: torch.Generator):
    _, shape, likelihood = CASES[case]
    if shape == "tokens":
        X = torch.randint(0, 6, (7, 3), generator=gen)
    else:
        X = torch.randn(*shape, generator=gen, dtype=DOUBLE)
    return X, likelihood


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_the_explicit_ggn_diagonal(case):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = CASES[case][0]().to(DOUBLE).eval()
    X, likelihood = _data(case, gen)
    with torch.no_grad():
        out = model(X)
    if likelihood == "regression":
        y = torch.randn(out.shape, generator=gen, dtype=DOUBLE)
    else:
        y = torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen)
    loader = [(X[:4], y[:4]), (X[4:], y[4:])]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    result = per_example_ggn_diagonal(model, loader, likelihood)
    want = _explicit_diagonal(model, X, y, likelihood)
    torch.testing.assert_close(result, want, rtol=1e-10, atol=1e-12)
    # the entry point: BackPACK refuses these, or would count tied weights once
    torch.testing.assert_close(ggn_diagonal(model, loader, likelihood), want)
    # a subset of the parameters: those entries alone
    sizes = [p.numel() for n, p in model.named_parameters() if p.requires_grad]
    part = batch_ggn_diagonal(model, names[-2:], X, y, likelihood)
    torch.testing.assert_close(part, want[-sum(sizes[-2:]) :], rtol=1e-10, atol=1e-12)


def test_tied_weights_are_named_and_backpack_is_bypassed():
    model = Tied()
    assert "first.weight" in shared_parameters(model) and "second.weight" in shared_parameters(
        model
    )
    assert shared_parameters(nn.Sequential(nn.Linear(2, 2))) is None


def test_ignored_tokens_contribute_nothing_and_per_token_outputs_are_exact():
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Tanh(), nn.Linear(3, 4)).to(DOUBLE).eval()
    X = torch.randint(0, 5, (6, 3), generator=gen)
    y = torch.randint(0, 4, (6, 3), generator=gen)
    y[0, 1] = y[3, 2] = -100
    got = batch_ggn_diagonal(model, [n for n, _ in model.named_parameters()], X, y,
                             "classification")  # fmt: skip
    out, J = output_jacobian(model, X)
    want = torch.diagonal(softmax_ggn(out, J, y)[0])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_columns_factor_the_softmax_hessian():
    f = torch.randn(4, 5, dtype=DOUBLE)
    L = loss_hessian_columns(f, "classification")
    p = torch.softmax(f, -1)
    torch.testing.assert_close(
        L @ L.transpose(-1, -2), torch.diag_embed(p) - p[..., None] * p[..., None, :]
    )


def test_the_monte_carlo_estimate_is_unbiased_and_opt_in():
    torch.manual_seed(0)
    model = LSTMClassifier(4).to(DOUBLE).eval()
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(6, 3, 2, generator=gen, dtype=DOUBLE)
    y = torch.randint(0, 4, (6,), generator=gen)
    names = [n for n, _ in model.named_parameters()]
    exact = batch_ggn_diagonal(model, names, X, y, "classification")
    draws = torch.stack([
        batch_ggn_diagonal(model, names, X, y, "classification", estimator="mc",
                           generator=torch.Generator().manual_seed(s))
        for s in range(400)
    ])  # fmt: skip
    single = draws[0]
    assert not torch.allclose(single, exact)  # one draw is an estimate
    # the mean of 400 draws: within 4 standard errors of the exact diagonal everywhere
    stderr = draws.std(0) / 20
    assert bool(((draws.mean(0) - exact).abs() <= 4 * stderr + 1e-12).all())
    with pytest.raises(ValueError, match="diagonal_estimator"):
        per_example_ggn_diagonal(model, [(X, y)], "classification", estimator="sampled")


def test_mismatched_targets_are_named():
    model = nn.Linear(3, 2).to(DOUBLE)
    X = torch.randn(4, 3, dtype=DOUBLE)
    with pytest.raises(ValueError, match="Regression targets of shape"):
        batch_ggn_diagonal(model, ["weight"], X, torch.randn(4, dtype=DOUBLE), "regression")
    with pytest.raises(ValueError, match="Classification targets of shape"):
        batch_ggn_diagonal(model, ["weight"], X, torch.zeros(4, 2).long(), "classification")


class _FrozenCheckpointed(nn.Module):
    """A frozen first layer under reentrant checkpointing (an ``autograd.Function``
    torch.func cannot transform), then trainable layers."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(3, 4).requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(
            lambda z: torch.tanh(self.frozen(z)), x, use_reentrant=True
        )
        return self.head(hidden * self.scale)


def test_what_torch_func_refuses_falls_back_to_autograd_and_stays_exact():
    torch.manual_seed(0)
    model = _FrozenCheckpointed().to(DOUBLE).eval()
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(6, 3, generator=gen, dtype=DOUBLE)
    y = torch.randn(6, 2, generator=gen, dtype=DOUBLE)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on inputs without grad
        got = batch_ggn_diagonal(model, names, X, y, "regression")
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings():  # the reference: autograd's Jacobian, per parameter
        warnings.simplefilter("ignore")
        J = torch.cat(
            [
                torch.autograd.functional.jacobian(
                    lambda v, n=n: torch.func.functional_call(model, {**params, n: v}, (X,)),
                    params[n],
                ).reshape(6, 2, -1)
                for n in names
            ],
            dim=-1,
        )
    torch.testing.assert_close(got, J.square().sum((0, 1)), rtol=1e-10, atol=1e-12)


class TokenModel(nn.Module):
    """Per-token logits over a vocabulary too wide for the exact per-example pass."""

    def __init__(self, vocab: int = 1000, width: int = 4) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _laplace(model, **options):
    from laplace import Laplace

    import laplace_glas  # noqa: F401

    return Laplace(model, "classification", subset_of_weights="all", hessian_structure="glas",
                   n_components=2, **options)  # fmt: skip


def test_diagonal_estimator_mc_through_laplace_is_seeded_unbiased_and_bypasses_backpack():
    """``Laplace(..., diagonal_estimator='mc')``: the complement's diagonal is the
    per-example Monte Carlo estimate (BackPACK, which covers this MLP, is bypassed),
    reproducible for one ``seed``, and its mean over seeds is the exact diagonal."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(24, 3, generator=gen, dtype=DOUBLE)
    y = torch.randint(0, 4, (24,), generator=gen)
    data = [(X[:12], y[:12]), (X[12:], y[12:])]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).to(DOUBLE)
    exact = _laplace(model, complement="diag")
    exact.fit(data)
    draws = []
    for seed in range(200):
        la = _laplace(model, complement="diag", diagonal_estimator="mc", seed=seed)
        la.fit(data)
        draws.append(la._ggn_diagonal)
    draws = torch.stack(draws)
    again = _laplace(model, complement="diag", diagonal_estimator="mc", seed=0)
    again.fit(data)
    torch.testing.assert_close(again._ggn_diagonal, draws[0], rtol=0, atol=0)
    assert not torch.allclose(draws[0], exact._ggn_diagonal)
    stderr = draws.std(0) / 200**0.5
    assert bool(((draws.mean(0) - exact._ggn_diagonal).abs() <= 4 * stderr + 1e-12).all())
    with pytest.raises(ValueError, match="diagonal_estimator must be 'exact' or 'mc'"):
        _laplace(model, diagonal_estimator="sampled")


def test_mc_gives_a_diagonal_where_the_exact_pass_refuses_a_wide_vocabulary():
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (6, 8))
    data = [(tokens[:, :-1], tokens[:, 1:])]
    model = TokenModel()
    with pytest.raises(ValueError, match="diagonal_estimator='mc'"):
        batch_ggn_diagonal(model, ["embed.weight"], tokens[:, :-1], tokens[:, 1:],
                           "classification")  # fmt: skip
    la = _laplace(model, diagonal_estimator="mc")  # 'auto': KFAC refuses per-token labels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    assert la.complement == "diag"
    D = sum(p.numel() for p in model.parameters())
    assert la._ggn_diagonal.shape == (D,) and bool((la._ggn_diagonal > 0).any())
    assert torch.isfinite(la(tokens[:2, :-1], pred_type="glm")[1]).all()
