"""laplace-torch's ``backend`` argument: each matrix against its dense reference.

The references are independent of curvlinops: the empirical Fisher from per-example
gradients (``torch.func.vmap(grad)``) and the Hessian from ``torch.func.hessian`` of
laplace-torch's summed loss, on a tiny float64 network; the evidence in the
``k >= rank`` limit is compared with laplace-torch's ``FullLaplace`` of the same
backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import loader, mlp
from laplace import Laplace
from laplace.curvature import (
    AsdlEF,
    AsdlGGN,
    AsdlHessian,
    BackPackEF,
    BackPackGGN,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
    EFInterface,
    GGNInterface,
)
from torch.func import functional_call, grad, hessian, vmap

from laplace_glas import ActiveSubspaceLaplace
from laplace_glas.curvature.backends import resolve_backend

N = 6
TAU = 0.8


def problem(likelihood):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, 2, generator=g, dtype=torch.float64)
    if likelihood == "regression":
        model = mlp([2, 4, 2], dtype=torch.float64)  # D = 22
        y = torch.randn(N, 2, generator=g, dtype=torch.float64)
    else:
        model = mlp([2, 4, 3], dtype=torch.float64)  # D = 27
        y = torch.tensor([0, 1, 2, 0, 1, 2])
    return model, X, y


def per_example_loss(model, likelihood):
    names = [n for n, _ in model.named_parameters()]

    def loss(theta, x, y):
        params = dict(zip(names, _split(theta, model)))
        f = functional_call(model, params, (x[None],))[0]
        if likelihood == "regression":
            return 0.5 * (f - y).square().sum()
        return torch.nn.functional.cross_entropy(f[None], y[None], reduction="sum")

    return loss


def _split(theta, model):
    out, i = [], 0
    for p in model.parameters():
        out.append(theta[i : i + p.numel()].reshape(p.shape))
        i += p.numel()
    return out


def dense_matrix(kind, likelihood):
    """Summed EF or Hessian of laplace-torch's loss, from torch.func."""
    model, X, y = problem(likelihood)
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    loss = per_example_loss(model, likelihood)
    if kind == "ef":
        G = vmap(grad(loss), in_dims=(None, 0, 0))(theta, X, y)  # (N, D)
        # laplace-torch's regression EF is 0.5 * EF(||f - y||^2) = 2 * EF(0.5 ||f - y||^2)
        return (2.0 if likelihood == "regression" else 1.0) * G.T @ G
    return sum(hessian(loss)(theta, X[n], y[n]) for n in range(N))


