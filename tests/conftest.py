"""Shared fixtures: small tanh MLPs trained on synthetic data."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401  (registers 'glas')

# CI runs the property-based tests on a fixed sequence of examples (reproducible
# failures); locally each run draws new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def mlp(widths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


def train(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    steps: int = 300,
    lr: float = 1e-2,
    classification: bool = False,
) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    lossf = nn.CrossEntropyLoss() if classification else nn.MSELoss()
    for _ in range(steps):
        opt.zero_grad()
        lossf(model(X), y).backward()
        opt.step()
    model.eval()
    return model


class Gained(nn.Module):
    """A float64 tanh MLP whose outputs are multiplied by a parameter of no supported
    layer (``gain``): the factored operator refuses it, the stored Jacobians take
    ``torch.func``'s route."""

    def __init__(self, widths: list[int], gain: list[float], seed: int = 0):
        super().__init__()
        self.body = mlp(widths, dtype=torch.float64, seed=seed)
        self.gain = nn.Parameter(torch.tensor(gain, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.gain


def regression_data(
    n: int, dtype=torch.float32, seed: int = 0, noise: float = 0.1, d_in: int = 1, d_out: int = 1
):
    g = torch.Generator().manual_seed(seed)
    X = (torch.rand(n, d_in, generator=g) * 4 - 2).to(dtype)
    base = torch.sin(3 * X.sum(1, keepdim=True))
    y = torch.cat([base * (j + 1) for j in range(d_out)], dim=1)
    y = y + noise * torch.randn(n, d_out, generator=g).to(dtype)
    return X, y.to(dtype)


class CountingLoader(torch.utils.data.DataLoader):
    """A DataLoader that counts the iterators started over it."""

    started = 0

    def __iter__(self):
        type(self).started += 1
        return super().__iter__()


def loader(X, y, batch_size=32, shuffle=False):
    return DataLoader(TensorDataset(X, y), batch_size=batch_size, shuffle=shuffle)


def mlp_problem(n=48, batch=16):
    """A float64 3-16-16-2 MLP, ``n`` regression points in batches of ``batch`` and their
    ``CurvatureProblem`` (the planner's input)."""
    from laplace_glas.curvature.data.problem import CurvatureProblem

    g = torch.Generator().manual_seed(0)
    model = mlp([3, 16, 16, 2], dtype=torch.float64).eval()
    X = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    data = loader(X, y, batch_size=batch)
    problem = CurvatureProblem.build(
        model, list(model.parameters()), data, "regression", torch.Size([2]), dtype=torch.float64
    )
    return model, data, problem


@pytest.fixture(scope="session")
def toy_regression():
    """A 1-50-50-1 tanh MLP (D = 2701) trained on 100 noisy sine points."""
    X, y = regression_data(100)
    model = train(mlp([1, 50, 50, 1]), X, y, steps=300)
    return model, X, y


@pytest.fixture(scope="session")
def toy_classification():
    """A 2-16-3 tanh MLP on three Gaussian blobs."""
    g = torch.Generator().manual_seed(1)
    centers = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]])
    y = torch.arange(3).repeat_interleave(40)
    X = centers[y] + 0.8 * torch.randn(120, 2, generator=g)
    model = train(mlp([2, 16, 3]), X, y, steps=300, classification=True)
    return model, X, y


# Test modules import reference helpers from each other across the folders that mirror
# the package (e.g. the factored models of curvature/test_factored.py in
# predictive/test_factored_predictive.py): put every test folder on the path.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and _folder.name not in {"upstream", "__pycache__"}:
        sys.path.insert(0, str(_folder))

# The example scripts import their stdlib-only ``_cli`` from their own folder, which
# Python puts on the path when it runs a script; tests that load a script as a module
# need it too (appended: the scripts' names never shadow an installed module).
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))


# One thread: on 2 cores, two BLAS threads per process fight with anything else running
# (a second pytest, the example subprocesses) and products slow down 10-30x.
torch.set_num_threads(1)


@pytest.fixture
def without_jacobian(monkeypatch):
    """The planner without the explicit-Jacobian candidate, for the tests of the
    operators it falls back to (the Jacobians would serve their small models)."""
    from laplace_glas.curvature.memory import planner

    monkeypatch.setattr(planner, "_jacobian", lambda *args: "not tried in this test")


def fit_glas(model, X, y, likelihood="regression", batch_size=32, **kwargs):
    """A fitted GLAS posterior (regression defaults: sigma 0.1, k = 10)."""
    from laplace import Laplace

    if likelihood == "regression":
        kwargs.setdefault("sigma_noise", 0.1)
    kwargs.setdefault("n_components", 10)
    la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="glas", **kwargs)
    la.fit(loader(X, y, batch_size))
    return la


