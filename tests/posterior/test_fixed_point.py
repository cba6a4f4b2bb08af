"""The posterior-curvature fixed point against a dense iteration: the same averaged output
Hessians (the same draws), the GGN from reverse-mode Jacobians and ``Sigma`` by a dense
inverse, on a network whose GGN has exact null directions so that GLAS's posterior
(``k`` = the GGN's rank, the prior outside) is the full one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import Gained, loader, mlp, output_jacobian, train
from laplace import Laplace

from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian, softmax_hessian
from laplace_glas.posterior.fixed_point import (
    SharedJacobians,
    fit_posterior_curvature,
    frozen_logit_covariance,
    mixture_weights,
)


@pytest.fixture(scope="module")
def blobs():
    """A float64 2-6-3 tanh MLP (D = 39) on three blobs: its softmax GGN has the 7 null
    directions of the last layer (one shift of every class's weights and bias)."""
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]], dtype=torch.float64)
    y = torch.arange(3).repeat_interleave(20)
    X = centers[y] + 0.9 * torch.randn(60, 2, generator=g, dtype=torch.float64)
    model = train(mlp([2, 6, 3], dtype=torch.float64, seed=2), X, y, steps=400, classification=True)
    return model, X, y


def _glas(model, **kwargs):
    return Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="glas", **kwargs
    )


