"""The posterior-averaged output Hessian against closed forms: the softmax Hessian at zero
variance, a binary expectation by Gauss-Hermite quadrature, and the GGN it weights
against ``sum_n J_n^T tilde Lambda_n J_n`` from reverse-mode Jacobians.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import Gained, mlp, mlp_problem, output_jacobian

from laplace_glas.curvature.data.output_hessian import (
    PosteriorAveragedHessian,
    mean_softmax_hessian,
    softmax_hessian,
)
from laplace_glas.curvature.operators.factored import build_factored_ggn
from laplace_glas.curvature.operators.factors import row_vectors
from laplace_glas.curvature.operators.stored_jacobian import build_jacobian_ggn
from laplace_glas.curvature.operators.streamed import StreamedFactoredGGN


def _constant(V: torch.Tensor):
    """A logit covariance that is ``V`` for every batch (of ``V``'s size)."""
    return lambda x: V


def test_mean_softmax_hessian_is_the_mean_of_the_draws_hessians():
    g = torch.Generator().manual_seed(11)
    p = torch.randn(16, 3, 5, generator=g, dtype=torch.float64).softmax(-1)  # (S, B, C)
    expected = torch.stack([softmax_hessian(draw) for draw in p]).mean(0)
    torch.testing.assert_close(mean_softmax_hessian(p), expected)


def test_at_zero_variance_it_is_the_softmax_hessian_at_the_outputs():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(5, 4, generator=g, dtype=torch.float64) * 3
    hessian = PosteriorAveragedHessian([_constant(torch.zeros(5, 4, 4, dtype=out.dtype))], [1.0])
    torch.testing.assert_close(hessian.matrices(None, out), softmax_hessian(out.softmax(-1)))
    # and its rows are a square root of it with the MAP's row count (C - 1)
    y = torch.tensor([0, 1, 2, -100, 3])
    rows = hessian.rows(None, out, y, ignore_index=-100, scale=0.5)
    map_rows = row_vectors(out, y, "classification", -100, 0.5)
    assert rows.shape == map_rows.shape == (3, 5, 4)
    ours = torch.einsum("rbc,rbd->bcd", rows, rows)
    torch.testing.assert_close(ours, torch.einsum("rbc,rbd->bcd", map_rows, map_rows))
    assert torch.all(ours[3] == 0)  # the ignored target


def test_binary_average_matches_gauss_hermite_quadrature():
    """C = 2: ``tilde Lambda = E[s(z)(1 - s(z))] [[1, -1], [-1, 1]]`` with ``z = f_1 - f_2 ~
    N(m, v_11 + v_22 - 2 v_12)``; 100 quadrature nodes against 40,000 draws."""
    out = torch.tensor([[1.5, -0.5], [0.0, 0.3]], dtype=torch.float64)
    V = torch.tensor([[[2.0, 0.5], [0.5, 1.0]], [[0.3, 0.0], [0.0, 0.7]]], dtype=torch.float64)
    hessian = PosteriorAveragedHessian([_constant(V)], [1.0], n_draws=40_000, seed=3)
    ours = hessian.matrices(None, out)
    nodes, weights = np.polynomial.hermite_e.hermegauss(100)
    for n in range(2):
        m = float(out[n, 0] - out[n, 1])
        s = math.sqrt(float(V[n, 0, 0] + V[n, 1, 1] - 2 * V[n, 0, 1]))
        sig = 1 / (1 + np.exp(-(m + s * nodes)))
        expected = float((weights * sig * (1 - sig)).sum() / math.sqrt(2 * math.pi))
        reference = expected * torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=out.dtype)
        torch.testing.assert_close(ours[n], reference, atol=2e-3, rtol=0)
    # the draws spread a confident mean's logits towards the boundary: more curvature
    # than the softmax Hessian at the mean
    assert ours[0, 0, 0] > softmax_hessian(out.softmax(-1))[0, 0, 0]


def test_the_null_direction_of_the_softmax_is_kept():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(6, 5, generator=g, dtype=torch.float64)
    A = torch.randn(6, 5, 5, generator=g, dtype=torch.float64)
    hessian = PosteriorAveragedHessian([_constant(A @ A.mT)], [1.0], n_draws=64)
    Lam = hessian.matrices(None, out)
    torch.testing.assert_close(Lam @ torch.ones(5, dtype=out.dtype), torch.zeros(6, 5).double())
    assert torch.linalg.eigvalsh(Lam).min() > -1e-12


