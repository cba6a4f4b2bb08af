"""Sequence models: per-token cross-entropy GGN, predictive shapes, token coverage."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import curvlinops_token_ggn, output_jacobian, softmax_ggn
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas import coverage, select_dimension
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.losses import TokenCrossEntropy
from laplace_glas.curvature.solvers.solve import compute_eigenpairs

PAD, BOS, VOCAB = 0, 1, 6


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = 8, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)
        self.to(dtype)

    def forward(self, tokens):
        if isinstance(tokens, dict):
            tokens = tokens["input_ids"]
        return self.head(self.lstm(self.embed(tokens))[0])


def grammar(n: int, generator: torch.Generator, length: int = 7):
    """BOS, then pairs (a, b): a uniform in {2, 3}, b = 4 if a == 2 else 5; random
    lengths, padded with PAD (ignored)."""
    seqs = torch.full((n, length), PAD)
    seqs[:, 0] = BOS
    for i in range(n):
        n_tokens = int(torch.randint(3, length + 1, (1,), generator=generator))
        for t in range(1, n_tokens):
            if t % 2 == 1:
                seqs[i, t] = 2 + int(torch.randint(0, 2, (1,), generator=generator))
            else:
                seqs[i, t] = 4 if seqs[i, t - 1] == 2 else 5
    x, y = seqs[:, :-1].clone(), seqs[:, 1:].clone()
    return x, y


@pytest.fixture(scope="module")
def trained():
    g = torch.Generator().manual_seed(0)
    x, y = grammar(200, g)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    loss = TokenCrossEntropy("mean", ignore_index=PAD)
    for _ in range(150):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    model.eval()
    return model, x, y


def fit(model, x, y, **kw):
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="glas",
        ignore_index=PAD,
        **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(DataLoader(TensorDataset(x, y), batch_size=64))
    return la


def explicit_token_ggn(model, x, y):
    """(1/T) sum over non-padding tokens of J_t^T (diag p - p p^T) J_t."""
    G, n_tokens = softmax_ggn(*output_jacobian(model, x), y, PAD)
    return G / n_tokens


def test_tiny_lstm_ggn_matches_explicit():
    g = torch.Generator().manual_seed(1)
    x, y = grammar(10, g)
    model = TinyLM(dtype=torch.float64)
    G = explicit_token_ggn(model, x, y)
    op, n_tokens = curvlinops_token_ggn(model, x, y, PAD, batch_size=3)
    V = torch.randn(G.shape[0], 4, dtype=torch.float64, generator=g)
    with autodiff_friendly(model):
        GV = (op @ V) / n_tokens
    torch.testing.assert_close(GV, G @ V, rtol=1e-10, atol=1e-12)
    with autodiff_friendly(model):
        eig = compute_eigenpairs(
            op,
            4,
            scale=1 / n_tokens,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(0),
        )
    ref = torch.linalg.eigvalsh(G).flip(0)[:4]
    torch.testing.assert_close(eig.values, ref, rtol=1e-8, atol=1e-12)


def test_glas_fit_on_lstm_counts_tokens_and_matches_explicit(trained):
    model, x, y = trained
    la = fit(model, x[:40], y[:40], n_components=3)
    assert la.n_data == int((y[:40] != PAD).sum())  # N = tokens, padding excluded
    G = explicit_token_ggn(model, x[:40], y[:40])
    ref = torch.linalg.eigvalsh(G.double()).flip(0)[:3]
    torch.testing.assert_close(la.eigenvalues.double(), ref, rtol=1e-3, atol=0)


@pytest.mark.parametrize("link, k", [("probit", 4), ("mc", 4), ("bridge", VOCAB)])
def test_glm_predictive_per_token(trained, link, k):
    model, x, y = trained
    # k = 4 < 6 classes: rank-deficient output covariance (probit and mc take it; the
    # bridge needs k >= C, see test_bridge_refuses_a_rank_deficient_covariance)
    la = fit(model, x, y, n_components=k)
    probs = la(
        x[:5],
        pred_type="glm",
        link_approx=link,
        n_samples=50,
        generator=torch.Generator().manual_seed(0),
    )
    assert probs.shape == (5, x.shape[1], VOCAB)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, x.shape[1]), rtol=1e-5, atol=1e-5)
    assert (probs >= 0).all()


def test_nn_predictive_and_samples_per_token(trained):
    model, x, y = trained
    la = fit(model, x, y, n_components=4)
    g = torch.Generator().manual_seed(0)
    probs = la(x[:5], pred_type="nn", link_approx="mc", n_samples=20, generator=g)
    assert probs.shape == (5, x.shape[1], VOCAB)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, x.shape[1]), rtol=1e-5, atol=1e-5)
    samples = la.predictive_samples(x[:5], pred_type="nn", n_samples=3)
    assert samples.shape == (3, 5, x.shape[1], VOCAB)


def test_per_token_coverage_on_toy_grammar(trained):
    """Free tokens (2 or 3, p = 1/2 each) need a 2-token set, determined ones 1 token:
    90% credible sets cover every true next token with mean size between the two."""
    model, x, y = trained
    la = fit(model, x, y, n_components=4)
    g = torch.Generator().manual_seed(5)
    xc, yc = grammar(100, g)
    # a tight prior keeps the predictive near the MAP, whose sets are known
    sel = select_dimension(
        la,
        DataLoader(TensorDataset(xc, yc), batch_size=50),
        0.9,
        ks=[1, 4],
        prior_precisions=[1e3],
        empirical_bayes=False,
        pred_type="nn",
        n_samples=30,
        generator=g,
    )
    valid = yc != PAD
    free = ((yc == 2) | (yc == 3)) & valid
    expected_size = (2 * free.sum() + (valid & ~free).sum()) / valid.sum()
    for row in sel.rows:
        assert row.coverage > 0.95
        assert abs(row.mean_width - float(expected_size)) < 0.25, (row, expected_size)


def test_subsampled_fit_is_reproducible(trained):
    model, x, y = trained
    a = fit(model, x, y, n_components=3, subsample_size=50, seed=3)
    b = fit(model, x, y, n_components=3, subsample_size=50, seed=3)
    c = fit(model, x, y, n_components=3, subsample_size=50, seed=4)
    assert torch.equal(a.eigenvalues, b.eigenvalues) and torch.equal(a.eigenvectors, b.eigenvectors)
    assert not torch.equal(a.eigenvalues, c.eigenvalues)
    assert a.lanczos_info.n_data == int((y != PAD).sum()) or a.lanczos_info.n_data < a.n_data


def test_dict_batches(trained):
    model, x, y = trained
    data = [{"input_ids": x[i : i + 50], "labels": y[i : i + 50]} for i in range(0, 200, 50)]
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="glas",
        ignore_index=PAD,
        n_components=3,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    ref = fit(model, x, y, n_components=3)
    torch.testing.assert_close(la.eigenvalues, ref.eigenvalues, rtol=1e-4, atol=0)
    probs = la({"input_ids": x[:3]}, pred_type="glm")
    assert probs.shape == (3, x.shape[1], VOCAB)


def test_calibration_accepts_sequence_batches_of_different_lengths(trained):
    model, x, y = trained
    la = fit(model, x, y, n_components=3)
    batches = [(x[:20, :4], y[:20, :4]), (x[20:40], y[20:40])]
    sel = select_dimension(
        la,
        batches,
        0.9,
        ks=[1, 3],
        pred_type="glm",
        n_samples=20,
        prior_precisions=[1e3],
        empirical_bayes=False,
        generator=torch.Generator().manual_seed(0),
    )
    full = select_dimension(
        la,
        [(x[20:40], y[20:40])],
        0.9,
        ks=[1, 3],
        pred_type="glm",
        n_samples=20,
        prior_precisions=[1e3],
        empirical_bayes=False,
        generator=torch.Generator().manual_seed(0),
    )
    assert all(0 < r.coverage <= 1 for r in sel.rows) and len(sel.rows) == len(full.rows)


def test_with_loss_scaling_shares_eigenpairs(trained):
    model, x, y = trained
    la = fit(model, x, y, n_components=3, loss_scaling="mean", complement="zero")
    other = la.with_loss_scaling("sum")
    assert other.loss_scaling == "sum" and la.loss_scaling == "mean"
    assert other.H[0] is la.H[0]  # shared, not recomputed
    ratio = (1 / other.posterior_variances - other.prior_precision) / (
        1 / la.posterior_variances - la.prior_precision
    )
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(la.n_data)), rtol=1e-4, atol=0)
    other.prior_precision = 5.0
    assert float(la.prior_precision) == 1.0
    with pytest.raises(ValueError, match="loss_scaling must be"):
        la.loss_scaling = "median"


def test_bridge_refuses_a_rank_deficient_covariance(trained):
    """With k < C the restricted posterior's logit covariance has rank <= k: the bridge's
    conditioned per-class variances would be round-off (it returned rows of [1, 1, ...]
    or flipped classes), so it is refused with the alternatives named."""
    model, x, y = trained
    la = fit(model, x, y, n_components=VOCAB - 1, complement="zero")
    for link in ("bridge", "bridge_norm"):
        with pytest.raises(ValueError, match=r"full rank C = 6.*k = 5.*probit"):
            la(x[:2], link_approx=link)
    la.complement = "prior"  # the prior's J J^T / tau makes it full rank
    probs = la(x[:2], link_approx="bridge")
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, x.shape[1]), rtol=1e-5, atol=1e-5)


def test_prior_complement_with_dict_inputs_matches_tensor_inputs(trained):
    """The prior's J J^T term cuts mapping inputs into chunks along the batch axis."""
    model, x, y = trained
    la = fit(model, x, y, n_components=3, complement="prior")
    tensor_probs = la(x[:40], link_approx="probit")
    dict_probs = la({"input_ids": x[:40]}, link_approx="probit")  # 40 > 32 rows: 2 chunks
    torch.testing.assert_close(dict_probs, tensor_probs, rtol=1e-6, atol=1e-7)
    _, var_t = la._glm_predictive_distribution(x[:3], joint=True)
    _, var_d = la._glm_predictive_distribution({"input_ids": x[:3]}, joint=True)
    torch.testing.assert_close(var_d, var_t, rtol=1e-6, atol=1e-7)


