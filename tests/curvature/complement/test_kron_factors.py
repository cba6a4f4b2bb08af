"""KFAC's factors from the factored operator's stored factors (no data pass), against
curvlinops' KFAC pass (``ggn_kron``) and laplace-torch's ``KronLaplace``; and the
fallback to curvlinops' pass where the operator cannot give them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fit_glas, loader, mlp, regression_data, train
from torch import nn

from laplace_glas.curvature.complement import kron as kron_module
from laplace_glas.curvature.complement import passes as complement_pass
from laplace_glas.curvature.complement.kron import factored_kron, factored_kron_refusal, ggn_kron
from laplace_glas.curvature.complement.passes import FROM_FACTORS
from laplace_glas.curvature.operators.factored import build_factored_ggn

DOUBLE = torch.float64


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-10, "atol": 1e-12} if dtype == DOUBLE else {"rtol": 2e-5, "atol": 1e-6}


def assert_same_factors(got, want, dtype: torch.dtype) -> None:
    assert len(got.kfacs) == len(want.kfacs)
    for mine, theirs in zip(got.kfacs, want.kfacs):
        assert len(mine) == len(theirs)
        for F, G in zip(mine, theirs):
            assert F.dtype == G.dtype == dtype
            scale = float(G.abs().max())
            torch.testing.assert_close(F / scale, G / scale, **tolerance(dtype))


def data(likelihood: str, C: int, dtype: torch.dtype, shape=(4,), n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *shape, generator=g, dtype=dtype)
    if likelihood == "regression":
        return X, torch.randn(n, C, generator=g, dtype=dtype)
    return X, torch.randint(0, C, (n,), generator=g)


def direct(model, X, y, likelihood, batch_size=16):
    """``(factored_kron, ggn_kron)`` of ``model`` on ``(X, y)`` in equal batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    batches = loader(X, y, batch_size)
    op = build_factored_ggn(model, params, batches, likelihood, X.shape[0])
    assert not isinstance(op, str), op
    return factored_kron(op, model, params, X.shape[0]), ggn_kron(model, batches, likelihood)


@pytest.mark.parametrize("dtype", [torch.float32, DOUBLE])
@pytest.mark.parametrize("likelihood, C", [("regression", 2), ("classification", 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_factors_equal_curvlinops_kfac_on_an_mlp(dtype, likelihood, C, bias):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6, bias=bias),
        nn.Tanh(),
        nn.Linear(6, 5),
        nn.Tanh(),
        nn.Linear(5, C, bias=bias),
    ).to(dtype)
    X, y = data(likelihood, C, dtype)
    ours, reference = direct(model, X, y, likelihood)
    assert [len(block) for block in ours.kfacs] == [len(block) for block in reference.kfacs]
    assert_same_factors(ours, reference, dtype)


def test_float32_factors_over_many_rows_keep_curvlinops_accuracy():
    """Sums over ``N = 32,000`` rows in float32, against float64: as accurate as
    curvlinops' per-batch sums (one GEMM over all rows is off by ~1e-4 in one column).
    """
    model = mlp([3, 4, 1])
    X, y = data("regression", 1, torch.float32, shape=(3,), n=32_000)
    ours, _ = direct(model, X, y, "regression", batch_size=4000)
    exact = ggn_kron(mlp([3, 4, 1], dtype=DOUBLE), loader(X.double(), y.double()), "regression")
    for mine, theirs in zip(ours.kfacs, exact.kfacs):
        for F, G in zip(mine, theirs):
            error = (F.double() - G).abs().max() / G.abs().max()
            assert error < 1e-6, float(error)  # curvlinops: 3.8e-7; one GEMM: 5.7e-6


def test_the_expand_convention_for_positions_and_repeated_calls():
    """A layer over ``T = 5`` positions divides ``A`` by ``N T`` (curvlinops' 'expand');
    a layer called twice adds both calls' outer products over ``N``.
    """

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.shared = nn.Linear(3, 4), nn.Linear(4, 4)
            self.head = nn.Linear(20, 2)

        def forward(self, x):  # x: (B, 5, 3)
            h = torch.tanh(self.inner(x))
            h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
            return self.head(h.flatten(1))

    torch.manual_seed(0)
    model = Model().to(DOUBLE)
    for likelihood in ("regression", "classification"):
        X, y = data(likelihood, 2, DOUBLE, shape=(5, 3))
        ours, reference = direct(model, X, y, likelihood)
        assert_same_factors(ours, reference, DOUBLE)


def test_a_conv2d_with_numeric_padding_gives_curvlinops_factors():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3)
    ).to(DOUBLE)
    X, y = data("classification", 3, DOUBLE, shape=(1, 4, 4))
    ours, reference = direct(model, X, y, "classification")
    assert_same_factors(ours, reference, DOUBLE)
    same = nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), nn.Flatten(), nn.Linear(32, 3))
    reason = factored_kron_refusal(
        same, list(same.parameters()), loader(X, y), "classification", (3,)
    )
    assert reason is not None and "padding='same'" in reason


