"""The factored GGN operator, the dual (Gram) solve and the automatic solver choice
against curvlinops' GGN products and the Lanczos reference.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas import ActiveSubspaceLaplace
from laplace_glas.curvature.data.batches import XYBatches
from laplace_glas.curvature.data.map_loss import curvature_loss
from laplace_glas.curvature.memory.planner import choose_solver
from laplace_glas.curvature.operators import factor_join
from laplace_glas.curvature.operators import factors as factors_module
from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator
from laplace_glas.curvature.operators.factored import FactoredGGN, build_factored_ggn
from laplace_glas.curvature.solvers import gram
from laplace_glas.curvature.solvers.eigenpairs import Eigenpairs
from laplace_glas.curvature.solvers.solve import compute_eigenpairs

F64 = torch.float64

# the factored operator itself: the planner's explicit-Jacobian candidate, which would
# serve several of these small models, is tested in test_jacobian.py
pytestmark = pytest.mark.usefixtures("without_jacobian")


class SequenceRegressor(nn.Module):
    """Linear + LayerNorm over (batch, T, F) inputs, pooled to (batch, C) outputs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x)))).mean(1)


class BagOfTokens(nn.Module):
    """Embedding + Linear, summed over the sequence: (batch, C)."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(9, 5, padding_idx=padding_idx)
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x))).sum(1)


class TokenTagger(nn.Module):
    """Per-token classifier: (batch, T) tokens -> (batch, T, V) logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.emb(x))))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class MixesExamples(nn.Module):
    """Only supported layers, but the output of example n depends on example n+1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).roll(1, dims=0))


def problem(name: str, seed: int = 0):
    """``(model, X, y, likelihood, ignore_index)`` in float64."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "mlp-regression":
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, torch.randn(30, 3, generator=g), torch.randn(30, 2, generator=g), "regression"
    if name == "mlp-scalar":  # R = 1: narrow-to-wide layers take the input side
        model = nn.Sequential(
            nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 12, bias=False), nn.Tanh(), nn.Linear(12, 1)
        )
        return model, torch.randn(30, 3, generator=g), torch.randn(30, 1, generator=g), "regression"
    if name == "mlp-classification":
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
        y = torch.randint(0, 4, (30,), generator=g)
        return model, torch.randn(30, 3, generator=g), y, "classification"
    if name == "mlp-binary":  # C = 2: one row of Lambda^{1/2} per example
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        y = torch.randint(0, 2, (30,), generator=g)
        return model, torch.randn(30, 3, generator=g), y, "classification"
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.Tanh(),
            nn.BatchNorm2d(3),
            nn.Conv2d(3, 2, 2, stride=2),
            nn.Flatten(),
            nn.Linear(18, 3),
        )
        model[2].running_mean.uniform_(-0.5, 0.5)
        model[2].running_var.uniform_(0.5, 2.0)
        y = torch.randint(0, 3, (12,), generator=g)
        return model, torch.randn(12, 2, 6, 6, generator=g), y, "classification"
    if name == "conv1d":
        model = nn.Sequential(
            nn.Conv1d(2, 3, 3, padding="same"), nn.Tanh(), nn.Flatten(), nn.Linear(21, 2)
        )
        return (
            model,
            torch.randn(12, 2, 7, generator=g),
            torch.randn(12, 2, generator=g),
            "regression",
        )
    if name == "sequence-linear":
        X = torch.randn(14, 5, 4, generator=g)
        return SequenceRegressor(), X, torch.randn(14, 3, generator=g), "regression"
    if name == "embedding":
        X = torch.randint(0, 9, (14, 6), generator=g)
        return BagOfTokens(), X, torch.randint(0, 4, (14,), generator=g), "classification"
    if name == "token-classification":
        X = torch.randint(0, 7, (10, 6), generator=g)
        y = torch.randint(0, 4, (10, 6), generator=g)
        y[torch.rand(10, 6, generator=g) < 0.3] = -100  # padding targets
        return TokenTagger(), X, y, "classification"
    if name == "embedding-padding":
        X = torch.randint(0, 9, (14, 6), generator=g)
        return BagOfTokens(0), X, torch.randint(0, 4, (14,), generator=g), "classification"
    raise KeyError(name)


MODELS = [
    "mlp-regression",
    "mlp-scalar",
    "mlp-classification",
    "mlp-binary",
    "cnn",
    "conv1d",
    "sequence-linear",
    "embedding",
    "token-classification",
]


