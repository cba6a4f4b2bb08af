"""The factored GGN rebuilt batch by batch per product, and the planner's use of it."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import fit_quietly, loader, mlp, mlp_problem, output_jacobian, softmax_ggn
from torch import nn

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.batches import SubBatches
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory import budget as budget_module
from laplace_glas.curvature.memory.planner import plan_solve
from laplace_glas.curvature.memory.streaming import STREAMED_BLOCK
from laplace_glas.curvature.operators.streamed import StreamedFactoredGGN

F64 = torch.float64


def _regression(n=30, batch=8):
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 7, 5, 2], dtype=F64).eval()
    X, y = torch.randn(n, 3, generator=g, dtype=F64), torch.randn(n, 2, generator=g, dtype=F64)
    return model, X, y, loader(X, y, batch_size=batch)


def _operator(model, data, likelihood, n_terms):
    return StreamedFactoredGGN(model, list(model.parameters()), data, likelihood, n_terms, F64)


def _product(operator, model, V):
    with autodiff_friendly(model):
        return operator.matmat_torch(V)


def test_products_are_the_explicit_mean_ggn_for_regression():
    model, X, _, data = _regression()
    _, J = output_jacobian(model, X)  # (N, C, D), reverse mode
    G = torch.einsum("ncd,nce->de", J, J) / X.shape[0]  # unit noise, mean loss
    operator = _operator(model, data, "regression", X.shape[0])
    V = torch.randn(G.shape[0], 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.testing.assert_close(_product(operator, model, V), G @ V, rtol=1e-10, atol=1e-12)
    assert operator.n_passes == 1  # the three columns shared one pass over the data


def test_products_are_the_softmax_ggn_on_mapping_batches_and_slices():
    g = torch.Generator().manual_seed(3)
    model = mlp([4, 6, 3], dtype=F64).eval()
    X, y = torch.randn(21, 4, generator=g, dtype=F64), torch.randint(0, 3, (21,), generator=g)
    y[[2, 9]] = -100  # ignored targets: no rows
    out, J = output_jacobian(model, X)
    G, n_terms = softmax_ggn(out, J, y)
    rows = [{"input_ids": X[i], "labels": y[i]} for i in range(len(y))]
    batches = torch.utils.data.DataLoader(rows, batch_size=5)

    class OnIds(nn.Module):  # mapping batches: the model reads the input under its key
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, batch):
            return self.net(batch["input_ids"])

    wrapped = OnIds(model).eval()
    V = torch.randn(G.shape[0], 2, generator=g, dtype=F64)
    for data in (batches, SubBatches(batches, 2)):
        operator = StreamedFactoredGGN(
            wrapped, list(wrapped.parameters()), data, "classification", n_terms, F64
        )
        torch.testing.assert_close(
            _product(operator, wrapped, V), G @ V / n_terms, rtol=1e-10, atol=1e-12
        )


def test_a_product_leaves_no_hooks_and_a_block_equals_its_columns():
    model, X, y, data = _regression()
    operator = _operator(model, data, "regression", X.shape[0])
    V = torch.randn(operator.shape[0], 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    block = _product(operator, model, V)
    columns = torch.cat([_product(operator, model, V[:, [j]]) for j in range(4)], 1)
    torch.testing.assert_close(block, columns, rtol=1e-12, atol=1e-14)
    assert operator.n_passes == 5
    assert all(not m._forward_hooks for m in model.modules())

    class Fails(Exception):
        pass

    def failing():  # a loader that fails mid-pass must not leave the hooks behind
        yield X[:8], y[:8]
        raise Fails

    broken = _operator(model, failing(), "regression", X.shape[0])
    try:
        _product(broken, model, V)
    except Fails:
        pass
    assert all(not m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------- planner
def _plan(problem, budget, k=3):
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        return plan_solve(problem, k, "auto", memory_budget=budget)


def _smallest(problem):
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        with pytest.raises(budget_module.MemoryBudgetError) as refused:
            plan_solve(problem, 3, "auto", memory_budget=1)
    return refused.value.smallest


def test_factors_that_do_not_fit_are_rebuilt_per_product_within_the_budget():
    _, _, problem = mlp_problem(n=400, batch=20)
    stored = _plan(problem, 2**40)
    assert stored.strategy in ("factored", "dual")
    # the smallest budget named: curvlinops' streaming, whose one column is the least
    smallest = _smallest(problem)
    tight = _plan(problem, smallest)
    assert tight.strategy == "streaming" and tight.estimated_peak == smallest
    assert tight.operator_name.startswith("curvlinops")
    # twice that: neither the stored factors nor the kept graphs fit, the rebuilt ones do
    plan = _plan(problem, 2 * smallest)
    at = dict(plan.estimates)
    assert at["factored"] > 2 * smallest and at["linearised"] > 2 * smallest
    assert plan.strategy == "streaming" and plan.scale == 1.0
    assert plan.operator_name.startswith("factored, rebuilt per batch")
    assert isinstance(plan.operator.operator, StreamedFactoredGGN)
    assert smallest < plan.estimated_peak == at["streaming"] <= plan.budget_bytes
    # the planner chose the solver: blocks of STREAMED_BLOCK columns share each pass,
    # with the block solver's storage B in B + (2 + R) g + F_b + (4 D + 2 W) s a column
    assert plan.solver == "block" and plan.block_size == STREAMED_BLOCK
    with autodiff_friendly(problem.model):
        sizes = plan.operator.operator.survey()
    assert (sizes.widest, sizes.rows) == (20 * 16, 2)  # batch x widest d_out; R = 2 outputs
    column = (4 * problem.n_params + 2 * sizes.widest) * 8
    assert plan.operator.operator.chunk_elements == plan.max_columns * sizes.widest
    fixed = plan.estimated_peak - STREAMED_BLOCK * column
    assert plan.max_columns == (2 * smallest - fixed) // column >= STREAMED_BLOCK
    # a budget a column short of the block: one column per pass, Lanczos's storage
    narrow = _plan(problem, plan.estimated_peak - 1)
    assert narrow.operator_name.startswith("factored, rebuilt per batch")
    assert (narrow.solver, narrow.block_size) == ("block", 1)
    assert narrow.estimated_peak < plan.estimated_peak


def test_the_rebuilt_factors_estimate():
    budget = budget_module.Estimates(10**9, 1000, 4, 50, 3)
    # B + (2 + R) g + F_b + (4 D + 2 W) s a column, the columns the rest of the budget holds
    assert budget.factor_streaming_peak(300, 70, rows=2) == (
        1000 + 1200 + 70 + 800,
        (10**9 - 2270) // 800,
    )
    assert budget.factor_streaming_peak(None, 70) == (None, 1)
    block = budget_module.solver_storage("block", 50, 3, 4, block_size=4)
    peak, columns = budget.factor_streaming_peak(300, 70, rows=1, block=4, widest=25)
    assert peak == block + 900 + 70 + 4 * 1000 and columns == (10**9 - block - 970) // 1000


def test_a_fit_on_rebuilt_factors_is_the_unbudgeted_fit():
    model, data, problem = mlp_problem(n=400, batch=20)

    free = fit_quietly(model, data)
    budgeted = fit_quietly(model, data, memory_budget=2 * _smallest(problem))
    info = budgeted.lanczos_info
    assert info.strategy == "streaming" and str(info.operator).startswith("factored, rebuilt")
    torch.testing.assert_close(budgeted.eigenvalues, free.eigenvalues, rtol=1e-8, atol=0)
    overlap = (budgeted.eigenvectors.T @ free.eigenvectors).abs()
    torch.testing.assert_close(overlap.diagonal(), torch.ones(3, dtype=F64), rtol=0, atol=1e-6)
    torch.testing.assert_close(budgeted.loss, free.loss)


def test_a_block_size_of_the_callers_own_is_kept():
    _, _, problem = mlp_problem(n=400, batch=20)
    smallest = _smallest(problem)
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        plan = plan_solve(problem, 3, "block", memory_budget=2 * smallest, block_size=2)
    assert plan.operator_name.startswith("factored, rebuilt per batch")
    assert plan.solver == "block" and plan.block_size is None  # the fit's block_size=2


class _PerPosition(nn.Module):
    """Outputs per position: the factored operator takes at most 1024 rows an example."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3)

    def forward(self, x):
        return self.lin(x).flatten(1)  # (B, T * 3)


