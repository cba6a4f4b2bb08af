"""The GGN from stored per-example Jacobians against dense references (reverse-mode
Jacobians in closed form and curvlinops' operator), and the planner's choice of it.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import loader, mlp, output_jacobian, softmax_ggn
from torch import nn

from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.budget import Estimates
from laplace_glas.curvature.memory.planner import _jacobian, plan_solve
from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.factors import row_vectors
from laplace_glas.curvature.operators.jacobian_estimates import (
    estimate_build_bytes,
    estimate_jacobian_bytes,
)
from laplace_glas.curvature.operators.stored_jacobian import (
    JacobianGGN,
    build_jacobian_ggn,
)
from laplace_glas.curvature.solvers.solve import compute_eigenpairs

F64 = torch.float64


class LoraSequence(nn.Module):
    """A frozen linear map plus a trainable low-rank adapter over ``T`` positions, a
    trainable head, averaged over the positions: ``(batch, T, 4) -> (batch, C)``.
    """

    def __init__(self, C: int = 3):
        super().__init__()
        self.base = nn.Linear(4, 6).requires_grad_(False)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 6, bias=False)
        self.head = nn.Linear(6, C)

    def forward(self, x):
        h = torch.tanh(self.base(x) + self.lora_B(self.lora_A(x)))
        return self.head(h).mean(1)


class Tagged(nn.Module):
    """A raw parameter (the torch.func route) over 6 positions, 4 classes each."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.W = nn.Parameter(torch.randn(3, 8, generator=g) / 2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, 6, 3) -> (B, 6, 4)
        return self.head(torch.tanh(x @ self.W))


class Bilinear(nn.Module):
    """A raw parameter used through ``x @ W`` (not a layer the factored operator knows)."""

    def __init__(self, C: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.W = nn.Parameter(torch.randn(3, 5, generator=g) / 2)
        self.head = nn.Linear(5, C)

    def forward(self, x):
        return self.head(torch.sin(x @ self.W))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def problem_of(model, data, likelihood, out_shape, **kwargs):
    return CurvatureProblem.build(
        model, trainable(model), data, likelihood, torch.Size(out_shape), dtype=F64, **kwargs
    )


def dense_ggn(model, X, y, likelihood, ignore_index=-100):
    """``(1/N) sum_n J_n^T Lambda_n J_n`` from reverse-mode Jacobians (unit noise)."""
    out, J = output_jacobian(model, X)
    if likelihood == "regression":
        return torch.einsum("tcd,tce->de", J, J) / X.shape[0]
    G, n = softmax_ggn(out, J, y, ignore_index)
    return G / n


def operator_matrix(op) -> torch.Tensor:
    eye = torch.eye(op.shape[0], dtype=F64)
    return op @ eye


def sequence_data(n=10, T=5, C=3, likelihood="classification"):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, T, 4, generator=g, dtype=F64)
    if likelihood == "regression":
        y = torch.randn(n, C, generator=g, dtype=F64)
    else:
        y = torch.randint(0, C, (n,), generator=g)
    return X, y


@pytest.mark.parametrize("C", [2, 5])
def test_rows_square_to_the_softmax_hessian(C):
    """``C - 1`` rows per position whose Gram is ``scale^2 (diag p - p p^T)``, zero
    for ignored targets."""
    g = torch.Generator().manual_seed(C)
    out = 3 * torch.randn(4, 3, C, generator=g, dtype=F64)  # 4 examples, 3 positions
    y = torch.randint(0, C, (4, 3), generator=g)
    y[1, 2] = -100
    rows = row_vectors(out, y, "classification", -100, 0.5)
    assert rows.shape == (3 * (C - 1), 4, 3, C)
    p = torch.softmax(out, -1)
    Lam = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]
    for b in range(4):
        for t in range(3):
            block = rows[t * (C - 1) : (t + 1) * (C - 1), b, t]  # (C - 1, C)
            expected = 0.25 * Lam[b, t] * float(y[b, t] != -100)
            torch.testing.assert_close(block.T @ block, expected, rtol=0, atol=1e-15)
            others = [u for u in range(3) if u != t]
            assert not rows[t * (C - 1) : (t + 1) * (C - 1), b, others].any()