def as64(model, X, y):
    model = model.to(F64).eval()
    X = X.to(F64) if X.is_floating_point() else X
    y = y.to(F64) if y.is_floating_point() else y
    return model, X, y


def n_terms(y, likelihood, ignore_index=-100):
    return len(y) if likelihood == "regression" else int((y != ignore_index).sum())


def curvlinops_products(model, X, y, likelihood, V, batch_size=8):
    """``G_1 V`` from curvlinops, scaled as ``fit`` scales it."""
    N = n_terms(y, likelihood)
    out_shape = model(X[:1]).shape[1:]
    loss, scale, num_data = curvature_loss(likelihood, N, out_shape)
    op = mean_ggn_operator(
        model, loss, list(model.parameters()), XYBatches(loader(X, y, batch_size)), num_data
    )
    return scale * (op @ V)


def test_a_convolution_with_many_positions_multiplies_by_its_explicit_rows(monkeypatch):
    """The CNN's first convolution (36 positions, 57 weights a row) keeps its explicit
    Jacobian rows (13% of its factors) and multiplies by them; its products equal those
    of the factors alone and of the explicit Jacobian, formed independently by jacrev."""
    model, X, y, likelihood = problem("cnn")
    model, X, y = as64(model, X, y)
    N = n_terms(y, likelihood)
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 7), likelihood, N)
    first, second = op.factors[0], op.factors[1]
    assert isinstance(first, factors_module.OuterFactor) and first.explicit_rows() is not None
    assert second.explicit_rows() is None  # 9 positions: its rows would be 36% of it
    (head,) = [f for f in op.factors if isinstance(f, factors_module.OuterFactor)][2:]
    assert head.a.shape[1] == 1 and head.explicit_rows() is None  # the linear head
    D = op.shape[0]
    V = torch.randn(3, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    Y = first.apply(V)
    out = torch.zeros(3, D, dtype=F64)
    first.apply_transpose(Y, out)
    monkeypatch.setattr(factors_module, "EXPLICIT_ROWS_SHARE", 0.0)
    plain = copy.copy(first)
    plain._rows = None
    assert plain.explicit_rows() is None
    torch.testing.assert_close(Y, plain.apply(V), rtol=1e-12, atol=1e-14)
    out_plain = torch.zeros(3, D, dtype=F64)
    plain.apply_transpose(Y, out_plain)
    torch.testing.assert_close(out, out_plain, rtol=1e-12, atol=1e-14)
    # the rows against jacrev: Lambda^{1/2} J of the first conv's weight and bias
    w, b = model[0].weight, model[0].bias
    names = {w: "0.weight", b: "0.bias"}
    params = dict(model.named_parameters())

    def outputs(weight, bias):
        return torch.func.functional_call(model, {**params, names[w]: weight, names[b]: bias}, (X,))

    Jw, Jb = torch.func.jacrev(outputs, argnums=(0, 1))(w.detach(), b.detach())
    J = torch.cat([Jw.reshape(*Jw.shape[:2], -1), Jb], -1)  # (N, C, d_out d_in + d_out)
    rows = factors_module.row_vectors(model(X).detach(), y, likelihood, -100, N**-0.5)
    expected = torch.einsum("rnc,ncd->nrd", rows, J).reshape(-1, J.shape[-1])
    torch.testing.assert_close(first.explicit_rows(), expected, rtol=1e-10, atol=1e-12)


def test_the_explicit_rows_count_in_the_factors_bytes():
    """The memory estimate adds a layer's explicit rows where the products will use
    them (N R (d_out d_in + d_out) numbers)."""
    model, X, y, likelihood = problem("cnn")
    model, X, y = as64(model, X, y)
    op = build_factored_ggn(
        model, list(model.parameters()), loader(X, y, 12), likelihood, n_terms(y, likelihood)
    )
    first = op.factors[0]
    assert first._rows is None  # formed on the first product, counted before it
    before = factors_module.stored_bytes(first)
    calls = [("outer", first.offset, first.a, first.g, first.bias_offset)]
    factor_numbers = first.a.numel() + first.g.numel()
    rows = first.explicit_rows().numel()
    assert factor_join.layer_factor_bytes(calls) == 8 * (factor_numbers + rows) == before
    assert factors_module.stored_bytes(first) == before == 8 * factor_numbers + first.rows_bytes()
    (head,) = [f for f in op.factors if isinstance(f, factors_module.OuterFactor)][2:]
    calls = [("outer", head.offset, head.a, head.g, head.bias_offset)]
    assert factor_join.layer_factor_bytes(calls) == 8 * (head.a.numel() + head.g.numel())


@pytest.mark.parametrize("name", MODELS)
def test_factored_products_equal_curvlinops(name):
    model, X, y, likelihood = problem(name)
    model, X, y = as64(model, X, y)
    op = build_factored_ggn(
        model, list(model.parameters()), loader(X, y, 7), likelihood, n_terms(y, likelihood)
    )
    assert isinstance(op, FactoredGGN), op
    V = torch.randn(op.shape[0], 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    reference = curvlinops_products(model, X, y, likelihood, V)
    ours = op.matmat_torch(V)
    err = torch.linalg.norm(ours - reference) / torch.linalg.norm(reference)
    assert err < 1e-6, f"relative error {err:.1e}"
    # the SciPy interface gives the same products
    assert torch.allclose(torch.from_numpy(op.matvec(V[:, 0].numpy())), ours[:, 0])


def test_embedding_padding_row_left_out():
    """``padding_idx`` gets no gradient in backward mode; curvlinops' forward-mode J
    still sees that row (its operator is not symmetric there). The factored operator
    leaves the row out on both sides: it equals curvlinops on tangents without it.
    """
    model, X, y, likelihood = problem("embedding-padding")
    model, X, y = as64(model, X, y)
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 7), likelihood, 14)
    assert isinstance(op, FactoredGGN), op
    V = torch.randn(op.shape[0], 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    V[:5] = 0  # row 0 of the 9 x 5 table
    reference = curvlinops_products(model, X, y, likelihood, V)
    ours = op.matmat_torch(V)
    assert torch.linalg.norm(ours - reference) < 1e-10 * torch.linalg.norm(reference)
    assert ours[:5].abs().max() == 0


def test_factored_products_float32_and_batch_independent():
    model, X, y, likelihood = problem("mlp-classification")
    model.eval()
    ops = [
        build_factored_ggn(model, list(model.parameters()), loader(X, y, b), likelihood, len(y))
        for b in (5, 30)
    ]
    V = torch.randn(ops[0].shape[0], 3, generator=torch.Generator().manual_seed(2))
    a, b = (op.matmat_torch(V) for op in ops)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def fitted(model, X, y, likelihood, solver, k=5, dtype=F64, batch_size=8, **kwargs):
    la = ActiveSubspaceLaplace(model, likelihood, n_components=k, solver=solver, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size))
    return la