class FeatureTagger(nn.Module):
    """Causal per-step model on float features ``(batch, seq_len, 3)``."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 5, batch_first=True)
        self.out = nn.Linear(5, VOCAB)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def test_calibration_pads_the_time_axis_of_feature_inputs():
    """Batches of (batch, seq_len, features) with different seq_len are padded along
    the time axis (was: along the features, a crash)."""
    torch.manual_seed(0)
    model = FeatureTagger().eval()
    x = torch.randn(30, 7, 3)
    y = torch.randint(1, VOCAB, (30, 7))
    la = fit(model, x, y, n_components=3)
    short, full = (x[:10, :5], y[:10, :5]), (x[10:], y[10:])
    padded_x = torch.cat([torch.nn.functional.pad(short[0], (0, 0, 0, 2)), full[0]])
    padded_y = torch.cat([torch.nn.functional.pad(short[1], (0, 2), value=PAD), full[1]])
    g = torch.Generator
    got = coverage(la, [short, full], 0.9, n_samples=20, generator=g().manual_seed(0))
    ref = coverage(la, [(padded_x, padded_y)], 0.9, n_samples=20, generator=g().manual_seed(0))
    assert got == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize(
    "labels, match",
    [
        (lambda y: y.clamp(max=VOCAB - 1).index_fill(0, torch.tensor([0]), VOCAB), "lie in"),
        (lambda y: y.float(), "integer class labels"),
        (lambda y: torch.full_like(y, PAD), "Every calibration target equals ignore_index"),
    ],
)
def test_calibration_checks_labels(trained, labels, match):
    model, x, y = trained
    la = fit(model, x, y, n_components=3)
    with pytest.raises(ValueError, match=match):
        coverage(la, [(x[:10], labels(y[:10]))], 0.9, n_samples=10)


@pytest.mark.parametrize("pred_type", ["glm", "nn"])
def test_samples_keep_the_sequence_axes(trained, pred_type):
    """functional_samples / predictive_samples return (S, batch, seq_len, vocab) for both
    predictives (the 'glm' ones came back as (S, batch * seq_len, vocab))."""
    model, x, y = trained
    la = fit(model, x, y, n_components=3)
    draws = {}
    for name in ("functional_samples", "predictive_samples"):
        draws[name] = getattr(la, name)(
            x[:4], pred_type=pred_type, n_samples=5, generator=torch.Generator().manual_seed(1)
        )
        assert draws[name].shape == (5, 4, x.shape[1], VOCAB)
    torch.testing.assert_close(
        draws["predictive_samples"], torch.softmax(draws["functional_samples"], -1)
    )