def test_what_the_model_or_the_first_batch_rules_out_is_named():
    model = mlp([2, 3, 1])
    X, y = regression_data(8, d_in=2)
    params = list(model.parameters())
    assert factored_kron_refusal(model, params, loader(X, y), "regression", (1,)) is None
    assert "targets of shape (8,)" in factored_kron_refusal(
        model, params, loader(X, y[:, 0]), "regression", (1,)
    )
    assert "one class label" in factored_kron_refusal(
        model, params, loader(X, y.long()), "classification", (1,)
    )
    assert "inputs of type dict" in factored_kron_refusal(
        model, params, [({"x": X}, y)], "regression", (1,)
    )
    model[0].weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    reason = factored_kron_refusal(model, params, loader(X, y), "regression", (1,))
    assert "frozen weight" in reason
    assert "not the model's trainable" in factored_kron_refusal(
        model, params[1:], loader(X, y), "regression", (1,)
    )
    with_norm = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3), nn.Linear(3, 1))
    reason = factored_kron_refusal(
        with_norm, list(with_norm.parameters()), loader(X, y), "regression", (1,)
    )
    assert "LayerNorm" in reason


def test_positions_that_differ_between_batches_are_refused_by_the_operator():
    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(2, 3), nn.Linear(3, 1)

        def forward(self, x):
            return self.head(torch.tanh(self.inner(x)).mean(1))

    torch.manual_seed(0)
    model = Pool().to(DOUBLE)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, T, 2, generator=g, dtype=DOUBLE), torch.randn(8, 1, dtype=DOUBLE))
        for T in (3, 5)
    ]
    params = list(model.parameters())
    op = build_factored_ggn(model, params, batches, "regression", 16)
    reason = factored_kron(op, model, params, 16)
    assert isinstance(reason, str) and "different numbers of positions" in reason


# ---------------------------------------------------------------------- through fit
@pytest.fixture(scope="module")
def problems():
    """Trained MLPs: regression (C = 2) and classification (C = 3), in float64."""
    X, y = regression_data(48, d_in=2, d_out=2, dtype=DOUBLE)
    reg = train(mlp([2, 8, 2], dtype=DOUBLE), X, y, steps=150)
    g = torch.Generator().manual_seed(1)
    Xc = torch.randn(48, 2, generator=g, dtype=DOUBLE)
    yc = (Xc[:, 0] > 0).long() + (Xc[:, 1] > 0).long()
    cls = train(mlp([2, 8, 3], dtype=DOUBLE), Xc, yc, steps=150, classification=True)
    return {"regression": (reg, X, y), "classification": (cls, Xc, yc)}


def without_factors(monkeypatch):
    monkeypatch.setattr(complement_pass, "factored_kron", lambda *args: "not in this test")


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("scaling", ["sum", "mean"])
def test_a_fit_from_the_operator_equals_the_fit_with_curvlinops_pass(
    problems, likelihood, scaling, monkeypatch
):
    model, X, y = problems[likelihood]
    options = dict(n_components=3, prior_precision=0.7, loss_scaling=scaling, batch_size=16)
    ours = fit_glas(model, X, y, likelihood, **options)
    assert ours.complement == "kron"  # the default 'auto'
    assert ours.lanczos_info.plan["kron_factors"] == FROM_FACTORS
    with monkeypatch.context() as patch:
        without_factors(patch)
        reference = fit_glas(model, X, y, likelihood, **options)
    source = reference.lanczos_info.plan["kron_factors"]
    assert source == "curvlinops (not in this test)"
    assert_same_factors(ours._ggn_kron, reference._ggn_kron, DOUBLE)
    torch.testing.assert_close(ours.log_marginal_likelihood(), reference.log_marginal_likelihood())
    for got, want in zip(ours(X[:6], pred_type="glm"), reference(X[:6], pred_type="glm")):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        ours.posterior_covariance.diagonal(), reference.posterior_covariance.diagonal()
    )


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_the_factors_equal_laplace_torchs_kron_laplace(problems, likelihood):
    from laplace import KronLaplace

    model, X, y = problems[likelihood]
    la = fit_glas(model, X, y, likelihood, n_components=3, batch_size=16, complement="kron")
    assert la.lanczos_info.plan["kron_factors"] == FROM_FACTORS
    reference = KronLaplace(model, likelihood)
    reference.fit(loader(X, y, 16))  # equal batches: laplace-torch's sum of factors
    torch.testing.assert_close(la._ggn_kron.to_matrix(), reference.H_facs.to_matrix())