def assert_same_eigenpairs(ours: Eigenpairs, ref: Eigenpairs, val_tol=1e-8, vec_tol=1e-6):
    assert ours.values.shape == ref.values.shape
    assert torch.all(ours.values[:-1] >= ours.values[1:])
    top = ref.values[0]
    assert ((ours.values - ref.values).abs() / top).max() < val_tol
    eye = torch.eye(ours.k, dtype=ours.vectors.dtype)
    assert (ours.vectors.T @ ours.vectors - eye).abs().max() < 1e-8
    # eigenvectors agree up to sign where the eigenvalues are separated
    overlap = (ours.vectors * ref.vectors).sum(0).abs()
    gaps = torch.cat([ref.values[:-1] - ref.values[1:], ref.values[-1:]])
    separated = torch.cat([gaps[:1], torch.minimum(gaps[1:], gaps[:-1])]) > 1e-3 * top
    assert ((1 - overlap)[separated]).max() < vec_tol


@pytest.mark.parametrize(
    "name", ["mlp-regression", "mlp-binary", "cnn", "sequence-linear", "embedding"]
)
@pytest.mark.parametrize("solver", ["dual", "factored", "auto"])
def test_solvers_match_lanczos_reference(name, solver):
    model, X, y, likelihood = problem(name)
    model, X, y = as64(model, X, y)
    ref = fitted(model, X, y, likelihood, "lanczos").lanczos_info
    ours = fitted(model, X, y, likelihood, solver).lanczos_info
    assert ref.operator == "curvlinops" and ref.solver == "lanczos"
    assert ours.operator == "factored"
    assert ours.solver == {"dual": "dual", "factored": "lanczos"}.get(solver, ours.solver)
    assert_same_eigenpairs(ours, ref)
    assert ours.n_data == ref.n_data and ours.n_requested == 5
    assert torch.all(ours.residuals < 1e-6)


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_dual_block_krylov_for_many_pairs_matches_lanczos(precision):
    """k above ARPACK's share of the dual solve: block Krylov on K (a float64 basis for
    float32 and float64 K), against Lanczos on curvlinops' float64 GGN."""
    model, X, y, likelihood = problem("mlp-regression")  # D = 50, M = N R = 60
    model64, X64, y64 = as64(model, X, y)
    ref = fitted(model64, X64, y64, likelihood, "lanczos", k=20).lanczos_info
    if precision == "float32":
        model, X, y = copy.deepcopy(model64).float(), X64.float(), y64.float()
    else:
        model, X, y = model64, X64, y64
    ours = fitted(model, X, y, likelihood, "dual", k=20).lanczos_info
    assert ours.solver == "dual" and ours.vectors.dtype == getattr(torch, precision)
    if precision == "float64":
        assert_same_eigenpairs(ours, ref)
        assert torch.all(ours.residuals < 1e-6)
    else:
        top = ref.values[0]
        assert ((ours.values.double() - ref.values).abs() / top).max() < 1e-5
        eye = torch.eye(20)
        assert (ours.vectors.T @ ours.vectors - eye).abs().max() < 1e-4
        # the pairs are accurate to float32 resolution against the float64 GGN; the
        # reported residuals (w.r.t. the float32 operator) overstate the small pairs'
        # (the K-residual carries the float32 products' round-off, about
        # eps lambda_1 sqrt(lambda_1 / lambda)) but stay below 1e-3 lambda_1
        U = ours.vectors.double()
        GU = curvlinops_products(model64, X64, y64, likelihood, U)
        true = torch.linalg.vector_norm(GU - U * ours.values.double(), dim=0)
        assert torch.all(true < 1e-5 * top)
        assert torch.all(ours.residuals < 1e-3 * top)


