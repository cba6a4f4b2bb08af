"""One curvature problem per fit and the planner's choice of operator and solver."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import CountingLoader, loader, mlp
from curvlinops import EFLinearOperator, GGNLinearOperator, HessianLinearOperator
from laplace.curvature import CurvlinopsEF, CurvlinopsHessian
from torch import nn

from laplace_glas import ActiveSubspaceLaplace
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.backends import resolve_backend
from laplace_glas.curvature.data.batches import XYBatches
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.planner import Plan, plan_solve
from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.linearized import LinearizedGGN
from laplace_glas.curvature.solvers.eigenpairs import Eigenpairs

F64 = torch.float64


def regression(n=12, dtype=F64):
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 8, 2], dtype=dtype).eval()
    X = torch.randn(n, 3, generator=g, dtype=dtype)
    y = torch.randn(n, 2, generator=g, dtype=dtype)
    return model, loader(X, y, batch_size=5)


def build(model, data, likelihood="regression", out_shape=(2,), **kwargs):
    return CurvatureProblem.build(
        model, list(model.parameters()), data, likelihood, torch.Size(out_shape), **kwargs
    )


class Recurrent(nn.Module):
    """An LSTM over a sequence, its last state to two outputs: not factored."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def test_problem_counts_n_and_keeps_the_shape_and_dtype():
    model, data = regression()
    problem = build(model, data)
    assert (problem.n_terms, problem.n_loader_terms, problem.num_data) == (12, 12, 12)
    assert problem.out_shape == torch.Size([2]) and problem.dtype == torch.float32
    assert problem.scale == 1.0  # MSELoss(mean) over C = 2 outputs: C / 2
    assert isinstance(problem.data, XYBatches) and problem.batch_size_fn is None
    assert problem.n_params == sum(p.numel() for p in model.parameters())
    assert isinstance(problem.params, tuple)
    f64 = build(model, data, n_terms=12, dtype=F64)
    assert f64.dtype == F64 and f64.n_terms == 12


