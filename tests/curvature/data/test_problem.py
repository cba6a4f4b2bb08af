"""CurvatureProblem's argument bundles against the problem's own fields and an
independent GGN.
"""

from __future__ import annotations

import torch
from conftest import explicit_jacobian, mlp_problem

from laplace_glas.curvature.operators.factored import build_factored_ggn
from laplace_glas.curvature.operators.streamed import StreamedFactoredGGN


def test_batch_arguments_name_the_problems_fields():
    _, _, problem = mlp_problem()
    arguments = problem.batch_arguments()
    assert set(arguments) == {
        "model", "params", "loader", "likelihood", "n_terms",
        "ignore_index", "dict_key_x", "dict_key_y", "device", "output_hessian",
    }  # fmt: skip
    for name, value in arguments.items():
        assert value is getattr(problem, name)


def test_operators_built_from_the_batch_arguments_are_the_mean_loss_ggn():
    model, data, problem = mlp_problem(n=48, batch=16)
    X = torch.cat([x for x, _ in data])
    J = explicit_jacobian(model, X)  # (N C, D) by reverse mode
    G = J.T @ J / X.shape[0]  # unit-noise mean-loss GGN of the regression
    V = torch.randn(G.shape[0], 3, generator=torch.Generator().manual_seed(1), dtype=G.dtype)
    factored = build_factored_ggn(**problem.batch_arguments())
    streamed = StreamedFactoredGGN(**problem.batch_arguments(), dtype=problem.dtype)
    for operator in (factored, streamed):
        torch.testing.assert_close(operator.matmat_torch(V), G @ V, rtol=1e-10, atol=1e-12)