def test_mixture_weights_halve_from_the_newest():
    assert mixture_weights(1) == [1.0]
    assert mixture_weights(2) == [0.5, 0.5]
    assert mixture_weights(3) == [0.25, 0.25, 0.5]
    assert sum(mixture_weights(9)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least one"):
        mixture_weights(0)


def test_the_fixed_point_is_the_dense_iteration(blobs):
    model, X, y = blobs
    k, tau, n_steps, n_draws, seed = 32, 2.0, 3, 16, 11  # 39 weights - 7 null directions
    la = _glas(model, n_components=k, complement="prior", prior_precision=tau)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the null directions' numerical rank
        history = fit_posterior_curvature(
            la, loader(X, y, 25), n_steps=n_steps, n_draws=n_draws, optimize_prior=False, seed=seed
        )
    assert [h.step for h in history] == list(range(n_steps + 1))

    out, J = output_jacobian(model, X)
    eye = torch.eye(J.shape[-1], dtype=J.dtype)
    G = torch.einsum("nci,ncd,ndj->ij", J, softmax_hessian(out.softmax(-1)), J)
    covariances = []
    for step in range(1, n_steps + 1):
        Sigma = torch.linalg.inv(G + tau * eye)
        V = torch.einsum("nci,ij,ndj->ncd", J, Sigma, J)
        covariances.append(lambda x, V=V: V)
        weights = mixture_weights(len(covariances))
        hessian = PosteriorAveragedHessian(covariances, weights, n_draws, seed=seed + step)
        G = torch.einsum("nci,ncd,ndj->ij", J, hessian.matrices(X, out), J)
    eigenvalues = torch.linalg.eigvalsh(G).flip(0)
    assert eigenvalues[k:].abs().max() < 1e-10 * eigenvalues[0]  # the null directions
    torch.testing.assert_close(la.eigenvalues * X.shape[0], eigenvalues[:k], rtol=1e-8, atol=0)
    # the predictive's logit covariance is the dense posterior's
    Sigma = torch.linalg.inv(G + tau * eye)
    x_test = torch.randn(5, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, J_test = output_jacobian(model, x_test)
    _, f_var = la._glm_predictive_distribution(x_test)
    torch.testing.assert_close(
        f_var, torch.einsum("nci,ij,ndj->ncd", J_test, Sigma, J_test), rtol=1e-7, atol=1e-10
    )
    # the records: the eigenvalues' relative change between consecutive fits
    assert history[0].relative_change != history[0].relative_change  # nan
    assert all(h.relative_change >= 0 for h in history[1:])
    assert all(float(h.prior_precision) == tau for h in history)


def test_a_snapshot_keeps_the_posterior_it_was_taken_of(blobs):
    model, X, y = blobs
    la = _glas(model, n_components=5)
    la.fit(loader(X, y, 30))
    covariance = frozen_logit_covariance(la)
    before = covariance(X[:7]).clone()
    la.prior_precision = 50.0
    la.fit(loader(X[:30], y[:30], 30))
    torch.testing.assert_close(covariance(X[:7]), before, rtol=0, atol=0)
    assert not torch.allclose(la._glm_predictive_distribution(X[:7])[1], before)
    assert la.model is model  # the network is shared, not copied


def test_the_evidence_chooses_the_prior_after_every_fit(blobs):
    model, X, y = blobs
    la = _glas(model, n_components=10)
    history = fit_posterior_curvature(la, loader(X, y, 30), n_steps=2, n_draws=8)
    assert len({float(h.prior_precision) for h in history}) == 3
    assert isinstance(la.output_hessian, PosteriorAveragedHessian)
    assert la.output_hessian.weights == (0.5, 0.5)
    # the last record is the posterior la holds now
    assert history[-1].log_marginal_likelihood == pytest.approx(float(la.log_marginal_likelihood()))


def test_the_averaged_curvature_sharpens_saturated_training_points(blobs):
    """The reason for the fixed point: at the MAP's Hessian a confidently fitted network
    keeps the prior's variance where its points saturate; the averaged Hessian does not."""
    model, X, y = blobs
    la = _glas(model, n_components=20)
    la.fit(loader(X, y, 30))
    la.optimize_prior_precision()
    at_map = la._glm_predictive_distribution(X)[1].diagonal(dim1=1, dim2=2).sum()
    fit_posterior_curvature(la, loader(X, y, 30), n_steps=4, n_draws=32)
    averaged = la._glm_predictive_distribution(X)[1].diagonal(dim1=1, dim2=2).sum()
    assert averaged < 0.5 * at_map


def test_regression_and_bad_arguments_are_refused(blobs, toy_regression):
    model, X, y = blobs
    with pytest.raises(ValueError, match="softmax cross-entropy"):
        fit_posterior_curvature(
            Laplace(toy_regression[0], "regression", hessian_structure="glas",
                    subset_of_weights="all"),
            loader(*toy_regression[1:]),
        )  # fmt: skip
    la = _glas(model, n_components=5)
    with pytest.raises(TypeError, match="n_steps"):
        fit_posterior_curvature(la, loader(X, y), n_steps=0)
    with pytest.raises(TypeError, match="output_hessian must be None"):
        la.output_hessian = "posterior"
    reg = Laplace(toy_regression[0], "regression", hessian_structure="glas",
                  subset_of_weights="all")  # fmt: skip
    with pytest.raises(ValueError, match="regression"):
        reg.output_hessian = PosteriorAveragedHessian([lambda x: None], [1.0])


def _explicit_eigenvalues(model, X, hessian, k):
    """The top ``k`` eigenvalues of ``sum_n J_n^T tilde Lambda_n J_n`` (jacrev)."""
    out, J = output_jacobian(model, X)
    G = torch.einsum("nci,ncd,ndj->ij", J, hessian.matrices(X, out), J)
    return torch.linalg.eigvalsh(G).flip(0)[:k]


def _constant_hessian(C: int) -> PosteriorAveragedHessian:
    return PosteriorAveragedHessian(
        [lambda x: (0.2 + x.reshape(len(x), -1)[:, :1, None].abs()) * torch.eye(C).double()],
        [1.0],
        16,
        seed=2,
    )


def test_curvlinops_operator_takes_it_through_the_surrogate_loss(blobs):
    model, X, y = blobs
    la = _glas(model, n_components=5, solver="lanczos", complement="zero")
    la.output_hessian = _constant_hessian(3)
    la.fit(loader(X, y, 25))
    assert la.lanczos_info.operator.startswith("curvlinops")
    reference = _explicit_eigenvalues(model, X, la.output_hessian, 5)
    torch.testing.assert_close(la.eigenvalues * 60, reference, rtol=1e-7, atol=0)


def test_kfacs_own_pass_and_other_curvatures_refuse_it(blobs):
    from laplace.curvature import CurvlinopsEF

    model, X, y = blobs
    la = _glas(model, n_components=5, complement="kron_diag")
    la.output_hessian = _constant_hessian(3)
    with pytest.raises(ValueError, match="complement='kron_diag' needs KFAC's data pass"):
        la.fit(loader(X, y))
    la = _glas(model, n_components=5, complement="zero", backend=CurvlinopsEF)
    la.output_hessian = _constant_hessian(3)
    with pytest.raises(ValueError, match="got backend curvature 'ef'"):
        la.fit(loader(X, y))


def test_a_model_outside_the_factored_operator_takes_it_through_torch_func():
    model = Gained([2, 4, 3], [1.0, 0.5, 2.0]).eval()
    g = torch.Generator().manual_seed(0)
    X = torch.randn(12, 2, generator=g, dtype=torch.float64)
    y = torch.arange(3).repeat(4)
    la = _glas(model, n_components=5, complement="zero")
    la.output_hessian = PosteriorAveragedHessian(
        [lambda x: 0.5 * torch.eye(3, dtype=x.dtype).expand(len(x), 3, 3)], [1.0], 16
    )
    la.fit(loader(X, y))
    assert la.lanczos_info.operator.startswith("jacobian")
    out, J = output_jacobian(model, X)
    G = torch.einsum("nci,ncd,ndj->ij", J, la.output_hessian.matrices(X, out), J)
    reference = torch.linalg.eigvalsh(G).flip(0)[:5]
    torch.testing.assert_close(la.eigenvalues * 12, reference, rtol=1e-8, atol=0)


def test_a_model_outside_the_factors_takes_it_through_the_linearised_operator(
    without_jacobian,
):
    model = Gained([2, 4, 3], [1.0, 0.5, 2.0]).eval()
    X = torch.randn(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y = torch.arange(3).repeat(4)
    la = _glas(model, n_components=3, complement="zero")
    la.output_hessian = _constant_hessian(3)
    la.fit(loader(X, y))
    assert la.lanczos_info.operator.startswith("linearised")
    reference = _explicit_eigenvalues(model, X, la.output_hessian, 3)
    torch.testing.assert_close(la.eigenvalues * 12, reference, rtol=1e-7, atol=0)


class _Recurrent(torch.nn.Module):
    """An ``nn.LSTM(2, 5)`` over 4 steps and a linear head of its last state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lstm = torch.nn.LSTM(2, 5, batch_first=True).double()
        self.head = torch.nn.Linear(5, 3).double()

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def test_an_lstm_takes_it_with_the_diagonal_complement():
    model = _Recurrent().eval()
    g = torch.Generator().manual_seed(5)
    X = torch.randn(16, 4, 2, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    la = _glas(model, n_components=4, complement="diag")
    history = fit_posterior_curvature(la, loader(X, y, 8), n_steps=2, n_draws=8)
    assert len(history) == 3 and la.complement == "diag"
    reference = _explicit_eigenvalues(model, X, la.output_hessian, 4)
    torch.testing.assert_close(la.eigenvalues * 16, reference, rtol=1e-6, atol=0)


class _Normed(torch.nn.Module):
    """Linear layers around a LayerNorm: 'auto' resolves to 'kron_diag' (KFAC where it
    covers a layer, the GGN diagonal of the norm's weights), a separate data pass."""

    def __init__(self):
        super().__init__()
        self.inner = mlp([2, 6], dtype=torch.float64, seed=5)
        self.norm = torch.nn.LayerNorm(6).double()
        self.head = mlp([6, 3], dtype=torch.float64, seed=6)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.inner(x))))


def test_a_complement_the_average_cannot_reach_is_refused_not_dropped(blobs):
    _, X, y = blobs
    model = _Normed().eval()
    la = _glas(model, n_components=5, prior_precision=3.0)
    with pytest.raises(ValueError, match="complement='kron_diag' needs KFAC's data pass") as info:
        fit_posterior_curvature(la, loader(X, y, 30), n_steps=2, n_draws=8)
    assert "Pass complement='diag'" in str(info.value)
    assert la.output_hessian is None  # reset: a plain fit works again
    la.fit(loader(X, y, 30))
    assert la.complement == "kron_diag"
    # the GGN diagonal's complement and the subspace alone, asked for, follow it
    for complement in ("diag", "zero"):
        la = _glas(model, n_components=5, complement=complement)
        history = fit_posterior_curvature(la, loader(X, y, 30), n_steps=2, n_draws=8)
        assert len(history) == 3 and la.complement == complement


def test_the_diagonal_complement_is_the_averaged_ggns_diagonal(blobs):
    """complement='diag' with the averaged Hessian: the per-example pass (BackPACK cannot
    take it) against ``diag(sum_n J_n^T tilde Lambda_n J_n)`` from jacrev."""
    model, X, y = blobs
    hessian = PosteriorAveragedHessian(
        [lambda x: (0.3 + x[:, :1, None].abs()) * torch.eye(3, dtype=x.dtype)], [1.0], 16, 3
    )
    la = _glas(model, n_components=5, complement="diag")
    la.output_hessian = hessian
    la.fit(loader(X, y, 25))
    out, J = output_jacobian(model, X)
    G = torch.einsum("nci,ncd,ndj->ij", J, hessian.matrices(X, out), J)
    torch.testing.assert_close(la._ggn_diagonal, G.diagonal(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(la.eigenvalues * 60, torch.linalg.eigvalsh(G).flip(0)[:5])


def test_auto_is_set_to_what_the_maps_fit_resolved(blobs):
    model, X, y = blobs
    la = _glas(model, n_components=5)
    assert la.complement == "auto"
    fit_posterior_curvature(la, loader(X, y, 30), n_steps=1, n_draws=8)
    assert la.complement == "kron"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_draws": 7}, ValueError, "even"),
        ({"seed": None}, TypeError, "seed must be an int"),
        ({"n_steps": 1.5}, TypeError, "n_steps"),
    ],
)
def test_bad_arguments_are_refused_before_any_fit(blobs, kwargs, error, match):
    model, X, y = blobs
    la = _glas(model, n_components=5, prior_precision=5.0)
    with pytest.raises(error, match=match):
        fit_posterior_curvature(la, loader(X, y, 30), **kwargs)
    assert float(la.prior_precision) == 5.0 and getattr(la, "H", None) is None


def test_another_laplace_object_is_refused_by_name(blobs):
    model, X, y = blobs
    kron = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    with pytest.raises(TypeError, match=r"takes a GLAS posterior.*KronLaplace"):
        fit_posterior_curvature(kron, loader(X, y, 30))
    with pytest.raises(TypeError, match="takes a GLAS posterior"):
        fit_posterior_curvature(model, loader(X, y, 30))


def test_shared_jacobians_form_j_once_per_input():
    calls = []

    class Counting:
        def output_jacobians(self, x):
            calls.append(x)
            return x * 2

    shared = SharedJacobians(Counting())
    a, b = torch.ones(2, 3), torch.ones(2, 3)
    assert torch.equal(shared(a), 2 * a) and shared(a) is shared(a)
    shared(b)  # equal values, another object: formed again
    assert len(calls) == 2