def test_problem_maps_reward_modeling_and_subsamples():
    model, _ = regression()
    X = torch.randn(10, 3, dtype=F64)
    y = torch.tensor([0, 1] * 5)
    problem = build(model, loader(X, y, 4), "reward_modeling", n_terms=10)
    assert problem.likelihood == "classification" and problem.scale == pytest.approx(0.1)
    sub = build(
        model, loader(X, y, 4), "classification", subsample_size=6,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert (sub.n_terms, sub.n_loader_terms) == (6, 10)
    assert sub.scale == pytest.approx(1 / 6)


def test_problem_refuses_an_empty_loader():
    model, _ = regression()
    X = torch.randn(4, 3, dtype=F64)
    y = torch.full((4,), -100)
    with pytest.raises(ValueError, match="The loader is empty"):
        build(model, loader(X, y, 2), "classification")


def test_planner_picks_factored_for_an_mlp_and_curvlinops_for_lanczos():
    model, data = regression()
    problem = build(model, data, dtype=F64)
    auto = plan_solve(problem, 3, "auto")
    assert isinstance(auto, Plan) and isinstance(auto.operator, FactoredGGN)
    # M = 12 Jacobian rows: the dual solve is the cheaper one and fits the default budget
    assert (auto.operator_name, auto.scale, auto.solver) == ("factored", 1.0, "dual")
    assert auto.strategy == "dual" and auto.budget_bytes > 0 and auto.n_data == 12
    factored = plan_solve(problem, 3, "factored")
    assert factored.solver == "lanczos" and isinstance(factored.operator, FactoredGGN)
    reference = plan_solve(problem, 3, "lanczos")
    assert isinstance(reference.operator.operator, GGNLinearOperator)  # in column chunks
    assert (reference.operator_name, reference.solver, reference.strategy) == (
        "curvlinops",
        "lanczos",
        "streaming",
    )
    assert reference.scale == problem.scale


def test_planner_linearises_a_recurrent_model():
    model = Recurrent().to(F64).eval()
    X = torch.randn(6, 5, 3, dtype=F64)
    y = torch.randn(6, 2, dtype=F64)
    problem = build(model, loader(X, y, 3), dtype=F64)
    with autodiff_friendly(model):
        plan = plan_solve(problem, 2, "auto")
        with pytest.warns(UserWarning, match=r"solver='dual' needs the factored GGN"):
            dual = plan_solve(problem, 2, "dual")
    # every product a pass over the data: Lanczos as the one-column block solver (its
    # images kept, so no residual-check products)
    assert isinstance(plan.operator, LinearizedGGN) and plan.solver == "block"
    assert plan.block_size == 1
    assert plan.operator_name.startswith("linearised (not factored: LSTM parameters")
    assert plan.reasons and "LSTM" in plan.reasons[0]
    assert dual.solver == "block" and isinstance(dual.operator, LinearizedGGN)
    block = plan_solve(problem, 2, "block", block_size=3)  # the caller's block size
    assert block.solver == "block" and block.block_size is None


@pytest.mark.parametrize(
    "backend, cls, name",
    [
        (CurvlinopsEF, EFLinearOperator, "curvlinops EF"),
        (CurvlinopsHessian, HessianLinearOperator, "curvlinops Hessian"),
    ],
)
def test_planner_serves_ef_and_hessian_backends_with_curvlinops(backend, cls, name):
    model, data = regression()
    problem = build(model, data, dtype=F64)
    choice = resolve_backend(backend)
    plan = plan_solve(problem, 3, "auto", choice)
    assert isinstance(plan.operator.operator, cls) and plan.operator_name == name
    assert plan.strategy == "streaming"
    assert (plan.solver, plan.curvature, plan.scale) == ("lanczos", choice.kind, problem.scale)
    assert plan_solve(problem, 3, "block", choice).solver == "block"


def test_the_plan_reaches_lanczos_info_and_survives_the_state_dict():
    model, data = regression()
    la = ActiveSubspaceLaplace(model, "regression", n_components=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    info = la.lanczos_info
    assert info.plan["operator"] == info.operator == "factored"
    assert info.plan["solver"] == info.solver and info.plan["curvature"] == "ggn"
    assert info.plan["n_data"] == la.n_data == 12 and info.plan["budget_bytes"] > 0
    assert Eigenpairs.from_dict(info.to_dict()).plan == info.plan
    la2 = ActiveSubspaceLaplace(model, "regression", n_components=3)
    la2.load_state_dict(la.state_dict())
    assert la2.lanczos_info.plan == info.plan
    old = info.to_dict()
    del old["plan"]  # a record written before plans were recorded
    assert Eigenpairs.from_dict(old).plan is None


def test_compute_eigenpairs_after_fit_recounts_n_and_records_the_plan():
    model, data = regression()
    la = ActiveSubspaceLaplace(model, "regression", n_components=3, solver="lanczos")
    la.fit(data)
    X = torch.randn(7, 3, dtype=F64)
    again = la.compute_eigenpairs(loader(X, model(X).detach(), 3))
    assert again.n_data == 7 and again.plan["n_data"] == 7
    assert (again.plan["operator"], again.plan["solver"]) == ("curvlinops", "lanczos")


@pytest.mark.parametrize("show", [False, True])
@pytest.mark.parametrize("model_name", ["mlp", "recurrent"])
def test_a_fit_starts_one_iterator_of_a_small_loader(model_name, show):
    # the planner's one-batch measurements (the batch-size function, the streaming
    # estimate's forward graph, the complement's and the Jacobians' first-batch checks)
    # each started an iterator of the loader, with num_workers > 0 a set of worker
    # processes: 6 for the MLP's and the LSTM's default fits (the MLP's 9 with the
    # progress bars' own; the LSTM's vmap was refused on its first batch inside a
    # pass); then the pass at the MAP and the operator's pass (and for the LSTM the GGN
    # diagonal's pass that decides the complement); now the pass at the MAP keeps the
    # batches and the later passes replay them: one iterator, as KronLaplace's fit
    g = torch.Generator().manual_seed(0)
    if model_name == "mlp":
        model = mlp([3, 8, 2], dtype=F64).eval()
        X = torch.randn(12, 3, generator=g, dtype=F64)
    else:
        model = Recurrent().to(F64).eval()
        X = torch.randn(12, 5, 3, generator=g, dtype=F64)
    data = torch.utils.data.TensorDataset(X, torch.randn(12, 2, generator=g, dtype=F64))
    CountingLoader.started = 0
    la = ActiveSubspaceLaplace(model, "regression", n_components=2)
    la.fit(CountingLoader(data, batch_size=5), progress_bar=show)
    assert CountingLoader.started == 1
    assert la.lanczos_info.plan["strategy"] == ("dual" if model_name == "mlp" else "linearised")


def test_the_first_batch_is_kept_for_the_loader_itself_only():
    model, data = regression()
    first = next(iter(data))
    problem = build(model, data, first_batch=first)
    assert problem.first_batch is first
    (X, y), *rest = list(problem.first_data())
    assert not rest and torch.equal(X, first[0]) and torch.equal(y, first[1])
    assert build(model, data).first_batch is None  # unknown: the data's own first
    assert torch.equal(next(iter(build(model, data).first_data()))[0], first[0])
    sub = build(
        model, data, first_batch=first, subsample_size=6, generator=torch.Generator().manual_seed(0)
    )
    assert sub.first_batch is None  # a subsample's first batch is another
