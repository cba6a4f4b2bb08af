"""The linearised GGN rebuilt batch by batch per product, and the planner's use of it."""

from __future__ import annotations

import gc
import warnings
import weakref
from dataclasses import replace

import pytest
import torch
from conftest import fit_quietly
from test_linearized import (
    CustomMLP,
    OnceDifferentiableTanh,
    Tanh,
    _Probed,
    dense_ggn,
    problem,
    regression_batches,
)
from torch import nn

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory import budget as budget_module
from laplace_glas.curvature.memory.planner import plan_solve
from laplace_glas.curvature.memory.streaming import STREAMED_BLOCK, streamed_linearized
from laplace_glas.curvature.operators import relinearized as relinearized_module
from laplace_glas.curvature.operators.curvlinops import LossOnData
from laplace_glas.curvature.operators.graph_bytes import forward_graph_bytes
from laplace_glas.curvature.operators.linearized import build_linearized_ggn
from laplace_glas.curvature.operators.relinearized import LARGER_BATCH, RelinearizedGGN

F64 = torch.float64


def _operator(model, batches, loss_func, num_data, batch_size_fn=None):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = LossOnData(model, loss_func, params, batches, num_data, batch_size_fn)
    return RelinearizedGGN(loss, batch_bytes=2**20)