def test_token_classification_matches_lanczos():
    model, X, y, likelihood = problem("token-classification")
    model, X, y = as64(model, X, y)
    ref = fitted(model, X, y, likelihood, "lanczos").lanczos_info
    for solver in ("dual", "factored"):
        ours = fitted(model, X, y, likelihood, solver).lanczos_info
        assert ours.operator == "factored" and ours.n_data == int((y != -100).sum())
        assert_same_eigenpairs(ours, ref)


def test_default_is_auto_and_picks_dual_for_few_rows():
    _, X, y, likelihood = problem("mlp-regression")
    model = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 2)).eval()
    la = ActiveSubspaceLaplace(model, likelihood, n_components=4)
    assert la.solver == "auto"
    la.fit(loader(X, y, 8))
    info = la.lanczos_info
    assert (info.solver, info.operator) == ("dual", "factored")
    assert info.vectors.dtype == torch.float32 and info.vectors.shape == (la.n_params, 4)
    restored = Eigenpairs.from_dict(info.to_dict())
    assert restored.operator == "factored"


def test_auto_uses_factored_lanczos_when_k_reaches_the_rows():
    model, X, y, likelihood = problem("mlp-regression")
    model, X, y = as64(model, X, y)
    X, y = X[:4], y[:4]  # M = N R = 8 rows
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 4), likelihood, 4)
    assert choose_solver(op, 8) == "lanczos" and choose_solver(op, 3) == "dual"
    with pytest.raises(ValueError, match="at most 7"):
        compute_eigenpairs(op, 8, dtype=F64, solver="dual")


def test_dual_rank_deficient_vectors_stay_orthonormal():
    """k beyond the numerical rank: zero eigenvalues, orthonormal vectors anyway."""
    model, X, y, likelihood = problem("mlp-regression")
    model, X, y = as64(model, X, y)
    X, y = X[:3].clone(), y[:3]
    X[1] = X[0]  # a repeated point: rank 4 < 6 Jacobian rows
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 3), likelihood, 3)
    eig = compute_eigenpairs(op, 5, dtype=F64, solver="dual")
    assert torch.allclose(eig.vectors.T @ eig.vectors, torch.eye(5, dtype=F64), atol=1e-10)
    assert eig.below_threshold.any() and torch.all(eig.values[eig.below_threshold] == 0)


