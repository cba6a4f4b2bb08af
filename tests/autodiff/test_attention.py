"""Attention models: nn.MultiheadAttention, nn.TransformerEncoder/Decoder and
F.scaled_dot_product_attention (with and without causal masks) against explicit GGNs.

In eval mode PyTorch sends these modules to fused kernels without forward-mode
derivatives (the MHA fast path, SDPA's flash kernel); GLAS switches them off around
its own computations (laplace_glas.autodiff.kernels) and restores the caller's settings.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import curvlinops_token_ggn, output_jacobian, softmax_ggn
from laplace import Laplace
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas
from laplace_glas import activity_scores, residual_report, select_dimension
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.kernels import attention_math_kernels, differentiable_kernels
from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator
from laplace_glas.curvature.solvers.solve import compute_eigenpairs

PAD, VOCAB, T = 0, 7, 6


# ---------------------------------------------------------------------- models
class MHARegressor(nn.Module):
    """Linear -> self-attention (key padding mask from zero rows) -> mean pool -> Linear."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        pad = x.abs().sum(-1) == 0
        h = self.inp(x)
        h = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.out((h * keep).sum(1) / keep.sum(1))


class EncoderRegressor(nn.Module):
    """Linear -> nn.TransformerEncoder (default nested-tensor fast path) -> Linear."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        pad = x.abs().sum(-1) == 0
        h = self.enc(self.inp(x), src_key_padding_mask=pad)
        return self.out(h[:, 0])


class DecoderTagger(nn.Module):
    """Per-token classes from nn.TransformerDecoder (causal self-attention + memory)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.memory = nn.Parameter(torch.randn(1, 3, 8))
        layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 1)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=h.dtype)
        memory = self.memory.expand(tokens.shape[0], -1, -1)
        return self.head(self.dec(h, memory, tgt_mask=mask, tgt_is_causal=True))


