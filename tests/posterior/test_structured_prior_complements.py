"""The curvature-aware complements under a layerwise or per-weight prior ``P_0 =
diag(p)``: ``Sigma = U A^{-1} U^T + P E^{-1} P`` with ``A = diag(a) + U^T P_0 U`` and
``E = C + P_0``, against the dense matrices."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import loader, output_jacobian, regression_data, train
from laplace import Laplace
from laplace.utils.matrix import Kron
from torch import nn

import laplace_glas  # noqa: F401
from laplace_glas.posterior.complement import DiagonalComplementPosterior
from laplace_glas.posterior.kron_complement import KronComplementPosterior, KronCurvature

DOUBLE = torch.float64


def _dense_sigma(U, a, p, C):
    eye = torch.eye(U.shape[0], dtype=DOUBLE)
    P = eye - U @ U.T
    A = torch.diag(a) + U.T @ torch.diag(p) @ U
    return U @ torch.linalg.inv(A) @ U.T + P @ torch.linalg.inv(C + torch.diag(p)) @ P


def _check_every_form(post, sigma, p):
    D = sigma.shape[0]
    torch.testing.assert_close(post.covariance.to_dense(), sigma)
    torch.testing.assert_close(post.precision.to_dense(), torch.linalg.inv(sigma))
    V, w, base = post.covariance_factors()
    torch.testing.assert_close(V @ torch.diag(w) @ V.T + base(torch.eye(D, dtype=DOUBLE)), sigma)
    torch.testing.assert_close(post.log_det_posterior_precision, -torch.logdet(sigma))
    torch.testing.assert_close(post.log_det_ratio, -torch.logdet(sigma) - p.log().sum())
    torch.testing.assert_close(post.subspace_variances, torch.diagonal(post.U.T @ sigma @ post.U))
    delta = torch.randn(3, D, generator=torch.Generator().manual_seed(4), dtype=DOUBLE)
    expected = torch.einsum("nd,de,ne->n", delta, torch.linalg.inv(sigma), delta)
    torch.testing.assert_close(post.square_norm(delta), expected)
    draws = post.sample(100_000, torch.Generator().manual_seed(1))
    empirical = draws.T @ draws / draws.shape[0]
    assert float((empirical - sigma).abs().max()) < 0.05 * float(sigma.abs().max())


def _parts():
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(9, 3, generator=g, dtype=DOUBLE))[0]
    a = torch.tensor([25.0, 3.0, 0.4], dtype=DOUBLE)
    return g, U, a


def test_the_diag_complement_under_a_per_weight_prior_is_the_dense_posterior():
    g, U, a = _parts()
    c = 4 * torch.rand(9, generator=g, dtype=DOUBLE)
    p = 0.2 + torch.rand(9, generator=g, dtype=DOUBLE)
    post = DiagonalComplementPosterior(U, a, p, c)
    _check_every_form(post, _dense_sigma(U, a, p, torch.diag(c)), p)


def test_the_kron_complement_under_a_layerwise_prior_is_the_dense_posterior():
    g, U, a = _parts()

    def factor(n):
        M = torch.randn(n, n + 1, generator=g, dtype=DOUBLE)
        return M @ M.T / n

    kron = Kron([[factor(3), factor(2)], [factor(3)]])  # D = 6 + 3
    s = torch.tensor(1.5, dtype=DOUBLE)
    C = KronCurvature(KronCurvature.decompose(kron, DOUBLE, U.device), s)
    p = torch.cat([torch.full((6,), 0.7, dtype=DOUBLE), torch.full((3,), 2.5, dtype=DOUBLE)])
    dense_C = s * torch.block_diag(torch.kron(kron.kfacs[0][0], kron.kfacs[0][1]), kron.kfacs[1][0])
    post = KronComplementPosterior(U, a, p, C)
    _check_every_form(post, _dense_sigma(U, a, p, dense_C), p)
    with pytest.raises(ValueError, match="per-weight prior needs complement='diag'"):
        KronComplementPosterior(U, a, p + torch.arange(9, dtype=DOUBLE) / 10, C)


@pytest.fixture
def data():
    X, y = regression_data(n=60, dtype=DOUBLE, seed=5, d_in=2)
    torch.manual_seed(0)
    model = train(nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).to(DOUBLE), X, y,
                  steps=120)  # fmt: skip
    return model, X, y


def _glas(model, **kwargs):
    return Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                   n_components=3, sigma_noise=0.3, **kwargs)  # fmt: skip


def test_a_layerwise_prior_keeps_kfacs_complement_end_to_end(data):
    model, X, y = data
    layerwise = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=DOUBLE)
    la = _glas(model, prior_precision=layerwise)
    la.fit(loader(X, y, batch_size=20))
    assert la.complement == "kron"  # was a silent 'zero'
    sizes = [q.numel() for q in la.params]
    p = torch.repeat_interleave(layerwise, torch.tensor(sizes))
    kfacs = la._ggn_kron.kfacs
    K = torch.block_diag(*[torch.kron(*b) if len(b) == 2 else b[0] for b in kfacs])
    sigma = _dense_sigma(la.eigenvectors, la.subspace_curvature, p, la._H_factor * K)
    _, J = output_jacobian(model, X[:6])
    _, var = la(X[:6], pred_type="glm")
    torch.testing.assert_close(var, torch.einsum("ncd,de,nke->nck", J, sigma, J))
    # the evidence: laplace-torch's formula with this posterior's log-determinants
    torch.testing.assert_close(la.log_det_ratio, -torch.logdet(sigma) - p.log().sum())
    # the layerwise evidence ascent runs through the complement and improves it
    before = la.log_marginal_likelihood().item()
    la.optimize_prior_precision(prior_structure="layerwise", n_steps=30)
    assert la.complement == "kron" and la.prior_precision.shape == (4,)
    assert la.log_marginal_likelihood().item() > before


def test_a_per_weight_prior_resolves_to_diag_and_kron_refuses_it_by_name(data):
    model, X, y = data
    D = sum(q.numel() for q in model.parameters())
    la = _glas(model, prior_precision=torch.linspace(0.5, 2.0, D, dtype=DOUBLE))
    la.fit(loader(X, y, batch_size=20))
    assert la.complement == "diag"
    assert "not 'kron': complement='kron' takes a scalar or layerwise prior" in (
        la.complement_reason
    )
    kron = _glas(model, prior_precision=1.0)
    kron.fit(loader(X, y, batch_size=20))
    assert kron.complement == "kron"
    with pytest.raises(ValueError, match="per-weight prior needs complement='diag'"):
        kron.prior_precision = torch.ones(D, dtype=DOUBLE)
    assert kron.prior_precision.numel() == 1  # the refused call changed nothing
    # nor does any other call that refuses a per-weight prior on 'kron'
    kron.prior_precision = 0.7
    held_out = loader(X, y, batch_size=20)
    refused = [
        lambda: kron.log_marginal_likelihood(prior_precision=torch.ones(D, dtype=DOUBLE)),
        lambda: kron.optimize_prior_precision(prior_structure="diag", n_steps=3),
        lambda: kron.optimize_prior_precision(
            method="gridsearch", prior_structure="diag", val_loader=held_out, grid_size=3
        ),
    ]
    for call in refused:
        with pytest.raises(ValueError, match="complement='kron' takes a scalar or layerwise"):
            call()
        assert kron.prior_precision.tolist() == [0.7]
    kron(X[:2], pred_type="glm")  # and every predictive still takes the prior it has


def test_marglik_training_with_its_layerwise_prior_keeps_kfacs_complement():
    from laplace import marglik_training

    X, y = regression_data(n=64, seed=6, d_in=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backend note and the float32 rank warning
        la, *_ = marglik_training(
            model, loader(X, y, batch_size=32), likelihood="regression",
            hessian_structure="glas", n_epochs=4, n_hypersteps=3, marglik_frequency=2,
        )  # fmt: skip
    assert la.complement == "kron"
    assert la.prior_precision.shape == (4,)  # laplace-torch's default: layerwise
    assert torch.isfinite(la.log_marginal_likelihood())