@pytest.mark.parametrize(
    "model_name, reason",
    [("lstm", "LSTM parameters"), ("mix", "differs from forward mode"), ("loss_fn", "loss_fn")],
)
def test_fallback_from_factored_is_recorded_and_matches(model_name, reason):
    g = torch.Generator().manual_seed(0)
    loss_fn = None
    if model_name == "lstm":
        torch.manual_seed(0)
        model, X = Recurrent(), torch.randn(12, 4, 3, generator=g)
        y, likelihood = torch.randn(12, 2, generator=g), "regression"
    elif model_name == "mix":
        torch.manual_seed(0)
        model, X = MixesExamples(), torch.randn(12, 3, generator=g)
        y, likelihood = torch.randn(12, 1, generator=g), "regression"
    else:
        model, X, y, likelihood = problem("mlp-classification")
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
    model, X, y = as64(model, X, y)
    ref = fitted(model, X, y, likelihood, "lanczos", k=3, loss_fn=loss_fn).lanczos_info
    auto = fitted(model, X, y, likelihood, "auto", k=3, loss_fn=loss_fn).lanczos_info
    # the linearised operator (kept graphs) takes over; the matrix is curvlinops' GGN
    assert auto.operator.startswith("linearised (not factored") and reason in auto.operator
    # Lanczos as the one-column block solver (a pass per product, images kept; the
    # repeated-eigenvalue check's passes take two columns)
    assert auto.solver == "block" and auto.n_passes <= auto.n_products
    assert auto.n_products <= auto.n_passes + auto.n_passes // 4
    assert_same_eigenpairs(auto, ref, val_tol=1e-10)
    la = ActiveSubspaceLaplace(model, likelihood, n_components=3, solver="dual", loss_fn=loss_fn)
    with pytest.warns(UserWarning, match="needs the factored GGN"):
        la.fit(loader(X, y, 8))


def test_memory_budget_falls_back():
    model, X, y, likelihood = problem("mlp-regression")
    out = build_factored_ggn(
        model.eval(), list(model.parameters()), loader(X, y, 8), likelihood, 30, budget_bytes=100
    )
    assert isinstance(out, str) and "memory budget" in out


def test_dict_batches_and_frozen_parameters():
    model, X, y, likelihood = problem("mlp-regression")
    model, X, y = as64(model, X, y)
    model[0].bias.requires_grad_(False)

    class DictModel(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            return self.inner(batch["input_ids"])

    wrapped = DictModel(model)
    data = [{"input_ids": X[i : i + 8], "labels": y[i : i + 8]} for i in range(0, 30, 8)]
    kwargs = dict(n_components=4)
    ref = ActiveSubspaceLaplace(wrapped, likelihood, solver="lanczos", **kwargs)
    ref.fit(data)
    ours = ActiveSubspaceLaplace(wrapped, likelihood, solver="auto", **kwargs)
    ours.fit(data)
    assert ours.lanczos_info.operator == "factored"
    assert ours.n_params == ref.n_params == sum(p.numel() for p in model.parameters()) - 8
    assert_same_eigenpairs(ours.lanczos_info, ref.lanczos_info)


def test_unknown_solver_rejected():
    model, *_ = problem("mlp-regression")
    with pytest.raises(ValueError, match="solver must be one of"):
        ActiveSubspaceLaplace(model, "regression", solver="gram")


def test_subsample_uses_factored_operator():
    model, X, y, likelihood = problem("mlp-regression")
    model, X, y = as64(model, X, y)
    dl = DataLoader(TensorDataset(X, y), batch_size=8)
    kw = dict(n_components=3, subsample_size=20)
    ref = ActiveSubspaceLaplace(model, likelihood, solver="lanczos", **kw)
    ref.fit(dl)
    ours = ActiveSubspaceLaplace(model, likelihood, **kw)
    ours.fit(dl)
    assert ours.lanczos_info.n_data == 20 and ours.lanczos_info.operator == "factored"
    assert_same_eigenpairs(ours.lanczos_info, ref.lanczos_info)


def test_join_frees_each_layers_batches_before_releasing_memory():
    """``concatenate_batches`` joins layer by layer and calls ``release`` (the fit's
    ``malloc_trim``) only once that layer's batch pieces are gone, so that the heap
    pages it hands back are the freed pieces; the joined factors equal the batches'.
    """
    import weakref

    from laplace_glas.curvature.operators.factor_join import concatenate_batches

    gen = torch.Generator().manual_seed(0)
    modules = [nn.Linear(3, 4), nn.Linear(4, 2)]
    batches = {
        m: [
            [
                (
                    "outer",
                    10 * i,
                    torch.randn(5, 1, 3 + i, generator=gen),
                    torch.randn(5, 1, 1, 4 - 2 * i, generator=gen),
                    None,
                )
            ]
            for _ in range(3)
        ]
        for i, m in enumerate(modules)
    }
    expected = {
        m: (torch.cat([b[0][2] for b in bs]), torch.cat([b[0][3] for b in bs]))
        for m, bs in batches.items()
    }
    refs = {m: [weakref.ref(b[0][2]) for b in bs] for m, bs in batches.items()}
    seen = []
    release = lambda: seen.append([all(r() is None for r in refs[m]) for m in modules])  # noqa: E731
    factors = concatenate_batches(batches, [], release)
    assert seen == [[True, False], [True, True]]
    for f, m in zip(factors, modules):
        torch.testing.assert_close(f.a, expected[m][0])
        torch.testing.assert_close(f.g, expected[m][1])


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize(
    "outputs, bias, inputs", [(1, True, 4), (3, True, 4), (2, False, 4), (3, False, 1)]
)
def test_gram_built_in_chunks_equals_explicit_rows(monkeypatch, outputs, bias, inputs, workers):
    """The CPU Gram build (upper triangle, a column chunk of examples at a time, uneven
    last chunk, one thread or a pool, all layers' terms of a chunk summed together)
    against ``S S^T`` with ``S``'s rows formed by the factors' products. One output
    (R = 1) or one input without a bias makes a layer's term a single Gram matrix.
    """
    import laplace_glas.curvature.solvers.gram as gram

    g = torch.Generator().manual_seed(3)
    N = 23
    X = torch.randn(N, inputs, generator=g, dtype=F64)
    y = torch.randn(N, outputs, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(inputs, 6, bias=bias), nn.Tanh(), nn.Linear(6, outputs, bias=bias)
    ).double()
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 7), "regression", N)
    M = N * op.n_rows
    # chunks of 5 examples: 5 chunks, the last of 3
    monkeypatch.setattr(gram, "GRAM_CHUNK_ELEMENTS", M * op.n_rows * 5 * workers)
    monkeypatch.setattr(gram, "gram_workers", lambda: workers)
    built = gram.gram_matrix(op)
    K = torch.from_numpy(built.K)
    eye = torch.eye(op.shape[0], dtype=F64)
    S = sum(f.apply(eye) for f in op.factors).reshape(op.shape[0], M).T  # (M, D)
    reference = S @ S.T
    assert torch.allclose(torch.triu(K), torch.triu(reference), rtol=1e-12, atol=1e-12)
    W = torch.randn(M, 3, generator=g, dtype=F64)
    product = torch.from_numpy(built.matmat(W.numpy()))  # reads the upper triangle
    assert torch.allclose(product, reference @ W, rtol=1e-12, atol=1e-12)