def test_rows_of_a_single_class_are_one_zero_row_per_position():
    """One class: ``Lambda = 0``, one (zero) row per position, as before the rows were
    reduced to ``C - 1``."""
    out = torch.randn(4, 3, 1, dtype=F64)
    rows = row_vectors(out, torch.zeros(4, 3, dtype=torch.long), "classification", -100, 0.5)
    assert rows.shape == (3, 4, 3, 1) and not rows.any()


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_factor_route_matches_the_dense_ggn_and_curvlinops(likelihood):
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data(likelihood=likelihood)
    data = loader(X, y, batch_size=4)  # batches of 4, 4, 2
    problem = problem_of(model, data, likelihood, (3,))
    op = build_jacobian_ggn(model, trainable(model), data, likelihood, problem.n_terms)
    rows = 3 if likelihood == "regression" else 2  # C - 1 rows of the softmax's Lambda
    assert isinstance(op, JacobianGGN) and op.J.shape == (10, rows, op.shape[0])
    G = operator_matrix(op)
    reference = dense_ggn(model, X, y, likelihood)
    assert torch.allclose(G, reference, rtol=1e-10, atol=1e-12 * reference.abs().max())
    curvlinops = operator_matrix(problem.reference_operator()) * problem.scale
    ours, theirs = torch.linalg.eigvalsh(G), torch.linalg.eigvalsh(curvlinops)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-8 * theirs.max())


def test_torch_func_route_matches_the_dense_ggn():
    model = Bilinear().to(F64).eval()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(9, 3, generator=g, dtype=F64)
    y = torch.randint(0, 2, (9,), generator=g)
    data = loader(X, y, batch_size=4)
    problem = problem_of(model, data, "classification", (2,))
    op = build_jacobian_ggn(model, trainable(model), data, "classification", 9)
    assert isinstance(op, JacobianGGN)
    G = operator_matrix(op)
    reference = dense_ggn(model, X, y, "classification")
    assert torch.allclose(G, reference, rtol=1e-10, atol=1e-12 * reference.abs().max())
    curvlinops = operator_matrix(problem.reference_operator()) * problem.scale
    ours, theirs = torch.linalg.eigvalsh(G), torch.linalg.eigvalsh(curvlinops)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-8 * theirs.max())


def test_per_token_outputs_leave_ignored_targets_out():
    """``(batch, T, V)`` logits: ``R = T V`` rows per example, zero where ignored."""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(3, 4)
            self.head = nn.Linear(4, 5)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            return self.head(h + h.cumsum(1))  # positions depend on the earlier ones

    model = Tagger().to(F64).eval()
    g = torch.Generator().manual_seed(2)
    X = torch.randn(6, 8, 3, generator=g, dtype=F64)
    y = torch.randint(0, 5, (6, 8), generator=g)
    y[0, 1] = y[3, 7] = -100
    data = loader(X, y, batch_size=4)
    problem = problem_of(model, data, "classification", (8, 5))
    assert problem.n_terms == 46
    op = build_jacobian_ggn(model, trainable(model), data, "classification", 46)
    assert isinstance(op, JacobianGGN) and op.n_rows == 8 * 4  # T (V - 1)
    D = sum(p.numel() for p in trainable(model))
    assert estimate_jacobian_bytes(46, (8, 5), "classification", D, 8, 6) == op.J.nbytes
    reference = dense_ggn(model, X, y, "classification")
    G = operator_matrix(op)
    assert torch.allclose(G, reference, rtol=1e-10, atol=1e-12 * reference.abs().max())


def test_the_budget_counts_the_stored_rows_once():
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data(likelihood="regression")
    data = loader(X, y, batch_size=4)  # batches of 4, 4, 2 written into one buffer
    whole = build_jacobian_ggn(model, trainable(model), data, "regression", 10)
    nbytes = whole.J.numel() * whole.J.element_size()
    exact = build_jacobian_ggn(model, trainable(model), data, "regression", 10, budget_bytes=nbytes)
    assert isinstance(exact, JacobianGGN) and torch.equal(exact.J, whole.J)
    below = build_jacobian_ggn(
        model, trainable(model), data, "regression", 10, budget_bytes=nbytes - 1
    )
    assert isinstance(below, str) and "memory budget" in below


@pytest.mark.parametrize("solver", ["lanczos", "dual", "block"])
def test_solvers_on_the_jacobian_operator_find_the_top_eigenpairs(solver):
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data(n=12)
    op = build_jacobian_ggn(model, trainable(model), loader(X, y, 5), "classification", 12)
    pairs = compute_eigenpairs(op, 4, solver=solver, dtype=F64)
    assert pairs.operator == "jacobian" and pairs.solver == solver
    expected = torch.linalg.eigvalsh(dense_ggn(model, X, y, "classification")).flip(0)[:4]
    assert torch.allclose(pairs.values, expected, rtol=1e-8, atol=0)
    U = pairs.vectors
    assert torch.allclose(U.T @ U, torch.eye(4, dtype=F64), atol=1e-8)


