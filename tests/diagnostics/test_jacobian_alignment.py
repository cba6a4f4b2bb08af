"""Alignment of J(x) with the kept subspace, against explicit torch.func Jacobians (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import fit_glas
from laplace import Laplace
from torch import nn
from torch.func import functional_call, jacrev

from laplace_glas import NotFittedError
from laplace_glas.diagnostics.alignment import Alignment, alignment, ood_scores


def dense_jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(rows, C, D)`` Jacobian by reverse mode (rows = batch times leading positions)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    J = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    n_out = model(x).shape[-1]
    n_rows = model(x).reshape(-1, n_out).shape[0]
    return torch.cat([J[k].reshape(n_rows, n_out, -1) for k in params], dim=-1)


def mlp(widths: list[int], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embedding(tokens))[0])


def fitted(likelihood: str, n_out: int, k: int = 5, n: int = 40, tau: float = 0.7):
    g = torch.Generator().manual_seed(3)
    model = mlp([3, 8, n_out], seed=1)
    X = torch.randn(n, 3, generator=g, dtype=torch.float64)
    if likelihood == "regression":
        y = torch.randn(n, n_out, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, n_out, (n,), generator=g)
    la = fit_glas(
        model, X, y, likelihood, batch_size=16, n_components=k, prior_precision=tau,
        loss_scaling="mean", complement="zero",
    )  # fmt: skip
    return la, model, X


def reference(la, model, x):
    J = dense_jacobian(model, x)
    U, v = la.eigenvectors, la.posterior_variances
    JU = J @ U  # (n, C, k)
    return J, JU, v


@pytest.mark.parametrize(("likelihood", "n_out"), [("regression", 2), ("classification", 3)])
def test_alignment_matches_explicit_jacobians(likelihood, n_out):
    la, model, _ = fitted(likelihood, n_out)
    x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    result = alignment(la, x, chunk_size=3)
    J, JU, v = reference(la, model, x)
    norm2 = J.square().sum(dim=(1, 2))
    proj = JU.square().sum(dim=(1, 2))
    torch.testing.assert_close(result.jacobian_norm2, norm2)
    torch.testing.assert_close(result.projected_norm2, proj)
    torch.testing.assert_close(result.captured, proj / norm2)
    torch.testing.assert_close(result.residual, norm2 - proj)
    torch.testing.assert_close(result.variance_by_direction, (JU.square() * v).sum(dim=1))
    assert result.variance_by_direction.shape == (7, la.n_components)
    per_output = alignment(la, x, per_output=True, chunk_size=None)
    torch.testing.assert_close(per_output.variance_by_direction, JU.square() * v)
    torch.testing.assert_close(per_output.variance, result.variance)
    # the residual is the energy of J off span(U): ||J (I - U U^T)||_F^2
    U = la.eigenvectors
    off = J - J @ U @ U.T
    torch.testing.assert_close(result.residual, off.square().sum(dim=(1, 2)))


@pytest.mark.parametrize(("likelihood", "n_out"), [("regression", 2), ("classification", 3)])
def test_variance_and_combined_score_are_the_glm_variances_of_both_complements(likelihood, n_out):
    la, model, _ = fitted(likelihood, n_out, tau=0.3)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    result = alignment(la, x)
    J, _, v = reference(la, model, x)
    U, c = la.eigenvectors, 1 / 0.3
    # explicit covariances: J U diag(v) U^T J^T and J (U diag(v - c) U^T + c I) J^T
    zero = torch.einsum("ncd,de,nle->ncl", J, U @ torch.diag(v) @ U.T, J)
    sigma_prior = U @ torch.diag(v - c) @ U.T + c * torch.eye(U.shape[0], dtype=U.dtype)
    prior = torch.einsum("ncd,de,nle->ncl", J, sigma_prior, J)
    torch.testing.assert_close(result.variance, zero.diagonal(dim1=1, dim2=2).sum(-1))
    torch.testing.assert_close(result.combined, prior.diagonal(dim1=1, dim2=2).sum(-1))
    # ... and the posterior's own 'glm' predictive with each complement
    _, f_var, _ = la._glm_moments(x)
    torch.testing.assert_close(result.variance, f_var.diagonal(dim1=1, dim2=2).sum(-1))
    la.complement = "prior"
    try:
        _, f_var, _ = la._glm_moments(x)
    finally:
        la.complement = "zero"
    torch.testing.assert_close(result.combined, f_var.diagonal(dim1=1, dim2=2).sum(-1))
    scores = ood_scores(result)
    assert set(scores) == {
        "variance", "variance (zero)", "variance (prior)", "residual", "1 - captured"
    }  # fmt: skip
    torch.testing.assert_close(scores["variance (prior)"], result.combined)


def test_training_inputs_are_fully_captured_when_k_exceeds_the_rank():
    """For regression, the rows of J(x_n) span range(G): with k >= rank, captured = 1."""
    model = mlp([2, 6, 1], seed=0)  # D = 25
    X = torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    la = Laplace(
        model, "regression", subset_of_weights="all", hessian_structure="glas", n_components=4
    )
    la.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=4))
    result = alignment(la, X)
    torch.testing.assert_close(result.captured, torch.ones(4, dtype=torch.float64))
    # a fresh input's Jacobian is not in the 4-dimensional span of the training Jacobians
    fresh = alignment(la, 3 * torch.ones(1, 2, dtype=torch.float64))
    assert float(fresh.captured) < 0.99


def test_sequence_model_rows_are_positions():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyLM().double()
    tokens = torch.randint(0, 5, (6, 4), generator=g)
    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas", n_components=3
    )
    data = torch.utils.data.TensorDataset(tokens, tokens)
    la.fit(torch.utils.data.DataLoader(data, batch_size=3))
    x = torch.randint(0, 5, (2, 4), generator=g)
    result = alignment(la, x, chunk_size=1)
    J = dense_jacobian(model, x)  # (8, 5, D)
    assert result.jacobian_norm2.shape == (8,)
    torch.testing.assert_close(result.jacobian_norm2, J.square().sum(dim=(1, 2)))
    JU = J @ la.eigenvectors
    torch.testing.assert_close(
        result.variance_by_direction, (JU.square() * la.posterior_variances).sum(dim=1)
    )


def test_float32_and_chunking():
    model = mlp([3, 8, 2], seed=1).float()
    X = torch.randn(30, 3, generator=torch.Generator().manual_seed(0))
    la = fit_glas(model, X, torch.randn(30, 2), n_components=4)
    x = torch.randn(5, 3)
    a, b = alignment(la, x, chunk_size=2), alignment(la, x, chunk_size=None)
    assert a.jacobian_norm2.dtype == torch.float32
    torch.testing.assert_close(a.jacobian_norm2, b.jacobian_norm2)
    torch.testing.assert_close(a.variance_by_direction, b.variance_by_direction)
    assert bool((a.captured >= 0).all() and (a.captured <= 1).all())


def test_bad_input_is_refused():
    la, model, _ = fitted("regression", 1, k=2)
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="ActiveSubspaceLaplace"):
        alignment(model, x)
    unfitted = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    with pytest.raises(NotFittedError):
        alignment(unfitted, x)
    with pytest.raises(TypeError, match="float32"):
        alignment(la, x.float())
    with pytest.raises(ValueError, match="empty"):
        alignment(la, x[:0])
    with pytest.raises(ValueError, match="chunk_size"):
        alignment(la, x, chunk_size=0)
    with pytest.raises(TypeError, match="Alignment"):
        ood_scores({"variance": x})
    zero_prior = Alignment(torch.ones(1), torch.ones(1), torch.ones(1, 1), 0.0)
    with pytest.raises(ValueError, match="prior_precision > 0"):
        _ = zero_prior.combined
    assert "variance (prior)" not in ood_scores(zero_prior)


def test_plot_alignment(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    from laplace_glas.plotting import plot_alignment

    la, _, X = fitted("regression", 1, k=3)
    results = {"in": alignment(la, X[:10]), "out": alignment(la, 5 + X[:10])}
    path = tmp_path / "alignment.png"
    fig = plot_alignment(results, path=path, complement="prior", title="toy")
    assert len(fig.axes[0].collections) == 2
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="complement"):
        plot_alignment(results, complement="full")


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp([3, 6, 2], seed=4)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["input_ids"]) * batch["scale"]


class DataDependent(nn.Module):
    """A forward that reads a value of its input: no vmap over examples."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp([3, 6, 2], seed=5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * (2.0 if float(x.abs().max()) > 1.0 else 1.0)


