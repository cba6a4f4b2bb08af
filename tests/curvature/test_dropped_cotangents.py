"""The linearised operators' backward graphs without the tensors their ``J v`` never reads
(:mod:`laplace_glas.autodiff.cotangents`): products bit for bit those of the whole
graphs and of the explicit GGN, less memory, and a backward pass that does read them
built whole."""

from __future__ import annotations

import pytest
import torch
from test_linearized import F64, CustomMLP, GRURegressor, dense_ggn, linearized, problem
from test_linearized import regression_batches as regression
from torch import nn

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.cotangents import cotangent_free_saving
from laplace_glas.curvature.operators import linearized as linearized_module
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.linearized import LinearizedGGN
from laplace_glas.curvature.operators.relinearized import RelinearizedGGN


def _whole_graphs(monkeypatch):
    """Every ``linearize_batch`` keeps its cotangents."""
    original = linearized_module.linearize_batch
    monkeypatch.setattr(
        linearized_module,
        "linearize_batch",
        lambda *args, **kwargs: original(*args, **{**kwargs, "drop_cotangents": False}),
    )


def _gru_problem():
    torch.manual_seed(0)
    model = GRURegressor().to(F64).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(12, 6, 8, generator=g, dtype=F64), torch.randn(12, 1, generator=g, dtype=F64)
    return model, [(X[:6], y[:6]), (X[6:], y[6:])], nn.MSELoss(), 12


@pytest.mark.parametrize(
    "name", ["mlp-mse", "lstm-tokens", "attention-dict", "gpt2-lora-tokens", "gru"]
)
def test_dropped_cotangents_change_no_product_and_keep_less(name, monkeypatch):
    model, batches, loss_func, num_data = _gru_problem() if name == "gru" else problem(name)
    size = (lambda X: X["x"].shape[0]) if name == "attention-dict" else None
    V = torch.randn(
        sum(p.numel() for p in model.parameters() if p.requires_grad), 3,
        generator=torch.Generator().manual_seed(3), dtype=F64,
    )  # fmt: skip

    def products():
        op = linearized(model, batches, loss_func, num_data, batch_size_fn=size)
        assert isinstance(op, LinearizedGGN), op
        with autodiff_friendly(model):
            return op, op @ V, torch.cat([op @ V[:, j : j + 1] for j in range(3)], 1)

    dropped, block, columns = products()
    _whole_graphs(monkeypatch)
    whole, whole_block, whole_columns = products()
    assert torch.equal(block, whole_block) and torch.equal(columns, whole_columns)
    if name != "attention-dict":  # its masked mean is left out of the dense reference
        torch.testing.assert_close(block, dense_ggn(model, batches, loss_func, num_data) @ V)
    # an MLP's backward saves no cotangent but views of u (held anyway): no saving
    assert dropped.saved_bytes <= (0.8 if name in SAVING else 1) * whole.saved_bytes


SAVING = ("lstm-tokens", "gpt2-lora-tokens", "gru")


class ReadsItsCotangent(torch.autograd.Function):
    """The identity, whose backward ``((g + 1)^2 - g^2 - 1) / 2 = g`` is linear in the
    gradient ``g`` but multiplies two tensors that depend on it: its derivative in ``g``
    reads the saved copies of ``g + 1`` and ``g``, which dropping would zero."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return ((grad + 1) * (grad + 1) - grad * grad - 1) / 2


def test_a_backward_that_reads_its_cotangents_is_kept_whole(monkeypatch):
    torch.manual_seed(0)
    model = CustomMLP(ReadsItsCotangent).to(F64)
    batches = regression()
    op = linearized(model, batches, nn.MSELoss(), 12)
    assert isinstance(op, LinearizedGGN), op
    V = torch.randn(op.shape[0], 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    torch.testing.assert_close(op @ V, dense_ggn(model, batches, nn.MSELoss(), 12) @ V)
    _whole_graphs(monkeypatch)
    assert op.saved_bytes == linearized(model, batches, nn.MSELoss(), 12).saved_bytes


@pytest.mark.parametrize("activation, drops", [(ReadsItsCotangent, False), (None, True)])
def test_rebuilt_graphs_drop_cotangents_unless_the_check_fails(activation, drops):
    torch.manual_seed(0)
    model = (CustomMLP(activation) if activation else nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)
    )).to(F64)  # fmt: skip
    batches = regression()
    params = list(model.parameters())
    operator = RelinearizedGGN(model, nn.MSELoss(), params, batches, num_data=12, batch_bytes=2**20)
    with autodiff_friendly(model):
        assert operator.check() is None
        assert operator.drop_cotangents is drops
        V = torch.randn(operator.shape[0], 2, generator=torch.Generator().manual_seed(0), dtype=F64)
        torch.testing.assert_close(operator @ V, dense_ggn(model, batches, nn.MSELoss(), 12) @ V)


def test_the_dropped_tensors_are_counted_and_hold_no_memory():
    """A weight gradient ``u^T x`` of a linear map: its graph in ``u`` needs ``x``, not
    ``u``; the dropped ``u`` unpacks as a zero-stride zero and is counted for the heap."""
    x = torch.tanh(torch.randn(50, 40, dtype=F64, requires_grad=True))
    W = torch.randn(30, 40, dtype=F64, requires_grad=True)
    out = x @ W.T
    u = torch.zeros_like(out, requires_grad=True)
    counter = SavedBytes(set())
    with cotangent_free_saving(u, counter.pack, counter.drop):
        (pullback,) = torch.autograd.grad(out, W, u, create_graph=True)
    assert counter.dropped >= 1 and counter.bytes <= x.nbytes
    assert counter.heap_bytes(4096) == 4096 * counter.storages + 2048 * counter.dropped
    v = torch.randn_like(W)
    (Jv,) = torch.autograd.grad(pullback, u, v)
    torch.testing.assert_close(Jv, x @ v.T)


def test_a_graph_deeper_than_python_recursion_is_searched():
    x = torch.randn(4, dtype=F64, requires_grad=True)
    y = x
    for _ in range(3000):  # a chain of 3000 saved results
        y = torch.tanh(y)
    u = torch.zeros_like(y, requires_grad=True)
    counter = SavedBytes(set())
    with cotangent_free_saving(u, counter.pack, counter.drop):
        (pullback,) = torch.autograd.grad(y, x, u, create_graph=True)
    assert counter.dropped == 2999  # the first op's gradient is u itself, kept
    v = torch.randn(4, dtype=F64)
    (Jv,) = torch.autograd.grad(pullback, u, v)
    (reference,) = torch.autograd.grad(torch.autograd.grad(y, x, u, create_graph=True)[0], u, v)
    torch.testing.assert_close(Jv, reference)
