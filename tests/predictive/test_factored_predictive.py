"""The 'glm' predictive's ``J(x) U`` from the factored Jacobian against forward mode."""

from __future__ import annotations

import pytest
import torch
from conftest import loader, output_jacobian
from curvature.operators.test_factored import MODELS, MixesExamples, Recurrent, as64, problem

from laplace_glas import ActiveSubspaceLaplace
from laplace_glas.curvature.operators.factored import (
    factored_jacobian,
    factored_jacobian_directions,
)
from laplace_glas.predictive.jvp import jvp_directions

F64 = torch.float64


@pytest.mark.parametrize("name", MODELS)
def test_factored_jacobian_directions_equal_forward_mode(name):
    model, X, _ = as64(*problem(name)[:3])
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in params]
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    V = torch.randn(theta.numel(), 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    f, JV = factored_jacobian_directions(model, params, X, V)
    f_ref, JV_ref = jvp_directions(model, names, shapes, theta, X, V)
    torch.testing.assert_close(f, f_ref.detach())
    assert JV.shape == JV_ref.shape == (*f_ref.shape, 4)
    torch.testing.assert_close(JV, JV_ref.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_factored_jacobian_equals_reverse_mode(name):
    model, X, _ = as64(*problem(name)[:3])
    f, J = factored_jacobian(model, list(model.parameters()), X)
    f_ref, J_ref = output_jacobian(model, X)  # torch.func.jacrev
    torch.testing.assert_close(f, f_ref)
    assert J.shape == (*f_ref.shape, J_ref.shape[-1])
    torch.testing.assert_close(J.reshape(J_ref.shape), J_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp-regression", "mlp-classification", "token-classification"])
@pytest.mark.parametrize("complement", ["zero", "prior", "auto"])
def test_glm_predictive_uses_the_factors_and_matches_the_jvp_path(name, complement):
    model, X, y, likelihood = problem(name)
    model, X, y = as64(model, X, y)
    la = ActiveSubspaceLaplace(model, likelihood, n_components=4, complement=complement)
    la.fit(loader(X, y, 8))
    f, var = la._glm_predictive_distribution(X[:5])
    assert la.jacobian_path == "factored"
    la.enable_backprop = True  # forces the forward-mode path
    f_ref, var_ref = la._glm_predictive_distribution(X[:5])
    assert la.jacobian_path == "jvp (enable_backprop)"
    torch.testing.assert_close(f, f_ref.detach())
    torch.testing.assert_close(var, var_ref.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "make, reason", [(Recurrent, "LSTM parameters"), (MixesExamples, "differs from forward mode")]
)
def test_models_that_do_not_factor_fall_back_to_jvps(make, reason):
    torch.manual_seed(0)
    model = make().to(F64).eval()
    X = torch.randn(10, 4, 3, dtype=F64) if make is Recurrent else torch.randn(10, 3, dtype=F64)
    y = model(X).detach() + 0.1
    la = ActiveSubspaceLaplace(model, "regression", n_components=3)
    la.fit(loader(X, y, 5))
    la(X[:4])
    assert la.jacobian_path.startswith("jvp (") and reason in la.jacobian_path


def test_changed_weights_use_the_fitted_ones_by_forward_mode():
    model, X, y, likelihood = problem("mlp-regression")
    model, X, y = as64(model, X, y)
    la = ActiveSubspaceLaplace(model, likelihood, n_components=3)
    la.fit(loader(X, y, 8))
    before = la(X[:4])
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.warns(UserWarning, match="differ from those GLAS was fitted at"):
        after = la(X[:4])
    assert la.jacobian_path == "jvp (the model's weights differ from la.mean)"
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["mlp-classification", "mlp-regression"])
def test_output_jacobians_are_reverse_modes_by_either_route(name):
    """``la.output_jacobians``: from the factors, and by reverse mode where they do not
    apply, against jacrev; ``functional_variance`` of them is the 'glm' covariance."""
    model, X, y, likelihood = problem(name)
    model, X, y = as64(model, X, y)
    la = ActiveSubspaceLaplace(model, likelihood, n_components=3)
    la.fit(loader(X, y, 8))
    _, J_ref = output_jacobian(model, X[:5])
    torch.testing.assert_close(la.output_jacobians(X[:5]), J_ref, rtol=1e-10, atol=1e-12)
    _, f_var = la._glm_predictive_distribution(X[:5])
    torch.testing.assert_close(la.functional_variance(la.output_jacobians(X[:5])), f_var)
    la._factored_jacobian = lambda *args, **kwargs: None  # the reverse-mode route
    torch.testing.assert_close(la.output_jacobians(X[:5]), J_ref, rtol=1e-10, atol=1e-12)