def test_torch_func_route_refuses_interacting_or_reshaped_examples():
    """A batch statistic couples the examples (per-example vmap would miss it; the
    forward-mode check of the first batch catches it); outputs with one row per token
    are not one row per example."""

    class Centred(Bilinear):
        def forward(self, x):
            out = super().forward(x)
            return out - 0.5 * out.mean(0)

    class Flattened(Bilinear):
        def forward(self, x):
            return super().forward(x).reshape(-1, 1)

    g = torch.Generator().manual_seed(4)
    X = torch.randn(8, 3, generator=g, dtype=F64)
    y = torch.randn(8, 2, generator=g, dtype=F64)
    model = Centred().to(F64).eval()
    reason = build_jacobian_ggn(model, trainable(model), loader(X, y, 4), "regression", 8)
    assert isinstance(reason, str) and "differs from forward mode" in reason
    model = Flattened().to(F64).eval()
    reason = build_jacobian_ggn(model, trainable(model), loader(X, y, 4), "regression", 8)
    assert reason == "model outputs whose first axis (8) is not the batch (4)"


def test_budget_and_unsupported_cases_return_reasons():
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data()
    data = loader(X, y, batch_size=4)
    params = trainable(model)
    small = build_jacobian_ggn(model, params, data, "classification", 10, budget_bytes=1000)
    assert isinstance(small, str) and "memory budget" in small
    custom = build_jacobian_ggn(model, params, data, "classification", 10, loss_fn=nn.MSELoss())
    assert custom == "a custom loss_fn"
    # the planner's estimate needs no pass over the data
    problem = problem_of(model, data, "classification", (3,))
    D = sum(p.numel() for p in params)
    # the rows the build stores: C - 1 per position for softmax cross-entropy
    built = build_jacobian_ggn(model, params, data, "classification", 10)
    assert estimate_jacobian_bytes(10, (3,), "classification", D, 8) == built.J.nbytes
    assert estimate_jacobian_bytes(10, (3,), "classification", D, 8) == 10 * 2 * D * 8
    assert estimate_jacobian_bytes(22, (4, 5), "classification", D, 8) == 6 * 16 * D * 8
    assert estimate_jacobian_bytes(10, (3,), "regression", D, 8) == 10 * 3 * D * 8
    # padded targets: the surveyed examples, not the labelled positions / P
    assert estimate_jacobian_bytes(22, (4, 5), "classification", D, 8, 9) == 9 * 16 * D * 8
    reason = _jacobian(problem, "auto", _budget(problem, 1000))
    assert isinstance(reason, str) and "exceeds the memory budget" in reason


def _budget(problem, total: int) -> Estimates:
    """A planning budget of ``total`` bytes without solver storage (float64)."""
    return Estimates(total, 0, 8, problem.n_params, 3)


def test_planner_picks_the_jacobian_for_adapters_and_raw_parameters():
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data()
    plan = plan_solve(problem_of(model, loader(X, y, 4), "classification", (3,)), 3)
    assert isinstance(plan.operator, JacobianGGN) and plan.operator_name == "jacobian"
    assert plan.scale == 1.0 and plan.solver in ("dual", "lanczos")
    assert plan.strategy == "jacobian" and plan.estimated_peak > 0
    bilinear = Bilinear().to(F64).eval()
    Xb, yb = torch.randn(8, 3, dtype=F64), torch.randint(0, 2, (8,))
    plan = plan_solve(problem_of(bilinear, loader(Xb, yb, 4), "classification", (2,)), 2)
    assert plan.operator_name == "jacobian"
    # 'factored' asks for the factored operator itself
    factored = plan_solve(problem_of(model, loader(X, y, 4), "classification", (3,)), 3, "factored")
    assert type(factored.operator) is FactoredGGN and factored.operator_name == "factored"


def test_planner_keeps_the_factors_where_they_are_smaller():
    """One position per example and a wide layer: the factors (N (d_in + R d_out) per
    layer) take far less than N R D, so the factored operator is used.
    """
    model = mlp([3, 16, 16, 2], dtype=F64).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(20, 3, generator=g, dtype=F64), torch.randn(20, 2, generator=g, dtype=F64)
    problem = problem_of(model, loader(X, y, 10), "regression", (2,))
    assert "larger than the factors" in _jacobian(problem, "auto", _budget(problem, 2**30))
    plan = plan_solve(problem, 3)
    assert type(plan.operator) is FactoredGGN and plan.operator_name == "factored"