def test_mapping_inputs_and_models_without_vmap():
    g = torch.Generator().manual_seed(6)
    X = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.randn(20, 2, generator=g, dtype=torch.float64)
    x = torch.randn(3, 3, generator=g, dtype=torch.float64)

    model = DictInput()
    scale = torch.tensor(1.5, dtype=torch.float64)
    batches = [
        {"input_ids": X[i : i + 10], "scale": scale, "labels": y[i : i + 10]} for i in (0, 10)
    ]
    la = Laplace(
        model, "regression", subset_of_weights="all", hessian_structure="glas", n_components=3
    )
    la.fit(batches)
    result = alignment(la, {"input_ids": x, "scale": scale}, chunk_size=2)
    J = dense_jacobian(model.net, x) * 1.5
    torch.testing.assert_close(result.jacobian_norm2, J.square().sum(dim=(1, 2)))
    torch.testing.assert_close(
        result.projected_norm2, (J @ la.eigenvectors).square().sum(dim=(1, 2))
    )

    model = DataDependent()
    la = fit_glas(model, X, y, n_components=3)
    result = alignment(la, x)
    rows = [dense_jacobian(model, x[i : i + 1]) for i in range(3)]
    J = torch.cat(rows)
    torch.testing.assert_close(result.jacobian_norm2, J.square().sum(dim=(1, 2)))