def fit(likelihood, backend, k, **kwargs):
    model, X, y = problem(likelihood)
    la = ActiveSubspaceLaplace(
        model,
        likelihood,
        backend=backend,
        n_components=k,
        loss_scaling="sum",
        prior_precision=TAU,
        rank_threshold=0.0,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=4))
    return la


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize(
    ("backend", "kind"), [(CurvlinopsEF, "ef"), (CurvlinopsHessian, "hessian")]
)
def test_top_eigenpairs_match_the_dense_matrix(likelihood, backend, kind):
    dense = dense_matrix(kind, likelihood)
    values, vectors = torch.linalg.eigh(dense)
    values, vectors = values.flip(0), vectors.flip(1)
    la = fit(likelihood, backend, k=4)
    assert la.curvature.kind == kind
    assert la.lanczos_info.operator == ("curvlinops EF" if kind == "ef" else "curvlinops Hessian")
    assert la.lanczos_info.solver == "lanczos"
    torch.testing.assert_close(la.H[1], values[:4], rtol=1e-8, atol=1e-10 * values[0])
    # eigenvectors up to sign: |<u_j, v_j>| = 1 for the (simple) leading eigenvalues
    overlap = (la.eigenvectors * vectors[:, :4]).sum(0).abs()
    torch.testing.assert_close(overlap, torch.ones(4, dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_ef_evidence_and_predictive_equal_full_laplace_ef_at_full_rank(likelihood):
    # EF rank <= N = 6 < k = 8: the prior-complement posterior is FullLaplace's
    model, X, y = problem(likelihood)
    la = fit(likelihood, CurvlinopsEF, k=8, complement="prior")
    full = Laplace(model, likelihood, "all", "full", backend=CurvlinopsEF, prior_precision=TAU)
    full.fit(loader(X, y, batch_size=4))
    torch.testing.assert_close(
        la.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-6, atol=0
    )
    # laplace-torch's H carries float32 round-off (it is ``linop @ eye`` with a float32
    # identity); with H replaced by the exact dense EF the posterior is laplace-torch's
    # algebra on the exact matrix
    full.H = dense_matrix("ef", likelihood)
    torch.testing.assert_close(
        la.posterior_covariance.to_dense(), full.posterior_covariance, rtol=1e-6, atol=1e-10
    )
    torch.testing.assert_close(
        la.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-9, atol=0
    )
    Xtest = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if likelihood == "regression":
        for got, want in zip(la(Xtest), full(Xtest, pred_type="glm")):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    ("backend", "reference", "kind"),
    [
        (BackPackGGN, CurvlinopsGGN, "ggn"),
        (AsdlGGN, CurvlinopsGGN, "ggn"),
        (BackPackEF, CurvlinopsEF, "ef"),
        (AsdlEF, CurvlinopsEF, "ef"),
        (AsdlHessian, CurvlinopsHessian, "hessian"),
    ],
)
def test_backpack_and_asdl_classes_map_to_curvlinops_with_a_warning(backend, reference, kind):
    with pytest.warns(UserWarning, match=rf"backend {backend.__name__}.*curvlinops"):
        choice = resolve_backend(backend)
    assert choice.kind == kind and choice.backend == backend.__name__
    with pytest.warns(UserWarning, match=backend.__name__):
        la = fit("regression", backend, k=3, solver="lanczos")
    ref = fit("regression", reference, k=3, solver="lanczos")
    torch.testing.assert_close(la.H[1], ref.H[1], rtol=1e-10, atol=0)


def test_default_and_ggn_backends_keep_the_fast_paths():
    assert resolve_backend(None).kind == "ggn" and resolve_backend(None).factorable
    assert resolve_backend(CurvlinopsGGN).factorable
    assert not resolve_backend(CurvlinopsEF).factorable
    la = fit("regression", CurvlinopsGGN, k=3)
    assert la.lanczos_info.operator == "factored"


def test_factored_solver_request_with_ef_warns_and_uses_lanczos():
    with pytest.warns(UserWarning, match=r"solver='dual' needs the factored GGN"):
        model, X, y = problem("regression")
        la = ActiveSubspaceLaplace(
            model, "regression", backend=CurvlinopsEF, n_components=3, solver="dual"
        )
        la.fit(loader(X, y, batch_size=4))
    assert la.lanczos_info.solver == "lanczos"


class MyCurvature(CurvatureInterface):
    pass


def test_unknown_and_stochastic_backends_are_refused_by_name():
    with pytest.raises(ValueError, match=r"MyCurvature has no matrix-free operator"):
        ActiveSubspaceLaplace(mlp([1, 4, 1]), "regression", backend=MyCurvature, n_components=2)
    with pytest.raises(ValueError, match=r"CurvlinopsGGN with stochastic=True"):
        ActiveSubspaceLaplace(
            mlp([1, 4, 1]),
            "regression",
            backend=CurvlinopsGGN,
            backend_kwargs={"stochastic": True},
            n_components=2,
        )
    with pytest.raises(ValueError, match=r"curvature backend 'ggn' is not a class"):
        Laplace(mlp([1, 4, 1]), "regression", "all", "glas", n_components=2, backend="ggn")


def test_ef_refuses_sequence_outputs():
    class Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)

        def forward(self, x):
            return self.lin(x)  # (batch, seq_len, 3)

    X = torch.randn(4, 5, 2)
    y = torch.randint(0, 3, (4, 5))
    la = ActiveSubspaceLaplace(Seq(), "classification", backend=CurvlinopsEF, n_components=2)
    with pytest.raises(ValueError, match=r"empirical Fisher backend needs classification"):
        la.fit(loader(X, y, batch_size=2))


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_ef_on_the_last_layer_and_a_subnetwork_equals_laplace_torch(likelihood):
    from laplace.lllaplace import FullLLLaplace
    from laplace.subnetlaplace import FullSubnetLaplace

    from laplace_glas import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

    model, X, y = problem(likelihood)
    dl = loader(X, y, batch_size=4)
    indices = torch.tensor([0, 3, 7, 12, 15, 20, 21])  # D_S = 7, EF rank <= 6
    common = {"backend": CurvlinopsEF, "prior_precision": TAU}
    glas_kwargs = {"complement": "prior", "loss_scaling": "sum", **common}
    pairs = [
        (
            LastLayerActiveSubspaceLaplace(model, likelihood, n_components=7, **glas_kwargs),
            FullLLLaplace(model, likelihood, **common),
        ),
        (
            SubnetActiveSubspaceLaplace(model, likelihood, indices, n_components=6, **glas_kwargs),
            FullSubnetLaplace(model, likelihood, indices, **common),
        ),
    ]
    for glas, full in pairs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            glas.fit(dl)
        full.fit(dl)
        assert glas.lanczos_info.operator.startswith("curvlinops EF")
        torch.testing.assert_close(
            glas.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-6, atol=0
        )


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize(("backend", "kind"), [(GGNInterface, "ggn"), (EFInterface, "ef")])
def test_generic_interfaces_map_to_their_matrix_and_equal_full_laplace(likelihood, backend, kind):
    # laplace-torch's generic classes compute the dense matrix with torch.func (no
    # curvlinops): FullLaplace's H is an independent reference, EF's regression factor
    # included
    with pytest.warns(UserWarning, match=rf"backend {backend.__name__}.*curvlinops"):
        choice = resolve_backend(backend)
    assert choice.kind == kind and choice.backend == backend.__name__
    model, X, y = problem(likelihood)
    full = Laplace(model, likelihood, "all", "full", backend=backend, prior_precision=TAU)
    full.fit(loader(X, y, batch_size=4))
    if kind == "ef":  # laplace-torch's regression factor: 2 EF(0.5 ||f - y||^2)
        torch.testing.assert_close(full.H, dense_matrix(kind, likelihood), rtol=1e-9, atol=1e-12)
    values = torch.linalg.eigvalsh(full.H).flip(0)
    la = fit(likelihood, backend, k=4, solver="lanczos")
    assert la.curvature.kind == kind and la.curvature.backend == backend.__name__
    torch.testing.assert_close(la.H[1], values[:4], rtol=1e-8, atol=1e-10 * values[0])
    # rank <= N C < k = D - 1: the prior-complement posterior is FullLaplace's
    la = fit(likelihood, backend, k=model_size(model) - 1, complement="prior")
    torch.testing.assert_close(
        la.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-7, atol=0
    )


