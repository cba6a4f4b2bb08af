"""complement='kron_diag': KFAC's factors where KFAC covers a layer, the exact GGN
diagonal elsewhere, against dense references."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import loader, output_jacobian, regression_data, train
from laplace import Laplace
from laplace.utils.matrix import Kron
from torch import nn

import laplace_glas  # noqa: F401
from laplace_glas.curvature.complement.kfac_layers import kfac_parameters, kron_diag_refusal
from laplace_glas.curvature.complement.kron import ggn_kron
from laplace_glas.posterior.kron_complement import KronComplementPosterior, KronCurvature

DOUBLE = torch.float64


def _mixed_parts():
    g = torch.Generator().manual_seed(0)

    def factor(n):
        M = torch.randn(n, n + 1, generator=g, dtype=DOUBLE)
        return M @ M.T / n

    kron = Kron([[factor(3), factor(2)], [], [factor(3)], []])  # D = 6 + 4 + 3 + 2
    diagonals = [3 * torch.rand(4, generator=g, dtype=DOUBLE)]
    diagonals.append(torch.rand(2, generator=g, dtype=DOUBLE))
    dense = torch.block_diag(
        torch.kron(kron.kfacs[0][0], kron.kfacs[0][1]),
        torch.diag(diagonals[0]),
        kron.kfacs[2][0],
        torch.diag(diagonals[1]),
    )
    U = torch.linalg.qr(torch.randn(15, 3, generator=g, dtype=DOUBLE))[0]
    return kron, diagonals, dense, U


def test_diagonal_blocks_equal_the_dense_block_diagonal_curvature():
    kron, diagonals, dense, U = _mixed_parts()
    s, tau = torch.tensor(1.7, dtype=DOUBLE), torch.tensor(0.4, dtype=DOUBLE)
    C = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device, diagonals), s)
    eye = torch.eye(15, dtype=DOUBLE)
    torch.testing.assert_close(C.to_dense(tau), s * dense + tau * eye)
    torch.testing.assert_close(C.to_dense(tau, -1.0), torch.linalg.inv(s * dense + tau * eye))
    torch.testing.assert_close(C.logdet(tau), torch.logdet(s * dense + tau * eye))
    F = C.factor(eye, tau, -1.0)
    torch.testing.assert_close(F @ F.T, torch.linalg.inv(s * dense + tau * eye))
    a = torch.tensor([20.0, 3.0, 0.2], dtype=DOUBLE)
    post = KronComplementPosterior(U, a, tau, C, "kron_diag")
    P = eye - U @ U.T
    sigma = U @ torch.diag(1 / (a + tau)) @ U.T + P @ torch.linalg.inv(s * dense + tau * eye) @ P
    torch.testing.assert_close(post.covariance.to_dense(), sigma)
    torch.testing.assert_close(post.log_det_posterior_precision, -torch.logdet(sigma))
    with pytest.raises(ValueError, match="needs its GGN diagonal"):
        KronCurvature.decompose(kron, DOUBLE, U.device, diagonals[:1])


class NormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 5)
        self.norm = nn.LayerNorm(5)
        self.second = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.norm(self.first(x))))


@pytest.fixture
def norm_fit():
    X, y = regression_data(n=60, dtype=DOUBLE, seed=3, d_in=2)
    torch.manual_seed(0)
    model = train(NormMLP().to(DOUBLE), X, y, steps=150)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=3, sigma_noise=0.3, prior_precision=0.8)  # fmt: skip
    la.fit(loader(X, y, batch_size=20))
    return la, model, X, y


def test_auto_resolves_to_the_mix_with_its_reason(norm_fit):
    la, model, *_ = norm_fit
    assert la.complement == "kron_diag"
    assert "resolved to 'kron_diag'" in la.complement_reason
    assert "LayerNorm" in la.complement_reason
    assert kfac_parameters(model) == ["first.weight", "first.bias", "second.weight", "second.bias"]
    assert kron_diag_refusal(nn.Sequential(nn.LayerNorm(3))) is not None


def test_the_mix_is_kfac_on_the_linear_layers_and_the_exact_diagonal_on_the_norm(norm_fit):
    la, model, X, y = norm_fit
    blocks = la._ggn_kron.kfacs
    assert [len(b) for b in blocks] == [2, 1, 0, 0, 2, 1]
    # the KFAC blocks are those of curvlinops' pass over the covered layers
    reference = ggn_kron(model, loader(X, y, batch_size=20), "regression", partial=True)
    for got, want in zip(blocks, reference.kfacs):
        for F, G in zip(got, want):
            torch.testing.assert_close(F, G)
    # the diagonal of the norm's weight and bias, from the explicit Jacobian
    _, J = output_jacobian(model, X)
    explicit = torch.einsum("tcd,tcd->d", J, J)
    torch.testing.assert_close(la._ggn_diagonal, explicit[15:25])


def test_the_glm_variance_equals_the_dense_posterior(norm_fit):
    la, model, X, _ = norm_fit
    U, a = la.eigenvectors, la.subspace_curvature
    tau = la.prior_precision.reshape(())
    s = la._H_factor
    kfacs = la._ggn_kron.kfacs
    diag = la._ggn_diagonal
    dense = torch.block_diag(
        torch.kron(kfacs[0][0], kfacs[0][1]), kfacs[1][0], torch.diag(diag),
        torch.kron(kfacs[4][0], kfacs[4][1]), kfacs[5][0],
    )  # fmt: skip
    eye = torch.eye(U.shape[0], dtype=DOUBLE)
    P = eye - U @ U.T
    C = s * dense  # the norm's diagonal less what span(U) holds (the residual curvature)
    C[15:25, 15:25] = torch.diag((s * diag - U[15:25].square() @ a).clamp_min(0))
    assert not torch.allclose(C, s * dense)
    sigma = U @ torch.diag(1 / (a + tau)) @ U.T + P @ torch.linalg.inv(C + tau * eye) @ P
    _, J = output_jacobian(model, X[:7])
    want = torch.einsum("ncd,de,nke->nck", J, sigma, J)
    _, var = la(X[:7], pred_type="glm")
    torch.testing.assert_close(var, want)
    torch.testing.assert_close(la.posterior_covariance.to_dense(), sigma)
    # evidence: the Occam term over all D directions
    torch.testing.assert_close(la.log_det_ratio, -torch.logdet(sigma) - U.shape[0] * tau.log())


def test_sampling_and_the_state_dict_round_trip(norm_fit):
    la, model, X, _ = norm_fit
    draws = la.sample(4, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (4, la.n_params)
    state = la.state_dict()
    other = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                    n_components=3, sigma_noise=0.3)  # fmt: skip
    other.load_state_dict(state)
    assert other.complement == "kron_diag"
    for got, want in zip(other(X[:5], pred_type="glm"), la(X[:5], pred_type="glm")):
        torch.testing.assert_close(got, want)
    broken = dict(state, ggn_diagonal=state["ggn_diagonal"][:-1])
    with pytest.raises(ValueError, match="ggn_diagonal"):
        other.load_state_dict(broken)


def test_explicit_kron_diag_on_an_lstm_and_the_empirical_bayes_prior():
    class LSTMRegressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(2, 4, batch_first=True)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    model = LSTMRegressor().to(DOUBLE)
    X = torch.randn(40, 3, 2, dtype=DOUBLE)
    y = X.sum((1, 2)).unsqueeze(-1)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=2, complement="kron_diag")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=10))
    assert [len(b) for b in la._ggn_kron.kfacs] == [0, 0, 0, 0, 2, 1]
    _, J = output_jacobian(model, X)
    explicit = torch.einsum("tcd,tcd->d", J, J)
    torch.testing.assert_close(la._ggn_diagonal, explicit[: la._ggn_diagonal.numel()])
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision()
    assert la.log_marginal_likelihood().item() >= before - 1e-9


def test_kron_diag_on_a_model_kfac_covers_whole_is_kron():
    X, y = regression_data(n=40, dtype=DOUBLE, seed=4, d_in=2)
    torch.manual_seed(0)
    model = train(nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).to(DOUBLE), X, y,
                  steps=80)  # fmt: skip
    fits = {}
    for complement in ("kron", "kron_diag"):
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                     n_components=3, sigma_noise=0.3, complement=complement)  # fmt: skip
        la.fit(loader(X, y, batch_size=20))
        la.optimize_prior_precision()
        fits[complement] = la
    mixed, kron = fits["kron_diag"], fits["kron"]
    assert mixed._ggn_diagonal.numel() == 0
    torch.testing.assert_close(mixed.prior_precision, kron.prior_precision)
    for got, want in zip(mixed(X[:4], pred_type="glm"), kron(X[:4], pred_type="glm")):
        torch.testing.assert_close(got, want)
    other = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                    n_components=3, sigma_noise=0.3, complement="kron_diag")  # fmt: skip
    other.load_state_dict(mixed.state_dict())
    torch.testing.assert_close(other.log_marginal_likelihood(), mixed.log_marginal_likelihood())


class TiedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)
        self.second.weight = self.first.weight
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


def test_a_tied_weight_takes_the_exact_diagonal_not_one_uses_kfac_block():
    X, y = regression_data(n=40, dtype=DOUBLE, seed=5, d_in=2)
    torch.manual_seed(0)
    model = train(TiedMLP().to(DOUBLE), X, y, steps=80)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=2, sigma_noise=0.3)  # fmt: skip
    la.fit(loader(X, y, batch_size=20))
    assert la.complement == "kron_diag" and "tied" in la.complement_reason
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "first.weight" and la._ggn_kron.kfacs[0] == []
    _, J = output_jacobian(model, X)
    explicit = torch.einsum("tcd,tcd->d", J, J)  # both uses of the tied weight
    torch.testing.assert_close(la._ggn_diagonal, explicit[:4])


def test_auto_assigned_after_fit_keeps_the_fitted_curvature(norm_fit):
    la, model, X, _ = norm_fit
    variance = la(X[:3], pred_type="glm")[1]
    la.complement = "zero"
    la.complement = "auto"
    assert la.complement == "kron_diag" and "assigned after fit" in la.complement_reason
    torch.testing.assert_close(la(X[:3], pred_type="glm")[1], variance)
    other = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                    n_components=3, sigma_noise=0.3)  # fmt: skip
    other.load_state_dict(la.state_dict())
    assert other.complement == "kron_diag"


def test_the_evidence_gradient_in_sigma_matches_finite_differences(norm_fit):
    """The residual diagonal blocks do not depend on the noise (``a / s`` is the unit
    curvature): their deflation carried a spurious ``-U^2 lambda`` into d/d sigma
    (autograd 1569.8 against finite differences 1677.5 in a review's case)."""
    la, *_ = norm_fit
    tau = torch.tensor([1.0], dtype=DOUBLE)
    sigma = torch.tensor([0.3], dtype=DOUBLE, requires_grad=True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(tau, sigma), sigma)
    h = 1e-6

    def at(s: float) -> float:
        return float(la.log_marginal_likelihood(tau, torch.tensor([s], dtype=DOUBLE)))

    assert float(grad) == pytest.approx((at(0.3 + h) - at(0.3 - h)) / (2 * h), rel=1e-6)
    la.sigma_noise, la.prior_precision = 0.3, 0.8  # the fixture's


def test_diag_assigned_after_a_kron_diag_fit_is_refused_by_name(norm_fit):
    la, _, X, _ = norm_fit
    la.complement = "diag"
    try:
        with pytest.raises(ValueError, match=r"fitted with 'kron_diag' .*covers only"):
            la.log_marginal_likelihood()
        with pytest.raises(ValueError, match="Refit with complement='diag'"):
            la(X[:2], pred_type="glm")
    finally:
        la.complement = "auto"
    assert la.complement == "kron_diag"


def test_a_refused_evidence_call_leaves_prior_and_noise_as_they_were():
    X, y = regression_data(n=40, dtype=torch.float32, seed=2, d_in=2)
    torch.manual_seed(0)
    la = Laplace(NormMLP(), "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=3, sigma_noise=0.5, prior_precision=0.8)  # fmt: skip
    la.fit(loader(X, y, batch_size=20))
    with pytest.raises(ValueError, match="curvature overflows float32"):
        la.log_marginal_likelihood(torch.tensor([2.0]), torch.tensor([1e-18]))
    assert float(la.sigma_noise) == 0.5 and la.prior_precision.tolist() == [0.800000011920929]
    assert torch.isfinite(la(X[:2], pred_type="glm")[1]).all()
