"""Forward-mode J V, batched weight samples and J J^T against explicit Jacobians."""

from __future__ import annotations

import pytest
import torch
from conftest import explicit_jacobian, mlp
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from laplace_glas.predictive.jvp import (
    batched_outputs,
    jacobian_gram,
    jvp_directions,
    parameter_names,
)


def setup(d_in=3, d_out=2):
    model = mlp([d_in, 7, d_out], dtype=torch.float64)
    params = list(model.parameters())
    names = parameter_names(model, params)
    shapes = [p.shape for p in params]
    theta = parameters_to_vector(params).detach()
    X = torch.randn(5, d_in, dtype=torch.float64)
    return model, names, shapes, theta, X


def test_jvp_directions_equal_explicit_jacobian_product():
    model, names, shapes, theta, X = setup()
    V = torch.randn(theta.numel(), 4, dtype=torch.float64)
    f, JV = jvp_directions(model, names, shapes, theta, X, V, chunk_size=3)
    J = explicit_jacobian(model, X).reshape(5, 2, -1)
    torch.testing.assert_close(f, model(X).detach())
    torch.testing.assert_close(JV, J @ V)


def test_jvp_respects_frozen_parameters():
    model, *_ = setup()
    model[0].weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    names = parameter_names(model, params)
    shapes = [p.shape for p in params]
    theta = parameters_to_vector(params).detach()
    X = torch.randn(4, 3, dtype=torch.float64)
    V = torch.randn(theta.numel(), 2, dtype=torch.float64)
    _, JV = jvp_directions(model, names, shapes, theta, X, V)
    full = explicit_jacobian(model, X).reshape(4, 2, -1)
    n_frozen = model[0].weight.numel()
    torch.testing.assert_close(JV, full[..., n_frozen:] @ V)


def test_batched_outputs_equal_loop_and_leave_module_untouched():
    model, names, shapes, theta, X = setup()
    thetas = theta + 0.1 * torch.randn(6, theta.numel(), dtype=torch.float64)
    out = batched_outputs(model, names, shapes, thetas, X)
    before = parameters_to_vector(model.parameters()).clone()
    ref = []
    clone = mlp([3, 7, 2], dtype=torch.float64)
    for t in thetas:
        vector_to_parameters(t, clone.parameters())
        ref.append(clone(X).detach())
    torch.testing.assert_close(out, torch.stack(ref))
    assert torch.equal(parameters_to_vector(model.parameters()), before)


def test_batched_outputs_fall_back_for_modules_without_batching_rule():
    class Looping(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2).double()

        def forward(self, x):
            out = self.lin(x)
            return out.clone().numpy().sum() * 0 + out  # .numpy() breaks vmap

    model = Looping()
    params = list(model.parameters())
    names, shapes = parameter_names(model, params), [p.shape for p in params]
    theta = parameters_to_vector(params).detach()
    thetas = theta + torch.randn(3, theta.numel(), dtype=torch.float64)
    X = torch.randn(4, 3, dtype=torch.float64)
    out = batched_outputs(model, names, shapes, thetas, X)
    W = thetas[:, :6].reshape(3, 2, 3)
    b = thetas[:, 6:]
    torch.testing.assert_close(out, X @ W.transpose(1, 2) + b[:, None, :])


def test_jacobian_gram_matches_explicit():
    model, names, shapes, theta, X = setup()
    J = explicit_jacobian(model, X).reshape(5, 2, -1)
    gram = jacobian_gram(model, names, shapes, theta, X, chunk_size=2)
    torch.testing.assert_close(gram, J @ J.transpose(1, 2))
    joint = jacobian_gram(model, names, shapes, theta, X, joint=True)
    Jf = J.reshape(10, -1)
    torch.testing.assert_close(joint, Jf @ Jf.T)


def test_a_callers_error_does_not_mark_the_model_as_unbatchable():
    """A wrong input makes vmap and the loop fail alike: the error reaches the caller and
    the model keeps the vectorised path (it used to be sent to the loop for good)."""
    from laplace_glas.predictive.jvp import _NO_BATCHING_RULE

    model, names, shapes, theta, X = setup()
    thetas = theta + torch.zeros(2, theta.numel(), dtype=theta.dtype)
    with pytest.raises(RuntimeError):
        batched_outputs(model, names, shapes, thetas, X[:, :1])  # wrong feature size
    assert model not in _NO_BATCHING_RULE
    batched_outputs(model, names, shapes, thetas, X)
    assert model not in _NO_BATCHING_RULE