def model_size(model):
    return sum(p.numel() for p in model.parameters())


class MyGGN(GGNInterface):
    pass


class MyEF(EFInterface):
    pass


def test_generic_subclasses_map_and_a_stochastic_generic_ggn_is_refused():
    with pytest.warns(UserWarning, match=r"backend MyGGN.*GGNLinearOperator.*MyGGN"):
        assert resolve_backend(MyGGN).kind == "ggn"
    with pytest.warns(UserWarning, match=r"backend MyEF.*EFLinearOperator"):
        assert resolve_backend(MyEF).kind == "ef"
    with pytest.raises(ValueError, match=r"GGNInterface with stochastic=True"):
        resolve_backend(GGNInterface, {"stochastic": True})


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_generic_interfaces_on_the_last_layer_and_a_subnetwork_equal_laplace_torch(likelihood):
    from laplace.lllaplace import FullLLLaplace
    from laplace.subnetlaplace import FullSubnetLaplace

    from laplace_glas import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

    model, X, y = problem(likelihood)
    dl = loader(X, y, batch_size=4)
    indices = torch.tensor([0, 3, 7, 12, 15, 20, 21])  # D_S = 7, EF rank <= 6
    glas_kwargs = {"complement": "prior", "loss_scaling": "sum", "prior_precision": TAU}
    # the last layer's GGN (D_LL = 10 or 15, full rank): the top eigenvalues
    glas = LastLayerActiveSubspaceLaplace(
        model, likelihood, n_components=4, backend=GGNInterface, solver="lanczos", **glas_kwargs
    )
    full = FullLLLaplace(model, likelihood, backend=GGNInterface, prior_precision=TAU)
    # laplace-torch's generic EFInterface gives a zero last-layer EF (its per-example
    # gradients do not reach the last layer's weights): CurvlinopsEF is the reference
    glas_ef = LastLayerActiveSubspaceLaplace(
        model, likelihood, n_components=7, backend=EFInterface, **glas_kwargs
    )
    full_ef = FullLLLaplace(model, likelihood, backend=CurvlinopsEF, prior_precision=TAU)
    sub = SubnetActiveSubspaceLaplace(
        model, likelihood, indices, n_components=6, backend=EFInterface, **glas_kwargs
    )
    full_sub = FullSubnetLaplace(
        model, likelihood, indices, backend=EFInterface, prior_precision=TAU
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for la in (glas, full, glas_ef, full_ef, sub, full_sub):
            la.fit(dl)
    values = torch.linalg.eigvalsh(full.H).flip(0)
    torch.testing.assert_close(glas.H[1], values[:4], rtol=1e-6, atol=1e-9 * values[0])
    for got, want in ((glas_ef, full_ef), (sub, full_sub)):
        assert got.curvature.kind == "ef"
        torch.testing.assert_close(
            got.log_marginal_likelihood(), want.log_marginal_likelihood(), rtol=1e-6, atol=0
        )