def fit_quietly(model, data, likelihood="regression", **kwargs):
    """``ActiveSubspaceLaplace`` (k = 3) fitted on the loader ``data``, warnings silenced."""
    import warnings

    from laplace_glas import ActiveSubspaceLaplace

    la = ActiveSubspaceLaplace(model, likelihood, n_components=3, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    return la


def graph_node_names(tensor: torch.Tensor) -> set[str]:
    """The type names of every autograd node reachable from ``tensor.grad_fn``."""
    seen, stack, names = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def first_derivatives(out: torch.Tensor, inputs: list, u: torch.Tensor, v: list) -> tuple:
    """``(vjp, jvp, recorded_vjp, recorded_names)`` of ``out`` in ``inputs``: the
    vector-Jacobian product with ``u``, plain and recorded (``create_graph=True``), and
    the Jacobian-vector product with ``v`` by double backward through a pass recorded
    at a zero cotangent (the linearised GGN's ``J v``), with that pass's node names."""
    vjp = torch.autograd.grad(out, inputs, u, retain_graph=True)
    dummy = torch.zeros_like(out, requires_grad=True)
    recorded = torch.autograd.grad(out, inputs, dummy, create_graph=True)
    names = set().union(*(graph_node_names(r) for r in recorded))
    (jvp,) = torch.autograd.grad(recorded, dummy, v)
    recorded_vjp = torch.autograd.grad(out, inputs, u, create_graph=True)
    return vjp, jvp, recorded_vjp, names


def explicit_jacobian(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """(N*C, D) Jacobian by reverse mode (``torch.func.jacrev``), independent of curvlinops."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    J = jacrev(lambda p: functional_call(model, p, (X,)))(params)
    N = X.shape[0]
    return torch.cat([J[n].reshape(N, -1, p.numel()) for n, p in params.items()], -1).reshape(
        -1, sum(p.numel() for p in params.values())
    )


def output_jacobian(model: nn.Module, X) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs (detached) and their ``(rows, C, D)`` Jacobian over the trainable
    parameters, by reverse mode (``torch.func.jacrev``; independent of curvlinops and of
    GLAS's operators), under GLAS's differentiable kernels."""
    from torch.func import functional_call, jacrev

    from laplace_glas.autodiff.context import autodiff_friendly

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    with autodiff_friendly(model):
        J = jacrev(lambda p: functional_call(model, p, (X,)))(params)
        out = model(X).detach()
    D = sum(p.numel() for p in params.values())
    J = torch.cat([J[n].reshape(*out.shape, -1) for n in params], -1)
    return out, J.reshape(-1, out.shape[-1], D)


def pairwise_probit(f_mu: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    """The probit on differences of logits, term by term in plain loops: ``p_c`` is
    proportional to ``1 / sum_j exp(-(mu_c - mu_j) / sqrt(1 + pi/8
    Var(f_c - f_j)))``, normalised. The reference for GLAS's probit from the moments of
    any posterior (e.g. ``FullLaplace._glm_predictive_distribution``)."""
    n, C = f_mu.shape
    probs = torch.zeros(n, C, dtype=f_mu.dtype)
    for i in range(n):
        for c in range(C):
            total = 0.0
            for j in range(C):
                var = f_var[i, c, c] + f_var[i, j, j] - f_var[i, c, j] - f_var[i, j, c]
                margin = (f_mu[i, c] - f_mu[i, j]) / torch.sqrt(1 + torch.pi / 8 * var)
                total = total + torch.exp(-margin)
            probs[i, c] = 1 / total
    return probs / probs.sum(-1, keepdim=True)


def softmax_ggn(
    out: torch.Tensor, J: torch.Tensor, y: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, int]:
    """``sum_t J_t^T (diag p_t - p_t p_t^T) J_t`` over the targets that are not
    ``ignore_index`` (softmax cross-entropy in closed form), and their number."""
    p = torch.softmax(out, -1).reshape(J.shape[0], -1)
    keep = y.reshape(-1) != ignore_index
    J, p = J[keep], p[keep]
    Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("tcd,tce,tef->df", J, Lam, J), int(keep.sum())


def curvlinops_token_ggn(model: nn.Module, x, y, pad: int, batch_size: int):
    """curvlinops' GGN operator of the summed token cross-entropy (``pad`` targets left
    out) on ``(x, y)`` in batches, and the number of tokens it sums over."""
    from laplace_glas.curvature.data.losses import TokenCrossEntropy
    from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator

    n_tokens = int((y != pad).sum())
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    loss = TokenCrossEntropy("sum", pad)
    return mean_ggn_operator(model, loss, list(model.parameters()), loader, n_tokens), n_tokens