def test_gram_build_error_in_a_chunk_is_raised_not_waited_on(monkeypatch):
    """Chunks failing (X with fewer rows than K: the two rightmost chunks) raise from
    the pool; chunks that kept their buffers on an error would leave the others
    waiting forever."""
    import threading

    import laplace_glas.curvature.solvers.gram as gram

    monkeypatch.setattr(gram, "gram_workers", lambda: 2)
    monkeypatch.setattr(gram, "GRAM_CHUNK_ELEMENTS", 20 * 2 * 2)  # chunks of 2 examples
    K = gram.SymmetricGram(20, torch.float32, torch.device("cpu"))
    X, A = torch.randn(17, 3), torch.randn(20, 2)
    raised = []

    def build():
        try:
            K.add_products([(X, A)])
        except ValueError as err:
            raised.append(err)

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the Gram build hung after a failed chunk"
    assert raised


@pytest.mark.parametrize("name, rows", [("mlp-classification", 3), ("mlp-binary", 1)])
def test_softmax_factors_store_c_minus_one_rows(name, rows):
    """Softmax cross-entropy stores ``C - 1`` rows of ``Lambda^{1/2}`` per example (a
    Householder basis of the complement of ``sqrt p``); the Gram matrix ``S S^T`` of
    the dual solve then has ``N (C - 1)`` rows, with the GGN's non-zero spectrum."""
    model, X, y, likelihood = problem(name)
    model, X, y = as64(model, X, y)
    op = build_factored_ggn(model, list(model.parameters()), loader(X, y, 7), likelihood, len(y))
    assert op.n_rows == rows
    eye = torch.eye(op.shape[0], dtype=F64)
    G = op.matmat_torch(eye)
    reference = curvlinops_products(model, X, y, likelihood, eye)
    torch.testing.assert_close(G, reference, rtol=1e-9, atol=1e-12)
    K = torch.from_numpy(gram.gram_matrix(op).matmat(torch.eye(len(y) * rows, dtype=F64).numpy()))
    top = torch.linalg.eigvalsh(K).flip(0)[:5]
    torch.testing.assert_close(
        top, torch.linalg.eigvalsh(reference).flip(0)[:5], rtol=1e-9, atol=1e-12
    )
