"""The linearised operators' backward graphs, recorded at ``u = 0``, without their saved
tensors that are all zero (:mod:`laplace_glas.autodiff.cotangents`): products bit for
bit those of the whole graphs and of the explicit GGN, less memory, also for backward
passes that read nonzero tensors computed from ``u``."""

from __future__ import annotations

import pytest
import torch
from test_linearized import F64, CustomMLP, GRURegressor, dense_ggn, linearized, problem
from test_linearized import regression_batches as regression
from torch import nn

from laplace_glas.autodiff import frozen_activations
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.autodiff.cotangents import _all_zero, zero_free_saving
from laplace_glas.curvature.operators import linearized as linearized_module
from laplace_glas.curvature.operators.curvlinops import LossOnData
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.linearized import LinearizedGGN
from laplace_glas.curvature.operators.relinearized import RelinearizedGGN


def _whole_graphs(monkeypatch):
    """Every ``linearize_batch`` keeps its whole graphs."""
    original = linearized_module.linearize_batch
    monkeypatch.setattr(
        linearized_module,
        "linearize_batch",
        lambda *args, **kwargs: original(*args, **{**kwargs, "drop_zeros": False}),
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
def test_dropped_zeros_change_no_product_and_keep_less(name, monkeypatch):
    model, batches, loss_func, num_data = _gru_problem() if name == "gru" else problem(name)
    # peft's own LoRA graph, whose backward saves cotangents (a frozen LoRA layer's
    # saves none: tests/autodiff/test_frozen_lora.py)
    monkeypatch.setattr(frozen_activations, "is_frozen_lora", lambda module: False)
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
    gradient ``g`` but reads ``g + 1``, which depends on ``u`` and is not zero at
    ``u = 0``: it must be kept (``g`` itself, zero there, need not)."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return ((grad + 1) * (grad + 1) - grad * grad - 1) / 2


class DividesByItsCotangent(ReadsItsCotangent):
    """The identity, whose backward ``g (2 + g) / (2 + g) = g`` divides by a tensor that
    depends on ``u``: zeroed, it would make ``J v`` NaN."""

    @staticmethod
    def backward(ctx, grad):
        s = 2.0 + grad
        return grad * s / s


class LongSequencesOnly(nn.Module):
    """``b(mean_t f(tanh(a x_t)))`` with ``f`` a custom backward only on sequences
    longer than 4 steps: the first batch (3 steps) does not reach it, the second does."""

    def __init__(self, function):
        super().__init__()
        self.a, self.b, self.function = nn.Linear(3, 5), nn.Linear(5, 2), function

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if x.shape[1] > 4:
            h = self.function.apply(h)
        return self.b(h.mean(1))


@pytest.mark.parametrize("function", [ReadsItsCotangent, DividesByItsCotangent])
def test_backward_passes_that_read_nonzero_tensors_of_u_keep_them(function, monkeypatch):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    problems = [
        (CustomMLP(function).to(F64), regression()),
        (
            LongSequencesOnly(function).to(F64),
            [
                (torch.randn(4, 3, 3, generator=g, dtype=F64), torch.randn(4, 2, dtype=F64)),
                (torch.randn(4, 6, 3, generator=g, dtype=F64), torch.randn(4, 2, dtype=F64)),
            ],
        ),
    ]
    for model, batches in problems:
        n = sum(len(y) for _, y in batches)
        op = linearized(model, batches, nn.MSELoss(), n)
        assert isinstance(op, LinearizedGGN), op
        V = torch.randn(op.shape[0], 2, generator=torch.Generator().manual_seed(0), dtype=F64)
        product = op @ V
        torch.testing.assert_close(product, dense_ggn(model, batches, nn.MSELoss(), n) @ V)
        loss = LossOnData(model, nn.MSELoss(), list(model.parameters()), batches, num_data=n)
        rebuilt = RelinearizedGGN(loss, batch_bytes=2**20)
        with autodiff_friendly(model):
            assert rebuilt.check() is None
            assert torch.equal(rebuilt @ V, product)
        with monkeypatch.context() as patch:
            _whole_graphs(patch)
            assert torch.equal(linearized(model, batches, nn.MSELoss(), n) @ V, product)


def test_the_zero_tensors_are_counted_and_hold_no_memory():
    """A weight gradient ``u^T x``: its graph keeps ``x``; ``u^T``, zero at ``u = 0``,
    unpacks as a zero-stride zero and is counted for the heap."""
    x = torch.tanh(torch.randn(50, 40, dtype=F64, requires_grad=True))
    W = torch.randn(30, 40, dtype=F64, requires_grad=True)
    out = x @ W.T
    u = torch.zeros_like(out, requires_grad=True)
    counter = SavedBytes(set())
    with zero_free_saving(counter.pack, counter.drop):
        (pullback,) = torch.autograd.grad(out, W, u, create_graph=True)
    # x, and one element for each tensor not kept (the zero it unpacks from)
    assert counter.dropped >= 1 and counter.bytes <= x.nbytes + counter.dropped * x.element_size()
    assert counter.heap_bytes(4096) == 4096 * counter.storages + 2048 * counter.dropped
    v = torch.randn_like(W)
    (Jv,) = torch.autograd.grad(pullback, u, v)
    torch.testing.assert_close(Jv, x @ v.T)


def test_the_zero_tensors_unpack_as_views_of_their_own_scalar():
    """Every tensor not kept unpacks, with its shape and dtype and zero strides, as a
    view of a scalar made when it was saved (the same one at every unpacking: nothing
    allocated), its own: a write to one leaves the others zero."""
    shapes = [((3, 4), F64), ((1,), F64), ((2, 2), torch.float32), ((), torch.float32)]
    with zero_free_saving():
        products = [
            torch.ones(shape, dtype=dtype, requires_grad=True) * torch.zeros(shape, dtype=dtype)
            for shape, dtype in shapes
        ]  # each saves its zero factor
    unpacked = [p.grad_fn._saved_other for p in products]
    for tensor, (shape, dtype) in zip(unpacked, shapes, strict=True):
        assert tensor.shape == shape and tensor.dtype == dtype and not tensor.any()
        assert all(stride == 0 for stride in tensor.stride())
    pointers = [t.untyped_storage().data_ptr() for t in unpacked]
    assert len(set(pointers)) == len(shapes)
    again = [p.grad_fn._saved_other.untyped_storage().data_ptr() for p in products]
    assert again == pointers  # unpacked again: no new zero
    unpacked[1].add_(1.0)  # custom code writing to a saved tensor: that tensor's alone
    grads = [
        torch.autograd.grad(p.sum(), p.grad_fn.next_functions[0][0].variable)[0] for p in products
    ]
    assert grads[1].eq(1).all() and not any(g.any() for k, g in enumerate(grads) if k != 1)


def test_only_tensors_zero_in_every_element_are_dropped():
    kept, dropped = [], []
    with zero_free_saving(lambda t: kept.append(t) or t, dropped.append):
        for values in ([0.0, 0.0], [0.0, float("nan")], [0.0, 1e-300], [-0.0, 0.0]):
            torch.sin(torch.tensor(values, dtype=F64, requires_grad=True))  # saves its input
    assert [t.tolist() for t in dropped] == [[0.0, 0.0], [-0.0, 0.0]]
    assert len(kept) == 2 and torch.isnan(kept[0][1]) and kept[1][1] == 1e-300
    sparse = torch.zeros(2, 2).to_sparse()
    assert not _all_zero(sparse) and _all_zero(torch.zeros(2, 2))  # sparse: kept as it is


class _Wrapped(torch.Tensor):
    """A tensor subclass: kept as it is, also inside a parameter."""


def test_subclassed_tensors_are_kept_untested():
    assert _all_zero(torch.zeros(3)) and _all_zero(nn.Parameter(torch.zeros(3)))
    assert not _all_zero(torch.zeros(3).as_subclass(_Wrapped))
    assert not _all_zero(nn.Parameter(torch.zeros(3).as_subclass(_Wrapped)))


def test_a_gru_batch_keeps_less_than_60_percent(monkeypatch):
    """A GRU (64 units, 8 steps) over a batch of 32."""
    torch.manual_seed(0)
    model = GRURegressor().eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 8, 8, generator=g), torch.randn(32, 1, generator=g))]
    dropped = linearized(model, batches, nn.MSELoss(), 32).saved_bytes
    _whole_graphs(monkeypatch)
    assert dropped < 0.6 * linearized(model, batches, nn.MSELoss(), 32).saved_bytes


class SqrtAtZero(ReadsItsCotangent):
    """The identity, whose backward ``g + 0 sqrt(g)`` is ``g`` but whose derivative in
    ``g`` at ``g = 0`` is ``1 + 0 * inf``: NaN."""

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.0 * grad.sqrt()


def test_a_non_finite_j_v_fails_the_adjoint_check():
    torch.manual_seed(0)
    reason = linearized(CustomMLP(SqrtAtZero).to(F64), regression(), nn.MSELoss(), 12)
    assert isinstance(reason, str) and "<u, J v> = <J^T u, v>" in reason
