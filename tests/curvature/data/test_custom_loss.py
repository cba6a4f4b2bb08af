"""``loss_fn``: the GGN of a user's loss module, checked against an explicit GGN.

The reference forms ``G = (1/N) J^T H J`` densely: ``J`` the Jacobian of all outputs of
the batch in the weights (``torch.func.jacrev``), ``H`` the Hessian of the summed loss in
those outputs (``torch.func.hessian``), ``N`` the number of likelihood terms.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import loader, mlp, regression_data, train
from laplace import Laplace
from torch import nn
from torch.func import functional_call, hessian, jacrev

import laplace_glas


def explicit_loss_ggn(model: nn.Module, loss_fn: nn.Module, X, y, n_terms: int) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for p in model.parameters())

    def outputs(*flat_params):
        return functional_call(model, dict(zip(names, flat_params)), (X,)).reshape(-1)

    jacobians = jacrev(outputs, tuple(range(len(params))))(*params)
    J = torch.cat([j.reshape(j.shape[0], -1) for j in jacobians], 1)
    f = outputs(*params).detach()
    shape = model(X).shape
    H = hessian(lambda out: loss_fn(out.reshape(shape), y))(f)
    return J.T @ H @ J / n_terms


def fit(model, X, y, likelihood, loss_fn=None, k=4, batch_size=16, **kwargs):
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=k,
        loss_fn=loss_fn,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la.fit(loader(X, y, batch_size))
    return la


def assert_top_eigenpairs(la, G, k, rtol=1e-8):
    """Eigenvalues equal the explicit G's top k, and ``G u_j = lambda_j u_j`` with the
    explicit G (robust to (near-)degenerate pairs, unlike per-vector overlaps).
    """
    ref_values = torch.linalg.eigvalsh(G).flip(0)[:k]
    values, U = la.lanczos_info.raw_values, la.eigenvectors
    torch.testing.assert_close(values, ref_values, rtol=rtol, atol=1e-10)
    residuals = torch.linalg.vector_norm(G @ U - U * values, dim=0)
    assert residuals.max() < 1e3 * rtol * ref_values[0], residuals


class HalfSSE(nn.Module):
    """``0.5 * ||f - y||^2`` summed: the unit-noise Gaussian negative log-likelihood."""

    reduction = "sum"

    def forward(self, output, target):
        return 0.5 * ((output - target) ** 2).sum()


@pytest.fixture(scope="module")
def regression():
    X, y = regression_data(40, dtype=torch.float64)
    return train(mlp([1, 8, 1], dtype=torch.float64), X, y, steps=200), X, y


@pytest.fixture(scope="module")
def classification():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()
    return train(mlp([2, 6, 3], dtype=torch.float64), X, y, steps=200, classification=True), X, y


def test_half_sse_reproduces_the_default_regression_curvature(regression):
    model, X, y = regression
    default = fit(model, X, y, "regression", sigma_noise=0.3)
    custom = fit(model, X, y, "regression", HalfSSE(), sigma_noise=0.3)
    torch.testing.assert_close(custom.eigenvalues, default.eigenvalues, rtol=1e-10, atol=0)
    torch.testing.assert_close(custom.posterior_variances, default.posterior_variances)


def test_huber_regression_matches_explicit_ggn(regression):
    model, X, y = regression
    loss_fn = nn.HuberLoss(reduction="sum", delta=0.05)  # some residuals in the linear part
    la = fit(model, X, y, "regression", loss_fn)
    G = explicit_loss_ggn(model, loss_fn, X, y, len(X))
    default = fit(model, X, y, "regression")
    assert not torch.allclose(la.eigenvalues, default.eigenvalues, rtol=1e-2)
    assert_top_eigenpairs(la, G, 4)


def test_class_weighted_cross_entropy_matches_explicit_ggn(classification):
    model, X, y = classification
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 4.0, 0.5], dtype=torch.float64))
    loss_fn.reduction = "sum"
    la = fit(model, X, y, "classification", loss_fn)
    assert_top_eigenpairs(la, explicit_loss_ggn(model, loss_fn, X, y, len(X)), 4)


class TemperedCrossEntropy(nn.Module):
    """Summed cross-entropy of ``logits / T`` (a loss with its own output Hessian)."""

    reduction = "sum"

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, output, target):
        return nn.functional.cross_entropy(output / self.temperature, target, reduction="sum")


def test_custom_module_matches_explicit_ggn(classification):
    model, X, y = classification
    loss_fn = TemperedCrossEntropy(2.5)
    la = fit(model, X, y, "classification", loss_fn)
    default = fit(model, X, y, "classification")
    assert not torch.allclose(la.eigenvalues, default.eigenvalues, rtol=1e-2)
    assert_top_eigenpairs(la, explicit_loss_ggn(model, loss_fn, X, y, len(X)), 4)


class WeightedTokenLoss(nn.Module):
    """Token-weighted cross-entropy over the last axis, padding (0) left out, summed."""

    reduction = "sum"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, output, target):
        return nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]),
            target.reshape(-1),
            weight=self.weight,
            ignore_index=0,
            reduction="sum",
        )


def test_sequence_custom_loss_matches_explicit_ggn_over_tokens():
    from laplace_glas.applications.smiles import SmilesLSTM

    torch.manual_seed(0)
    model = SmilesLSTM(6, 3, 3, 1).double().eval()
    x = torch.randint(1, 6, (8, 5))
    y = torch.roll(x, -1, 1)
    y[:4, -2:] = 0  # padding
    loss_fn = WeightedTokenLoss(torch.tensor([1.0, 0.2, 3.0, 1.0, 0.5, 2.0], dtype=torch.float64))
    la = fit(model, x, y, "classification", loss_fn, k=4, batch_size=3, ignore_index=0)
    default = fit(model, x, y, "classification", k=4, batch_size=3, ignore_index=0)
    assert not torch.allclose(la.eigenvalues, default.eigenvalues, rtol=1e-2)
    n_tokens = int((y != 0).sum())
    assert la.n_data == n_tokens
    assert_top_eigenpairs(la, explicit_loss_ggn(model, loss_fn, x, y, n_tokens), 4, rtol=1e-7)


def test_loss_fn_must_be_a_summed_module(classification):
    model, *_ = classification
    kwargs = {"subset_of_weights": "all", "hessian_structure": "glas", "n_components": 2}
    with pytest.raises(ValueError, match="reduction='sum'"):
        Laplace(model, "classification", loss_fn=nn.CrossEntropyLoss(), **kwargs)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        Laplace(model, "classification", loss_fn=nn.functional.cross_entropy, **kwargs)


def test_loss_fn_buffers_follow_the_model_dtype(classification):
    """A float32 class weight with a float64 model: moved, same result as float64."""
    model, X, y = classification
    w = torch.tensor([1.0, 4.0, 0.5])
    la32 = fit(model, X, y, "classification", nn.CrossEntropyLoss(weight=w, reduction="sum"))
    la64 = fit(
        model, X, y, "classification", nn.CrossEntropyLoss(weight=w.double(), reduction="sum")
    )
    torch.testing.assert_close(la32.eigenvalues, la64.eigenvalues, rtol=1e-12, atol=0)


def test_loss_fn_with_subsample_and_replica_check(classification):
    model, X, y = classification
    loss_fn = TemperedCrossEntropy(2.5)
    la = fit(model, X, y, "classification", loss_fn, k=3, subsample_size=20, seed=4)
    # the subsample's explicit GGN: the same 20 points, drawn by the same generator
    from laplace_glas.curvature.data.batches import subsample_loader

    batches = list(subsample_loader(loader(X, y, 16), 20, torch.Generator().manual_seed(4)))
    Xs = torch.cat([b[0] for b in batches])
    ys = torch.cat([b[1] for b in batches])
    assert len(Xs) == 20
    assert_top_eigenpairs(la, explicit_loss_ggn(model, loss_fn, Xs, ys, 20), 3, rtol=1e-7)
    check = laplace_glas.replica_check(la, loader(X, y, 16), n_replicas=1, subsample=20)
    assert len(check.overlaps) == 1 and check.best_overlap.shape == (3,)


def test_loss_fn_errors_name_the_problem(classification):
    model, X, y = classification
    kwargs = {"subset_of_weights": "all", "hessian_structure": "glas", "n_components": 2}
    with pytest.raises(ValueError, match="ignore_index"):
        Laplace(
            model,
            "classification",
            loss_fn=nn.CrossEntropyLoss(reduction="sum"),  # ignores -100
            ignore_index=0,
            **kwargs,
        )

    class Broken(nn.Module):
        reduction = "sum"

        def forward(self, output, target):
            return output.sum(0)  # not a scalar

    la = Laplace(model, "classification", loss_fn=Broken(), **kwargs)
    with pytest.raises(ValueError, match="scalar"):
        la.fit(loader(X, y))

    class WrongAxis(nn.Module):
        reduction = "sum"

        def forward(self, output, target):
            return nn.functional.cross_entropy(output.T, target, reduction="sum")

    la = Laplace(model, "classification", loss_fn=WrongAxis(), **kwargs)
    with pytest.raises(ValueError, match="loss_fn failed on the first training batch"):
        la.fit(loader(X, y))


def test_state_dict_records_the_loss(classification):
    model, X, y = classification
    la = fit(model, X, y, "classification", TemperedCrossEntropy(2.0), k=2)
    state = la.state_dict()
    assert state["loss_fn"] == "TemperedCrossEntropy"
    other = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas", n_components=2
    )
    with pytest.warns(UserWarning, match="TemperedCrossEntropy"):
        other.load_state_dict(state)
    torch.testing.assert_close(other.eigenvalues, la.eigenvalues)