def _peak_live_bytes(run, trace_path):
    """The largest number of bytes allocated during ``run()`` and live at once, from
    torch.profiler's record of the allocator's events; and ``run()``'s result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    prof.export_chrome_trace(str(trace_path))
    live, total, peak = {}, 0, 0
    for event in json.loads(trace_path.read_text())["traceEvents"]:
        if event.get("name") == "[memory]":
            address, size = event["args"]["Addr"], event["args"]["Bytes"]
            if size > 0:
                live[address] = size
                total += size
            elif address in live:
                total -= live.pop(address)
            peak = max(peak, total)
    return result, peak


def test_a_list_of_batches_is_written_into_one_buffer(tmp_path):
    # its examples are known before the pass, as a DataLoader's: the rows were kept per
    # batch and concatenated at the end, beside themselves (twice the rows at the peak)
    model = LoraSequence().to(F64).eval()
    X, y = sequence_data(n=200, likelihood="regression")
    batches = [(X[i : i + 10], y[i : i + 10]) for i in range(0, 200, 10)]
    built, peak = _peak_live_bytes(
        lambda: build_jacobian_ggn(model, trainable(model), batches, "regression", 200),
        tmp_path / "trace.json",
    )
    rows = built.J.numel() * built.J.element_size()
    assert rows <= peak < 1.5 * rows


def test_the_build_estimate_covers_the_torch_func_route(tmp_path):
    # vmap(jacrev) differentiates every output of every example at once: a batch's
    # build takes its full Jacobian and O backward passes' worth of its graph (6 g was
    # counted: 0.18 of the measured build here)
    from laplace_glas.curvature.operators.graph_bytes import forward_graph_bytes

    model = Tagged().to(F64).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 6, 3, generator=g, dtype=F64), torch.randint(0, 4, (16, 6), generator=g)
    batches = [(X, y)]
    params = trainable(model)
    built, peak = _peak_live_bytes(
        lambda: build_jacobian_ggn(model, params, batches, "classification", 96),
        tmp_path / "trace.json",
    )
    rows = built.J.nbytes
    graph = forward_graph_bytes(model, batches)
    estimate = estimate_build_bytes(model, params, "classification", (6, 4), graph, 16, 8)
    assert peak - rows <= estimate
    factored = LoraSequence().to(F64).eval()
    # the factored route: 6 forward graphs and the largest batch's rows (4 x 3 x D)
    D = sum(p.numel() for p in trainable(factored))
    rows = 4 * 3 * D * 8
    assert (
        estimate_build_bytes(factored, trainable(factored), "regression", (3,), 10, 4, 8)
        == 60 + rows
    )


def _four_batches(route):
    g = torch.Generator().manual_seed(0)
    if route == "torch.func":
        model, likelihood, out_shape = Tagged().to(F64).eval(), "classification", (6, 4)
        X = torch.randn(64, 6, 3, generator=g, dtype=F64)
        y = torch.randint(0, 4, (64, 6), generator=g)
    else:
        model, likelihood, out_shape = LoraSequence().to(F64).eval(), "regression", (3,)
        X, y = sequence_data(n=64, likelihood="regression")
    batches = [(X[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    return model, likelihood, out_shape, batches


@pytest.mark.parametrize("route", ["torch.func", "factored"])
def test_a_batch_s_rows_are_not_held_beside_the_next_batch_s_build(route, tmp_path):
    # the rows of each batch (and on the factored route its factors) were still
    # referenced by the loop and the generator while the next batch's were built: one
    # batch's rows above the estimate
    from laplace_glas.curvature.operators.graph_bytes import forward_graph_bytes

    model, likelihood, out_shape, batches = _four_batches(route)
    params = trainable(model)
    n_terms = 64 * (6 if route == "torch.func" else 1)
    built, peak = _peak_live_bytes(
        lambda: build_jacobian_ggn(model, params, batches, likelihood, n_terms),
        tmp_path / "trace.json",
    )
    graph = forward_graph_bytes(model, batches[:1])
    estimate = estimate_build_bytes(model, params, likelihood, out_shape, graph, 16, 8)
    small = 1024  # a few scalars and index tensors, left out of the estimate
    assert peak - built.J.nbytes <= estimate + small


class ScaledDict(nn.Module):
    """A raw parameter (the torch.func route) on mapping inputs with a scalar entry."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(3, 2, generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        return torch.tanh(x["x"] @ self.W) * x["scale"]


def test_the_vmap_check_on_the_first_example_keeps_a_mapping_s_scalars():
    # the first example was sliced from every entry, a 0-dim one too: IndexError out of
    # the planner, where the pass itself had answered with a reason
    model = ScaledDict().to(F64).eval()
    g = torch.Generator().manual_seed(0)
    X = {"x": torch.randn(8, 3, generator=g, dtype=F64), "scale": torch.tensor(2.0, dtype=F64)}
    batch = {**X, "labels": torch.randn(8, 2, generator=g, dtype=F64)}
    built = build_jacobian_ggn(
        model, trainable(model), [batch], "regression", 8, dict_key_x="x", first_batch=batch
    )
    assert isinstance(built, str) and "vmap" in built  # vmap treats the scalar as batched
