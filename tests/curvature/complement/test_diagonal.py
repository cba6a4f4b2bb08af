"""BackPACK's copy of the network in the GGN diagonal's pass is released whole; a model
BackPACK refuses gets the same exact diagonal from the per-example pass."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from backpack.context import CTX
from torch import nn

from laplace_glas.curvature.complement import diagonal


class _GRURegressor(nn.Module):
    """A recurrent layer BackPACK's exact GGN diagonal does not cover."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def _copies_seen(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every module of each copy the pass makes."""
    seen, deepcopy = [], diagonal.copy.deepcopy

    def recording_deepcopy(obj, *args, **kwargs):
        copied = deepcopy(obj, *args, **kwargs)
        seen.extend(weakref.ref(module) for module in copied.modules())
        return copied

    monkeypatch.setattr(diagonal.copy, "deepcopy", recording_deepcopy)
    return seen


def _loader(model_input_shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    X, y = torch.randn(32, *model_input_shape, generator=gen), torch.randn(32, 1, generator=gen)
    return [(X[:16], y[:16]), (X[16:], y[16:])]


def _explicit_diagonal(model, loader):
    """``sum_n J_n^T J_n``'s diagonal from ``jacrev`` (regression, one output)."""
    X = torch.cat([X for X, _ in loader])
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    J = torch.cat([j.reshape(X.shape[0], -1) for j in jac.values()], dim=1)  # (N, D), C = 1
    return J.square().sum(0)


def test_a_refused_model_leaves_no_copy_and_no_hook_handles(monkeypatch):
    seen = _copies_seen(monkeypatch)
    handles = len(CTX.hook_handles)
    for _ in range(2):
        torch.manual_seed(0)
        model = _GRURegressor().double()
        loader = [(X.double(), y.double()) for X, y in _loader((5, 3))]
        result = diagonal.ggn_diagonal(model, loader, "regression")  # BackPACK refuses GRU
        torch.testing.assert_close(result, _explicit_diagonal(model, loader))
    gc.collect()
    assert seen and all(ref() is None for ref in seen)  # the GRU's copy outlived the fit
    assert len(CTX.hook_handles) == handles


def test_a_covered_model_leaves_no_copy_and_equals_the_explicit_diagonal(monkeypatch):
    seen = _copies_seen(monkeypatch)
    handles = len(CTX.hook_handles)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    loader = [(X.double(), y.double()) for X, y in _loader((3,))]
    result = diagonal.ggn_diagonal(model, loader, "regression")
    torch.testing.assert_close(result, _explicit_diagonal(model, loader))
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    assert len(CTX.hook_handles) == handles
    assert not any(hasattr(m, "output") for m in model.modules())  # the original untouched
