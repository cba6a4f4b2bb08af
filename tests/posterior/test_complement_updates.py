"""fit(override=False) adds the complement's curvature: KFAC's factors of the union (A by
the counts, B summed), the GGN diagonal summed; equal to one fit on all of the data."""

from __future__ import annotations

import pytest
import torch
from conftest import loader, regression_data, train
from laplace import Laplace
from laplace.utils.matrix import Kron
from torch import nn

import laplace_glas  # noqa: F401
from laplace_glas.curvature.complement.kfac_layers import union_of_factors

DOUBLE = torch.float64


def _model(norm: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(2, 6)] + ([nn.LayerNorm(6)] if norm else []) + [nn.Tanh(), nn.Linear(6, 1)]
    return nn.Sequential(*layers).to(DOUBLE)


def _glas(model: nn.Module, **kwargs) -> Laplace:
    return Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                   n_components=2, sigma_noise=0.2, prior_precision=0.5, **kwargs)  # fmt: skip


@pytest.mark.parametrize(("norm", "resolved"), [(False, "kron"), (True, "kron_diag")])
def test_an_update_equals_one_fit_on_the_union(norm, resolved):
    X, y = regression_data(n=72, dtype=DOUBLE, seed=1, d_in=2)
    model = train(_model(norm), X, y, steps=100)
    first, second = loader(X[:40], y[:40], batch_size=20), loader(X[40:], y[40:], batch_size=16)
    updated = _glas(model)
    updated.fit(first)
    updated.fit(second, override=False)
    whole = _glas(model)
    whole.fit(loader(X, y, batch_size=8))
    assert updated.complement == whole.complement == resolved
    assert updated.n_data == whole.n_data == 72
    for got, want in zip(updated._ggn_kron.kfacs, whole._ggn_kron.kfacs):
        assert len(got) == len(want)
        for F, G in zip(got, want):
            torch.testing.assert_close(F, G)
    if resolved == "kron_diag":
        torch.testing.assert_close(updated._ggn_diagonal, whole._ggn_diagonal)


def test_an_explicit_diag_update_adds_the_diagonals():
    X, y = regression_data(n=48, dtype=DOUBLE, seed=2, d_in=2)
    model = train(_model(True), X, y, steps=80)
    updated = _glas(model, complement="diag")
    updated.fit(loader(X[:20], y[:20]))
    updated.fit(loader(X[20:], y[20:]), override=False)
    whole = _glas(model, complement="diag")
    whole.fit(loader(X, y))
    torch.testing.assert_close(updated._ggn_diagonal, whole._ggn_diagonal)


def test_an_update_with_another_complement_is_refused_by_name():
    X, y = regression_data(n=40, dtype=DOUBLE, seed=3, d_in=2)
    model = train(_model(False), X, y, steps=50)
    la = _glas(model, complement="diag")
    la.fit(loader(X[:20], y[:20]))
    la.complement = "kron"
    with pytest.raises(ValueError, match="stored fit's curvature, which is 'diag'"):
        la.fit(loader(X[20:], y[20:]), override=False)


def test_the_union_of_factors_weights_a_by_the_counts():
    g = torch.Generator().manual_seed(0)
    B1, A1, B2, A2, b1, b2 = (torch.rand(2, 2, generator=g, dtype=DOUBLE) for _ in range(6))
    union = union_of_factors(Kron([[B1, A1], [b1], []]), 3, Kron([[B2, A2], [b2], []]), 1)
    torch.testing.assert_close(union.kfacs[0][0], B1 + B2)
    torch.testing.assert_close(union.kfacs[0][1], (3 * A1 + A2) / 4)
    torch.testing.assert_close(union.kfacs[1][0], b1 + b2)
    assert union.kfacs[2] == []
    with pytest.raises(ValueError, match="do not match"):
        union_of_factors(Kron([[B1, A1]]), 3, Kron([[B2]]), 1)