def test_a_later_batch_the_factors_cannot_take_is_never_streamed_on_factors():
    g = torch.Generator().manual_seed(0)
    model = _PerPosition().to(F64).eval()
    batches = [
        (torch.randn(4, 10, 2, generator=g, dtype=F64), torch.randn(4, 30, generator=g, dtype=F64))
        for _ in range(9)
    ]
    long = torch.randn(4, 400, 2, generator=g, dtype=F64)  # 1200 rows an example
    batches.append((long, torch.randn(4, 1200, generator=g, dtype=F64)))
    operator = StreamedFactoredGGN(model, list(model.parameters()), batches, "regression", 40, F64)
    with autodiff_friendly(model):
        reason = operator.survey()
    assert isinstance(reason, str) and "1200 output rows" in reason
    problem = CurvatureProblem.build(
        model, list(model.parameters()), batches, "regression", torch.Size([30]), dtype=F64
    )
    for budget in (2 * _smallest(problem), 8 * _smallest(problem)):
        plan = _plan(problem, budget)
        assert not plan.operator_name.startswith("factored, rebuilt")


def test_a_classifier_fit_on_rebuilt_factors_is_the_unbudgeted_fit():
    # softmax cross-entropy: curvlinops' products carry a scale != 1, the factors none
    g = torch.Generator().manual_seed(4)
    model = mlp([3, 16, 16, 3], dtype=F64).eval()
    X, y = torch.randn(400, 3, generator=g, dtype=F64), torch.randint(0, 3, (400,), generator=g)
    data = loader(X, y, batch_size=20)
    problem = CurvatureProblem.build(
        model, list(model.parameters()), data, "classification", torch.Size([3]), dtype=F64
    )
    assert problem.scale != 1.0
    free = fit_quietly(model, data, "classification")
    budgeted = fit_quietly(model, data, "classification", memory_budget=2 * _smallest(problem))
    assert str(budgeted.lanczos_info.operator).startswith("factored, rebuilt")
    torch.testing.assert_close(budgeted.eigenvalues, free.eigenvalues, rtol=1e-8, atol=0)


