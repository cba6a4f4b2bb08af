"""curvlinops' operators of a loss on data: ``LossOnData`` and the operator's kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import explicit_jacobian, loader
from torch import nn

from laplace_glas.curvature.operators.curvlinops import (
    LossOnData,
    curvlinops_operator,
    mean_ggn_operator,
)

F64 = torch.float64


def _loss() -> tuple[LossOnData, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    X, y = torch.randn(10, 3, dtype=F64), torch.randn(10, 2, dtype=F64)
    params = list(model.parameters())
    return LossOnData(model, nn.MSELoss(), params, loader(X, y, 4), 10), X


def test_the_ggn_of_the_mean_squared_error_is_the_explicit_one():
    """MSELoss (mean) over N points and C = 2 outputs: G = 2 / (N C) sum_n J_n^T J_n,
    by the record and by mean_ggn_operator's positional arguments (progress_bar last)."""
    loss, X = _loss()
    J = explicit_jacobian(loss.model, X)  # (N C, D), by jacrev
    G = 2 * J.T @ J / J.shape[0]
    V = torch.randn(G.shape[0], 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    fields = [getattr(loss, field.name) for field in dataclasses.fields(loss)]
    for operator in (curvlinops_operator("ggn", loss), mean_ggn_operator(*fields, False)):
        torch.testing.assert_close(torch.as_tensor(operator @ V), G @ V)


def test_an_unknown_kind_and_a_loss_without_reduction_are_refused_by_name():
    loss, _ = _loss()
    with pytest.raises(ValueError, match=r"kind must be one of \['ef', 'ggn', 'hessian'\]"):
        curvlinops_operator("GGN", loss)
    plain = dataclasses.replace(loss, loss_func=lambda f, y: (f - y).square().sum())
    with pytest.raises(ValueError, match="needs a `reduction` attribute"):
        curvlinops_operator("ggn", plain)


def test_the_record_is_hashable_by_identity():
    loss, _ = _loss()
    assert len({loss, loss}) == 1
    assert loss != dataclasses.replace(loss)