def test_padded_targets_fall_back_to_curvlinops_pass(problems):
    model, X, y = problems["classification"]
    padded = y.clone()
    padded[:10] = -100
    la = fit_glas(model, X, padded, "classification", n_components=3, batch_size=16)
    assert la.complement == "kron"
    source = la.lanczos_info.plan["kron_factors"]
    assert source.startswith("curvlinops (the operator holds 48 examples for 38")
    reference = ggn_kron(model, loader(X, padded, 16), "classification")
    assert_same_factors(la._ggn_kron, reference, DOUBLE)


def test_other_operators_and_subsamples_fall_back_to_curvlinops_pass(problems):
    model, X, y = problems["regression"]
    reference = ggn_kron(model, loader(X, y, 16), "regression")
    streaming = fit_glas(model, X, y, n_components=3, batch_size=16, solver="lanczos")
    assert streaming.lanczos_info.plan["strategy"] == "streaming"
    source = streaming.lanczos_info.plan["kron_factors"]
    assert source.startswith("curvlinops (the eigen-solve's operator is not the factored one")
    assert_same_factors(streaming._ggn_kron, reference, DOUBLE)
    sub = fit_glas(model, X, y, n_components=3, batch_size=16, subsample_size=20)
    assert sub.lanczos_info.plan["kron_factors"] == "curvlinops"  # the pass before the solve
    assert_same_factors(sub._ggn_kron, reference, DOUBLE)


def test_a_frozen_weight_runs_curvlinops_pass_before_the_solve(problems):
    model, X, y = problems["regression"]
    model = type(model)(*model)  # shares the layers: restore requires_grad below
    model[0].weight.requires_grad_(False)
    try:
        la = fit_glas(model, X, y, n_components=3, batch_size=16)
        assert la.complement == "kron" and la.lanczos_info.plan["kron_factors"] == "curvlinops"
        assert_same_factors(la._ggn_kron, ggn_kron(model, loader(X, y, 16), "regression"), DOUBLE)
        explicit = fit_glas(model, X, y, n_components=3, batch_size=16, complement="kron")
        assert explicit.lanczos_info.plan["kron_factors"] == "curvlinops"
        assert_same_factors(explicit._ggn_kron, la._ggn_kron, DOUBLE)
    finally:
        model[0].weight.requires_grad_(True)


def test_a_failing_pass_after_the_solve_moves_auto_on_and_explicit_kron_raises(
    problems, monkeypatch
):
    from laplace import Laplace

    model, X, y = problems["regression"]
    without_factors(monkeypatch)

    def refuse(*args, **kwargs):
        raise ValueError("KFAC refused in this test")

    monkeypatch.setattr(complement_pass, "ggn_kron", refuse)
    auto = fit_glas(model, X, y, n_components=3, batch_size=16)
    assert auto.complement == "diag"
    assert "not 'kron': KFAC refused in this test" in auto.complement_reason
    assert "kron_factors" not in auto.lanczos_info.plan
    diag = fit_glas(model, X, y, n_components=3, batch_size=16, complement="diag")
    torch.testing.assert_close(auto._ggn_diagonal, diag._ggn_diagonal, rtol=0, atol=0)
    la = Laplace(
        model, "regression", subset_of_weights="all", hessian_structure="glas", n_components=3,
        complement="kron",
        sigma_noise=0.1,
    )  # fmt: skip
    with pytest.raises(ValueError, match="KFAC refused in this test"):
        la.fit(loader(X, y, 16))
    assert getattr(la, "_eigenpairs", None) is None
    assert getattr(la, "_ggn_kron", None) is None


@pytest.mark.parametrize("columns", [8, 80])
def test_the_factor_gram_sums_many_float32_rows_as_accurately_as_float64(columns):
    """KFAC's factor X^T X over 300k rows (a convolution's N R T): a float32 X is summed
    in blocks (float64 ones where it is narrow) to within 1e-6 of the float64 sum; a
    float64 X in one GEMM, equal to it."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300_000, columns, generator=g, dtype=torch.float64) + 0.5
    exact = X.T @ X
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        got = kron_module._gram(X.to(dtype))
        assert got.dtype == dtype
        err = (got.double() - exact).abs().max() / exact.abs().max()
        assert err < rtol, (dtype, float(err))
    naive = (X.float().T @ X.float()).double()  # one float32 GEMM, for scale
    assert (naive - exact).abs().max() / exact.abs().max() > 1e-7