def test_no_survey_pass_where_the_first_batch_already_exceeds_the_budget(monkeypatch):
    _, _, problem = mlp_problem(n=400, batch=20)
    smallest = _smallest(problem)  # curvlinops' one column: the rebuilt factors need more
    surveys = []
    survey = StreamedFactoredGGN.survey
    monkeypatch.setattr(
        StreamedFactoredGGN, "survey", lambda self: surveys.append(1) or survey(self)
    )
    assert _plan(problem, smallest).operator_name.startswith("curvlinops")
    assert not surveys
    assert _plan(problem, 2 * smallest).operator_name.startswith("factored, rebuilt")
    assert len(surveys) == 1


def test_the_rebuilt_linearisations_are_not_checked_where_rebuilt_factors_fit(monkeypatch):
    from laplace_glas.curvature.operators.relinearized import RelinearizedGGN

    _, _, problem = mlp_problem(n=400, batch=20)
    smallest = _smallest(problem)
    checks = []
    check = RelinearizedGGN.check
    monkeypatch.setattr(RelinearizedGGN, "check", lambda self: checks.append(1) or check(self))
    # twice curvlinops' one column: the rebuilt factors fit, no linearisation is made
    assert _plan(problem, 2 * smallest).operator_name.startswith("factored, rebuilt")
    assert not checks  # (test_relinearized checks the planner where they do not fit)
