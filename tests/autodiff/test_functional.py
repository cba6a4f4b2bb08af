"""module_call: torch.func.functional_call that leaves a model calling one module twice
as it was, and a fit on such a model against an explicitly formed GGN."""

from __future__ import annotations

import torch
from conftest import loader, regression_data, train
from laplace import Laplace
from torch import nn
from torch.func import functional_call, vmap

import laplace_glas  # noqa: F401
from laplace_glas.autodiff.functional import module_call

DOUBLE = torch.float64


def _reused(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    shared = nn.Linear(3, 3)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(),
                         nn.Linear(3, 1)).to(DOUBLE)  # fmt: skip


def _slots(model: nn.Module) -> list[tuple[type, torch.Tensor]]:
    return [(type(p), p) for m in model.modules() for p in m._parameters.values()]


def test_torch_functional_call_damages_a_reused_module_and_module_call_does_not():
    """The reference fault (torch's swap-back restores the tied alias twice), and the
    same call through module_call: the same output, every slot its own Parameter."""
    x = torch.randn(4, 2, dtype=DOUBLE)
    substituted = {n: p.detach() + 0.1 for n, p in _reused().named_parameters()}
    damaged = _reused()
    functional_call(damaged, substituted, (x,))
    assert any(kind is not nn.Parameter for kind, _ in _slots(damaged))

    model = _reused()
    before = _slots(model)
    out = module_call(model, substituted, (x,))
    assert [(k, id(p)) for k, p in _slots(model)] == [(k, id(p)) for k, p in before]
    expected = _reused()
    with torch.no_grad():
        for p in expected.parameters():
            p.add_(0.1)
    torch.testing.assert_close(out, expected(x))
    # under vmap (the functorch wrappers were what a later transform choked on)
    outs = vmap(lambda xi: module_call(model, substituted, (xi[None],)))(x)
    torch.testing.assert_close(outs.reshape(out.shape), out)
    assert all(kind is nn.Parameter for kind, _ in _slots(model))


def test_a_fit_on_a_model_calling_one_module_twice_is_exact_and_leaves_it_intact():
    X, y = regression_data(n=40, dtype=DOUBLE, seed=3, d_in=2)
    model = train(_reused(), X, y, steps=60)
    params = list(model.parameters())
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas",
                 n_components=4, sigma_noise=0.5)  # fmt: skip
    la.fit(loader(X, y, batch_size=16))
    la(X[:5], pred_type="glm")
    la.sample(3)
    # the explicit GGN from plain autograd (no functional_call): sum_n J_n^T J_n, which
    # H holds as laplace-torch's does (1/sigma^2 is the posterior's factor)
    out = model(X).reshape(-1)
    rows = [torch.autograd.grad(o, params, retain_graph=True) for o in out]
    J = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    ggn = J.T @ J
    top = torch.linalg.eigvalsh(ggn).flip(0)[:4]
    torch.testing.assert_close(la.H[1], top, rtol=1e-6, atol=1e-8)
    # the user's model: the same Parameters, still trainable
    assert [p is q for p, q in zip(model.parameters(), params, strict=True)] == [True] * len(params)
    assert all(type(p) is nn.Parameter for _, p in _slots(model))
    model(X).sum().backward()
    assert all(p.grad is not None for p in params)