@pytest.mark.parametrize("name", ["mlp-mse", "lstm-tokens", "attention-dict", "gpt2-lora-tokens"])
def test_products_equal_the_explicit_ggn_and_the_kept_operators(name):
    model, batches, loss_func, num_data = problem(name)
    size = (lambda X: X["x"].shape[0]) if name == "attention-dict" else None
    operator = _operator(model, batches, loss_func, num_data, size)
    G = dense_ggn(model, batches, loss_func, num_data)  # jacrev and closed-form Hessians
    V = torch.randn(G.shape[0], 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    params = [p for p in model.parameters() if p.requires_grad]
    with autodiff_friendly(model):
        block = operator @ V  # one pass: each batch linearised once for the 4 columns
        column = operator @ V[:, :1]
        loss = LossOnData(model, loss_func, params, batches, num_data, size)
        kept = build_linearized_ggn(loss, budget_bytes=2**30)
        kept_block = kept @ V
    torch.testing.assert_close(block, G @ V, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(column, G @ V[:, :1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(block, kept_block, rtol=1e-12, atol=1e-14)
    assert operator.n_products == 5 and operator.linearizations == []


def test_a_batch_is_freed_before_the_next_is_linearised(monkeypatch):
    torch.manual_seed(0)
    model = _Probed().to(F64)  # weak references to each pass's saved tanh outputs
    batches = regression_batches() + regression_batches(seed=1)  # six batches
    built = relinearized_module.linearize_batch

    def watched(*args, **kwargs):  # freed by reference counts alone: no collector runs
        assert all(probe() is None for probe in model.probes), "an earlier batch is alive"
        lin = built(*args, **kwargs)
        model.probes.append(weakref.ref(lin.outputs))  # and the linearisation itself
        return lin

    monkeypatch.setattr(relinearized_module, "linearize_batch", watched)
    operator = _operator(model, batches, nn.MSELoss(), 24)
    V = torch.randn(operator.shape[0], 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    gc.collect()
    gc.disable()
    try:
        operator @ V
        assert len(model.probes) == 12
        assert all(probe() is None for probe in model.probes)  # none kept after the product
    finally:
        gc.enable()


class _DetachedOnSingletons(nn.Module):
    """A batch of one example gets an output without a graph (a model's own shortcut)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        out = self.lin(x)
        return out.detach() if x.shape[0] == 1 else out


def test_a_batch_that_cannot_be_linearised_raises_naming_it():
    torch.manual_seed(0)
    model = _DetachedOnSingletons().to(F64)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(5, 3, generator=g, dtype=F64), torch.randn(5, 2, generator=g, dtype=F64)
    batches = [(X[:4], y[:4]), (X[4:], y[4:])]
    operator = _operator(model, batches, nn.MSELoss(reduction="sum"), 5)
    with pytest.raises(
        RuntimeError, match=r"Batch 2 \(counting from 1\) of the training data cannot be linearised"
    ):
        operator @ torch.ones(operator.shape[0], 1, dtype=F64)


def test_the_check_refuses_a_backward_without_a_graph_of_its_own():
    torch.manual_seed(0)
    model = CustomMLP(OnceDifferentiableTanh).to(F64)
    operator = _operator(model, regression_batches(), nn.MSELoss(), 12)
    reason = operator.check()
    assert isinstance(reason, str) and "<u, J v> = <J^T u, v>" in reason
    assert _operator(model, [], nn.MSELoss(), 12).check() == "the loader is empty"


def test_the_rebuilt_graphs_estimate():
    budget = budget_module.Estimates(10**9, 1000, 4, 50, 3)
    # B + L fixed, L + 4 D s a column, the columns the rest of the budget holds
    assert budget.linearized_streaming_peak(300) == (1000 + 300 + 1100, (10**9 - 1300) // 1100)
    block = budget_module.solver_storage("block", 50, 3, 4, block_size=4)
    peak, columns = budget.linearized_streaming_peak(300, block=4)
    assert peak == block + 300 + 4 * 1100 and columns == (10**9 - block - 300) // 1100


# ---------------------------------------------------------------------- planner
class _GRURegression(nn.Module):
    """A GRU over 5 steps, a linear read-out of the last state: the factored operator
    does not cover it, the linearised one does."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 6, batch_first=True)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.gru(x)[0][:, -1])


def _gru_data(n=48, batch=8, likelihood="regression"):
    torch.manual_seed(0)
    model = _GRURegression().to(F64).eval()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(n, 5, 3, generator=g, dtype=F64), torch.randn(n, 2, generator=g, dtype=F64)
    if likelihood == "classification":
        y = torch.randint(0, 2, (n,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=batch)
    problem = CurvatureProblem.build(
        model, list(model.parameters()), data, likelihood, torch.Size([2]), dtype=F64
    )
    return model, data, problem


def _plan(problem, budget, solver="auto"):
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        return plan_solve(problem, 3, solver, memory_budget=budget)


def _batch_bytes_and_budgets(problem):
    """One batch's graph bytes ``L`` and forward graph ``g``, the kept plan's estimate,
    the rebuilt graphs' estimates for one column, ``B + L + g + (L + 4 D s)`` (Lanczos's
    storage ``B``), and for a block of ``STREAMED_BLOCK`` (the block solver's ``B``).

    ``L`` and ``g`` count storages by address, which a pass can reuse: a later
    measurement of the same batch may differ by a few storages, so the budgets below
    keep a margin and the estimates are compared to 2%.
    """
    kept = _plan(problem, 2**40)
    assert kept.strategy == "linearised"
    L = kept.operator.saved_bytes // len(kept.operator.linearizations)
    g = forward_graph_bytes(problem.model, problem.data, problem.device)
    D, s = problem.n_params, 8
    one_column = budget_module.solver_storage("lanczos", D, 3, s) + 2 * L + g + 4 * D * s
    storage = budget_module.solver_storage("block", D, 3, s, block_size=STREAMED_BLOCK)
    block = storage + L + g + STREAMED_BLOCK * (L + 4 * D * s)
    assert one_column < block < kept.estimated_peak
    return kept.estimated_peak, one_column, block


def test_kept_graphs_that_do_not_fit_are_rebuilt_per_product_within_the_budget():
    _, _, problem = _gru_data()
    kept, one_column, block = _batch_bytes_and_budgets(problem)
    # a budget a byte below the kept graphs: STREAMED_BLOCK columns share each batch's
    # linearisation, with the block solver's storage in B + L + g + (L + 4 D s) a column
    wide = _plan(problem, kept - 1)
    assert wide.strategy == "streaming" and wide.scale == problem.scale
    assert wide.operator_name.startswith("linearised, rebuilt per batch")
    assert isinstance(wide.operator.operator, RelinearizedGGN)
    assert (wide.solver, wide.block_size) == ("block", STREAMED_BLOCK)
    assert wide.estimated_peak == pytest.approx(block, rel=0.02)
    assert wide.operator.operator.column_chunk <= wide.max_columns
    # between the one-column and the block estimates: one column a pass, Lanczos's storage
    narrow = _plan(problem, (one_column + block) // 2)
    assert narrow.operator_name.startswith("linearised, rebuilt per batch")
    assert (narrow.solver, narrow.block_size) == ("block", 1)
    assert narrow.estimated_peak == pytest.approx(one_column, rel=0.02)
    # solver='lanczos' asks for curvlinops' products: nothing rebuilt
    assert "rebuilt" not in _plan(problem, kept - 1, solver="lanczos").operator_name


def test_an_operator_checked_for_a_block_alone_is_checked(monkeypatch):
    """Where only the block's estimate fits (a large ``ncv`` makes Lanczos's storage
    larger than the block solver's), the first batch is still checked: a backward
    without a graph of its own is refused, not streamed."""
    torch.manual_seed(0)
    model = CustomMLP(OnceDifferentiableTanh).to(F64)
    batches = regression_batches()
    problem = CurvatureProblem.build(
        model, list(model.parameters()), batches, "regression", torch.Size([2]), dtype=F64
    )
    budget = budget_module.Estimates(0, 10**9, 8, problem.n_params, 3)  # Lanczos: 1e9
    L = 1000
    block_peak = budget.linearized_streaming_peak(L, block=STREAMED_BLOCK)[0]
    assert block_peak < budget.linearized_streaming_peak(L)[0]
    budget.total = block_peak
    refused = budget_module.OverBudget("kept graphs over budget", needed=None, batch_bytes=L)
    with autodiff_friendly(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the batches' graphs exceed the made-up L
        assert streamed_linearized(problem, "not factored", refused, budget) is not None  # sizes
        assert streamed_linearized(problem, "x", refused, budget, STREAMED_BLOCK) is None
        # a model that passes the check is kept for the block
        fine = CustomMLP(Tanh).to(F64)
        ok = CurvatureProblem.build(
            fine, list(fine.parameters()), batches, "regression", torch.Size([2]), dtype=F64
        )
        chosen = streamed_linearized(ok, "x", refused, budget, STREAMED_BLOCK)
    assert chosen is not None and isinstance(chosen[0], RelinearizedGGN)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("room", [0, 1])  # one column a pass; blocks of STREAMED_BLOCK
def test_a_fit_on_rebuilt_graphs_is_the_unbudgeted_fit(room, likelihood):
    # classification: curvlinops' products (and so the linearised ones) carry a scale != 1
    model, data, problem = _gru_data(likelihood=likelihood)
    assert (problem.scale != 1.0) == (likelihood == "classification")
    free = fit_quietly(model, data, likelihood)
    assert free.lanczos_info.strategy == "linearised"
    kept, one_column, block = _batch_bytes_and_budgets(problem)
    budget = (one_column + block) // 2 if room == 0 else kept - 1
    budgeted = fit_quietly(model, data, likelihood, memory_budget=budget)
    info = budgeted.lanczos_info
    assert info.strategy == "streaming" and str(info.operator).startswith("linearised, rebuilt")
    torch.testing.assert_close(budgeted.eigenvalues, free.eigenvalues, rtol=1e-8, atol=0)
    overlap = (budgeted.eigenvectors.T @ free.eigenvectors).abs()
    torch.testing.assert_close(overlap.diagonal(), torch.ones(3, dtype=F64), rtol=0, atol=1e-6)
    torch.testing.assert_close(budgeted.loss, free.loss)


def test_a_product_out_of_device_memory_is_redone_in_smaller_chunks(monkeypatch):
    model, batches, loss_func, num_data = problem("lstm-tokens")
    operator = _operator(model, batches, loss_func, num_data)
    operator.column_chunk = 4
    G = dense_ggn(model, batches, loss_func, num_data)
    V = torch.randn(G.shape[0], 4, generator=torch.Generator().manual_seed(5), dtype=F64)
    product, calls = RelinearizedGGN._product, []

    def short_of_memory(self, lin, chunk, batched):
        calls.append(chunk.shape[1])
        if len(calls) == 2:  # the second batch of the first pass
            raise torch.OutOfMemoryError("simulated")
        return product(self, lin, chunk, batched)

    monkeypatch.setattr(RelinearizedGGN, "_product", short_of_memory)
    with autodiff_friendly(model):
        GV = operator @ V
    torch.testing.assert_close(GV, G @ V, rtol=1e-10, atol=1e-12)
    assert operator.column_chunk == 2 and calls[:2] == [4, 4] and set(calls[2:]) == {2}
    assert operator.n_products == 4  # the abandoned pass is not counted


def test_a_later_batch_larger_than_the_planned_one_is_warned_about_once():
    _, _, problem = _gru_data()
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(8, 5, 3, generator=g, dtype=F64), torch.randn(8, 2, generator=g, dtype=F64)),
        (torch.randn(8, 40, 3, generator=g, dtype=F64), torch.randn(8, 2, generator=g, dtype=F64)),
    ]
    model = problem.model
    params = list(model.parameters())
    with autodiff_friendly(model):
        loss = LossOnData(model, nn.MSELoss(), params, batches, num_data=16)
        first = build_linearized_ggn(replace(loss, data=batches[:1]), budget_bytes=2**30)
        operator = RelinearizedGGN(loss, batch_bytes=first.saved_bytes)
        V = torch.ones(operator.shape[0], 1, dtype=F64)
        with pytest.warns(
            UserWarning, match=r"Batch 2's graphs \(counting from 1\) take .* more than the"
        ):
            operator @ V
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second product says nothing
            operator @ V
    assert operator.largest_batch_bytes > LARGER_BATCH * first.saved_bytes