class SDPALM(nn.Module):
    """A one-block causal transformer LM written with F.scaled_dot_product_attention.

    ``causal=False`` uses an explicit boolean mask instead (keys that are not padding).
    """

    def __init__(self, causal: bool = True):
        super().__init__()
        self.causal = causal
        self.tok = nn.Embedding(VOCAB, 8)
        self.pos = nn.Embedding(T, 8)
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens):
        B, L = tokens.shape
        h = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device).expand(B, L))
        q, k, v = self.qkv(h).view(B, L, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if self.causal:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = (tokens != PAD)[:, None, None, :]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = self.norm(h + self.proj(a.transpose(1, 2).reshape(B, L, 8)))
        return self.head(h)


# ---------------------------------------------------------------------- data
def vectors(n, g, dtype=torch.float64):
    x = torch.randn(n, 5, 3, generator=g, dtype=dtype)
    lengths = torch.randint(2, 6, (n,), generator=g)
    x[torch.arange(5) >= lengths[:, None]] = 0  # trailing padding rows
    return x


def token_data(n, g):
    """BOS=1, then a random walk over 2..6 with trailing padding (PAD targets ignored)."""
    seqs = torch.randint(2, VOCAB, (n, T + 1), generator=g)
    seqs[:, 0] = 1
    lengths = torch.randint(3, T + 2, (n,), generator=g)
    seqs[torch.arange(T + 1) >= lengths[:, None]] = PAD
    return seqs[:, :-1].clone(), seqs[:, 1:].clone()


def make(cls, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return cls(**kw).to(dtype).eval()


# ---------------------------------------------------------------------- references
def D_of(model):
    return sum(p.numel() for p in model.parameters())


def explicit_regression_ggn(model, x):
    """``(1/N) sum_n J_n^T J_n`` (unit noise)."""
    _, J = output_jacobian(model, x)
    return torch.einsum("ncd,nce->de", J, J) / x.shape[0]


def explicit_token_ggn(model, x, y):
    """``(1/N) sum_t J_t^T (diag p_t - p_t p_t^T) J_t`` over non-padding targets."""
    G, n_tokens = softmax_ggn(*output_jacobian(model, x), y, PAD)
    return G / n_tokens


def glas(model, likelihood, data, k, **kw):
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=k,
        ignore_index=PAD,
        **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(DataLoader(TensorDataset(*data), batch_size=8))
    return la


def top(G, k):
    return torch.linalg.eigvalsh(G).flip(0)[:k]


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("cls", [MHARegressor, EncoderRegressor])
def test_ggn_products_and_eigenpairs_match_explicit_regression(cls):
    g = torch.Generator().manual_seed(0)
    model = make(cls)
    x = vectors(12, g)
    C = model(x).shape[-1]
    y = torch.randn(12, C, generator=g, dtype=torch.float64)
    G = explicit_regression_ggn(model, x)
    # curvlinops' operator of MSELoss(mean) is 2/(N C) sum J^T J: scale C/2 gives G
    op = mean_ggn_operator(
        model, nn.MSELoss(), list(model.parameters()), DataLoader(TensorDataset(x, y), 5), 12
    )
    V = torch.randn(G.shape[0], 3, generator=g, dtype=torch.float64)
    with autodiff_friendly(model):
        GV = (op @ V) * (C / 2)
    torch.testing.assert_close(GV, G @ V, rtol=1e-9, atol=1e-12)
    for solver in ("lanczos", "auto"):
        la = glas(model, "regression", (x, y), 4, solver=solver)
        torch.testing.assert_close(la.eigenvalues, top(G, 4), rtol=1e-7, atol=1e-10)
        U = la.eigenvectors
        torch.testing.assert_close(G @ U, U * la.eigenvalues, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("cls", [SDPALM, DecoderTagger])
def test_token_ggn_eigenpairs_match_explicit(cls):
    g = torch.Generator().manual_seed(1)
    model = make(cls)
    x, y = token_data(10, g)
    G = explicit_token_ggn(model, x, y)
    op, n_tokens = curvlinops_token_ggn(model, x, y, PAD, batch_size=4)
    V = torch.randn(G.shape[0], 3, dtype=torch.float64, generator=g)
    with autodiff_friendly(model):
        GV = (op @ V) / n_tokens
        eig = compute_eigenpairs(
            op, 4, scale=1 / n_tokens, dtype=torch.float64, generator=torch.Generator()
        )
    torch.testing.assert_close(GV, G @ V, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(eig.values, top(G, 4), rtol=1e-8, atol=1e-12)
    for solver in ("lanczos", "auto"):
        la = glas(model, "classification", (x, y), 4, solver=solver)
        assert la.n_data == n_tokens  # N counts the non-padding targets
        torch.testing.assert_close(la.eigenvalues, top(G, 4), rtol=1e-7, atol=1e-10)


def test_factored_operator_serves_the_sdpa_lm():
    """Linear q/k/v + SDPA: the factored GGN qualifies and agrees with the explicit one."""
    g = torch.Generator().manual_seed(2)
    model = make(SDPALM, causal=False)
    x, y = token_data(10, g)
    la = glas(model, "classification", (x, y), 5, solver="factored")
    assert la.lanczos_info.operator == "factored"
    torch.testing.assert_close(
        la.eigenvalues, top(explicit_token_ggn(model, x, y), 5), rtol=1e-7, atol=1e-10
    )


def test_causal_lm_per_token_predictives_respect_the_mask():
    """Per-token outputs of a causal SDPA model: both predictives give (batch, T, vocab)
    probabilities, and the posterior predictive at position t ignores later tokens."""
    g = torch.Generator().manual_seed(3)
    model = make(SDPALM, dtype=torch.float32)
    x, y = token_data(40, g)
    la = glas(model, "classification", (x, y), 6)
    x2 = x[:4].clone()
    x2[:, 3:] = (x2[:, 3:] + 1) % VOCAB  # change the future from position 3 on
    for pred in ({"pred_type": "glm", "link_approx": "probit"}, {"pred_type": "nn"}):
        kw = {"link_approx": "mc", "n_samples": 20, **pred}
        p = la(x[:4], generator=torch.Generator().manual_seed(0), **kw)
        p2 = la(x2, generator=torch.Generator().manual_seed(0), **kw)
        assert p.shape == (4, T, VOCAB)
        torch.testing.assert_close(p.sum(-1), torch.ones(4, T), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p[:, :3], p2[:, :3], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(p[:, 3:], p2[:, 3:])


def test_calibration_activity_and_diagnostics_on_a_causal_transformer():
    g = torch.Generator().manual_seed(4)
    model = make(SDPALM, dtype=torch.float32)
    x, y = token_data(40, g)
    la = glas(model, "classification", (x, y), 4)
    xc, yc = token_data(20, g)
    with warnings.catch_warnings():  # 90% need not be reached on random tokens
        warnings.simplefilter("ignore", laplace_glas.CoverageNotReachedWarning)
        sel = select_dimension(
            la,
            DataLoader(TensorDataset(xc, yc), batch_size=10),
            0.9,
            ks=[1, 4],
            prior_precisions=[1.0, 1e3],
            empirical_bayes=False,
            n_samples=20,
            generator=torch.Generator().manual_seed(0),
        )
    assert len(sel.rows) == 4 and all(0 < r.coverage <= 1 for r in sel.rows)
    scores = activity_scores(la)
    assert scores.shape == (la.n_params,) and (scores >= 0).all() and scores.sum() > 0
    report = residual_report(la)
    assert report.residuals.shape == (4,) and (report.residuals < 1e-3).all()


def _kernel_state():
    return (
        torch.backends.mha.get_fastpath_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.mkldnn.enabled,
    )


@pytest.mark.parametrize("fastpath", [True, False])
def test_kernel_switches_hold_inside_and_the_callers_settings_come_back(fastpath):
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        before = _kernel_state()
        with differentiable_kernels(nn.LSTM(2, 2)):
            assert _kernel_state() == (False, False, False, True, False)
        assert _kernel_state() == before
        with pytest.raises(RuntimeError, match="boom"), attention_math_kernels():
            raise RuntimeError("boom")
        assert _kernel_state() == before
        la = glas(
            make(MHARegressor),
            "regression",
            (vectors(8, torch.Generator()), torch.zeros(8, 2, dtype=torch.float64)),
            2,
        )
        la(vectors(3, torch.Generator()), pred_type="glm")
        assert _kernel_state() == before
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_the_fast_path_really_lacks_forward_mode():
    """Guard for the switch: without it, jvp through an eval-mode encoder fails."""
    model = make(EncoderRegressor)
    x = vectors(4, torch.Generator().manual_seed(0))
    params = {n: p.detach() for n, p in model.named_parameters()}
    tangents = {n: torch.ones_like(p) for n, p in params.items()}

    def f(p):
        return functional_call(model, p, (x,))

    with torch.no_grad(), pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(f, (params,), (tangents,))
    with autodiff_friendly(model):
        torch.func.jvp(f, (params,), (tangents,))


class ScoredTokens(nn.Module):
    """One output row per scored token (``batch['keep']``), not per sequence."""

    def __init__(self):
        super().__init__()
        self.lm = SDPALM()

    def forward(self, batch):
        return self.lm(batch["input_ids"])[batch["keep"]]


def test_outputs_per_scored_token_fall_back_from_the_factored_operator():
    g = torch.Generator().manual_seed(5)
    model = make(ScoredTokens)
    x, y = token_data(10, g)
    keep = y != PAD
    batches = [
        {
            "input_ids": x[i : i + 5],
            "keep": keep[i : i + 5],
            "labels": y[i : i + 5][keep[i : i + 5]],
        }
        for i in (0, 5)
    ]
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas", n_components=4
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(batches)
    assert la.lanczos_info.operator.startswith("linearised (not factored: model outputs")
    assert la.n_data == int(keep.sum())
    ref = explicit_token_ggn(model.lm, x, y)
    torch.testing.assert_close(la.eigenvalues, top(ref, 4), rtol=1e-7, atol=1e-10)