def test_a_mixture_is_the_weighted_sum_with_the_same_draws():
    g = torch.Generator().manual_seed(2)
    out = torch.randn(4, 3, generator=g, dtype=torch.float64)
    V1, V2 = (torch.eye(3, dtype=out.dtype).expand(4, 3, 3) * s for s in (0.5, 4.0))
    mixed = PosteriorAveragedHessian([_constant(V1), _constant(V2)], [0.25, 0.75], 32, seed=5)
    one = PosteriorAveragedHessian([_constant(V1)], [1.0], 32, seed=5).matrices(None, out)
    two = PosteriorAveragedHessian([_constant(V2)], [1.0], 32, seed=5).matrices(None, out)
    torch.testing.assert_close(mixed.matrices(None, out), 0.25 * one + 0.75 * two)


def test_the_draws_are_antithetic_and_fixed_per_seed():
    a = PosteriorAveragedHessian([_constant(None)], [1.0], n_draws=8, seed=4)
    eps = a.draws(3, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(eps[:4], -eps[4:])
    torch.testing.assert_close(eps, a.draws(3, torch.float64, torch.device("cpu")))
    b = PosteriorAveragedHessian([_constant(None)], [1.0], n_draws=8, seed=4)
    torch.testing.assert_close(eps, b.draws(3, torch.float64, torch.device("cpu")))


@pytest.mark.parametrize(
    ("covariances", "weights", "n_draws", "match"),
    [
        ([], [], 8, "One weight per covariance"),
        ([_constant(None)], [0.5, 0.5], 8, "One weight per covariance"),
        ([_constant(None)] * 2, [1.5, -0.5], 8, "sum to 1"),
        ([_constant(None)], [0.9], 8, "sum to 1"),
        ([_constant(None)], [1.0], 7, "even"),
        ([_constant(None)], [1.0], 0, "even int >= 2"),
    ],
)
def test_bad_settings_are_refused(covariances, weights, n_draws, match):
    with pytest.raises(ValueError, match=match):
        PosteriorAveragedHessian(covariances, weights, n_draws=n_draws)


def test_a_covariance_of_the_wrong_shape_is_refused():
    hessian = PosteriorAveragedHessian([_constant(torch.zeros(3, 2, 2))], [1.0])
    with pytest.raises(ValueError, match=r"expected \(3, 4, 4\)"):
        hessian.matrices(None, torch.zeros(3, 4))
    with pytest.raises(NotImplementedError, match="sequence outputs"):
        hessian.matrices(None, torch.zeros(3, 5, 4))


def test_the_factored_operators_take_it_against_reverse_mode_jacobians():
    """The factored GGN and the streamed factors, each with the averaged Hessian, against
    ``(1/N) sum_n J_n^T tilde Lambda_n J_n`` (jacrev)."""
    model = mlp([3, 7, 4], dtype=torch.float64, seed=3)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (30,), generator=g)
    _, _, problem = mlp_problem()
    data = [(X[i : i + 10], y[i : i + 10]) for i in range(0, 30, 10)]

    def covariance(x):  # depends on the example: a check that batches are not mixed up
        return (0.2 + x[:, :1, None].abs()) * torch.eye(4, dtype=x.dtype) + 0.05

    hessian = PosteriorAveragedHessian([covariance], [1.0], n_draws=16, seed=7)
    problem = dataclasses.replace(
        problem,
        model=model,
        params=tuple(model.parameters()),
        loader=data,
        likelihood="classification",
        n_terms=30,
        output_hessian=hessian,
        dtype=torch.float64,
    )
    out, J = output_jacobian(model, X)
    Lam = hessian.matrices(X, out)
    G = torch.einsum("nci,ncd,ndj->ij", J, Lam, J) / 30
    V = torch.randn(G.shape[0], 3, generator=g, dtype=G.dtype)
    operators = {
        "factored": build_factored_ggn(**problem.batch_arguments()),
        "streamed": StreamedFactoredGGN(**problem.batch_arguments(), dtype=torch.float64),
    }
    for name, operator in operators.items():
        assert not isinstance(operator, str), (name, operator)
        torch.testing.assert_close(operator.matmat_torch(V), G @ V, rtol=1e-10, atol=1e-12)


def test_the_jacobians_of_torch_func_take_it_against_reverse_mode():
    model = Gained([3, 5, 4], [1.5, 0.5, 1.0, 2.0], seed=4).eval()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(20, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (20,), generator=g)
    data = [(X[:12], y[:12]), (X[12:], y[12:])]
    hessian = PosteriorAveragedHessian(
        [lambda x: (0.1 + x[:, :1, None] ** 2) * torch.eye(4, dtype=x.dtype)], [1.0], 16
    )
    operator = build_jacobian_ggn(
        model, list(model.parameters()), data, "classification", 20, output_hessian=hessian
    )
    assert not isinstance(operator, str), operator
    out, J = output_jacobian(model, X)
    G = torch.einsum("nci,ncd,ndj->ij", J, hessian.matrices(X, out), J) / 20
    V = torch.randn(G.shape[0], 2, generator=g, dtype=G.dtype)
    torch.testing.assert_close(operator.matmat_torch(V), G @ V, rtol=1e-10, atol=1e-12)
