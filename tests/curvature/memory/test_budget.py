"""The memory budget: parsing, the planner's choice under budgets, exactness, records."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from conftest import loader, mlp, mlp_problem, output_jacobian, softmax_ggn
from laplace import Laplace
from torch import nn

import laplace_glas
from laplace_glas import ActiveSubspaceLaplace, MemoryBudgetError
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.batches import SubBatches, slices_agree
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory import budget as budget_module
from laplace_glas.curvature.memory.budget import format_bytes, resolve_budget, solver_storage
from laplace_glas.curvature.memory.peak import PeakMemory
from laplace_glas.curvature.memory.planner import STRATEGIES, plan_solve
from laplace_glas.curvature.operators.torch_operator import ColumnChunks
from laplace_glas.settings import parse_memory_budget as memory_budget
from laplace_glas.validation import ArgumentTypeError

F64 = torch.float64


# ---------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (4096, 4096),
        (2.5e3, 2500),
        (1.5, 1),  # fractions of a byte rounded down
        ("512MB", 512 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("64 MiB", 64 * 2**20),
        (" 2 kib ", 2048),
        ("1000000", 10**6),
        ("1e3 kB", 10**6),
        ("3b", 3),
    ],
)
def test_memory_budget_parses_bytes_and_unit_strings(value, expected):
    assert memory_budget(value) == expected


@pytest.mark.parametrize("value", [0, -5, "0.5", "", "MB", "-3MB", "5 XB", "12 MiBs", "inf"])
def test_memory_budget_refuses_bad_values_naming_the_accepted_forms(value):
    with pytest.raises(ValueError, match=r"memory_budget must be .*'512MB', '1\.5GiB'"):
        memory_budget(value)


@pytest.mark.parametrize("value", [True, [64], b"64MB"])
def test_memory_budget_refuses_other_types(value):
    with pytest.raises(
        ArgumentTypeError,
        match=r"memory_budget must be a number of bytes >= 1 \(fractions rounded down\)",
    ):
        memory_budget(value)


def test_the_constructor_and_the_factory_take_the_budget():
    model = mlp([2, 4, 1])
    assert ActiveSubspaceLaplace(model, "regression", memory_budget="1GiB").memory_budget == 2**30
    la = Laplace(model, "regression", hessian_structure="glas", memory_budget=1234)
    assert la.memory_budget == 1234
    assert ActiveSubspaceLaplace(model, "regression").memory_budget is None
    with pytest.raises(ValueError, match="memory_budget must be"):
        ActiveSubspaceLaplace(model, "regression", memory_budget="lots")
    assert issubclass(MemoryBudgetError, ValueError) and laplace_glas.MemoryBudgetError


def test_the_default_budget_is_half_the_free_memory(monkeypatch):
    monkeypatch.setattr(budget_module, "_meminfo_available", lambda: 10_000)
    monkeypatch.setattr(budget_module, "_cgroup_free", lambda: None)
    assert budget_module.free_memory("cpu") == 10_000
    assert resolve_budget(None, "cpu") == 5_000 and resolve_budget(77, "cpu") == 77
    monkeypatch.setattr(budget_module, "_cgroup_free", lambda: 4_000)  # a container's limit
    assert resolve_budget(None, "cpu") == 2_000


def test_solver_storage_counts_the_basis():
    D, k, s = 1000, 10, 4
    assert solver_storage("lanczos", D, k, s) == (21 + 5 * k + 8) * D * s
    assert solver_storage("lanczos", D, k, s, ncv=24) == (24 + 5 * k + 8) * D * s
    p, basis = 10, 30  # block_size max(k, 8); max_basis max(2k + p, 3p)
    assert solver_storage("block", D, k, s) == (2 * basis + 3 * p + 3 * k) * D * s
    # one column per pass (the linearised operator's Lanczos): ARPACK's basis, kept
    # with its images; 'lanczos' counts the larger of the two
    one = (2 * 30 + 3 + 3 * k) * D * s
    assert solver_storage("block", D, k, s, ncv=30, block_size=1) == one
    assert solver_storage("lanczos", D, k, s, ncv=30) == one > (30 + 5 * k + 8) * D * s
    assert solver_storage("block", D, k, s, block_size=1) == (2 * 21 + 3 + 3 * k) * D * s


def test_column_chunks_equal_the_whole_product():
    A = torch.randn(7, 7, dtype=F64)
    A = A @ A.T

    class Dense:
        shape = (7, 7)

        def __init__(self):
            self.calls = []

        def __matmul__(self, V):
            self.calls.append(V.shape[1])
            return A @ V

    inner = Dense()
    op = ColumnChunks(inner, 2, F64, "cpu")
    V = torch.randn(7, 5, dtype=F64)
    torch.testing.assert_close(op @ V, A @ V, rtol=1e-14, atol=1e-14)
    assert inner.calls == [2, 2, 1]
    torch.testing.assert_close(torch.from_numpy(op.matvec(V[:, 0].numpy())), A @ V[:, 0])


def test_peak_memory_measures_an_allocation():
    with PeakMemory("cpu") as peak:
        block = torch.ones(64 * 2**20 // 8, dtype=F64)  # 64 MiB, touched
        del block
    if peak.method == "none":
        pytest.skip("no VmHWM on this system")
    assert peak.method == "VmHWM" and peak.bytes >= 60 * 2**20


# ---------------------------------------------------------------------- planner
class _Recurrent(nn.Module):
    """Not factored: the linearised operator or streaming."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _plan(problem, budget, k=3, solver="auto"):
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        return plan_solve(problem, k, solver, memory_budget=budget)


def _estimates(problem, k=3):
    with pytest.raises(MemoryBudgetError) as refused:
        _plan(problem, 1, k)
    return refused.value


def test_the_planner_takes_the_fastest_strategy_that_fits_each_budget():
    _, _, problem = mlp_problem()
    refused = _estimates(problem)
    est = refused.estimates
    # the Jacobian's estimate counts only once its build succeeded (not over budget)
    assert set(est) == set(STRATEGIES) - {"jacobian"} and all(b > 0 for b in est.values())
    # streaming holds one batch's graph: the smallest; the factors all N examples
    assert refused.smallest == est["streaming"] == min(est.values())
    large = _plan(problem, max(est.values()))
    assert large.strategy in ("dual", "factored") and large.solver == large.strategy.replace(
        "factored", "lanczos"
    )
    fast = min(est["dual"], est["factored"])
    below = _plan(problem, fast - 1)  # no factored solve fits: the next strategy that does
    # judged by the estimates at this budget: below the whole batches' streaming estimate
    # (budget 1 above) every strategy projects from slices of the batches
    at = dict(below.estimates)
    assert at["dual"] > fast - 1 and at["factored"] > fast - 1
    expected = "linearised" if at["linearised"] <= fast - 1 else "streaming"
    assert below.strategy == expected
    if est["linearised"] < fast:
        assert _plan(problem, est["linearised"]).strategy == "linearised"
    tight = _plan(problem, refused.smallest)  # the named budget works
    assert tight.strategy == "streaming" and tight.operator_name.startswith("curvlinops")
    assert tight.estimated_peak == refused.smallest <= tight.budget_bytes
    for plan in (large, below, tight):
        assert plan.estimated_peak <= plan.budget_bytes
        assert dict(plan.estimates)[plan.strategy] <= plan.estimated_peak


def test_a_budget_below_every_strategy_names_the_smallest_that_works():
    _, _, problem = mlp_problem()
    smallest = _estimates(problem).smallest
    with pytest.raises(MemoryBudgetError, match=rf"memory_budget={smallest} ") as refused:
        _plan(problem, smallest - 1)
    assert refused.value.smallest == smallest and refused.value.budget == smallest - 1
    message = str(refused.value)
    # the cost named: k = 3 pairs, 6-27 products, each 48 passes of one example
    assert "a solve of 3 pairs takes some 6-27 products" in message
    assert "each a pass over the data (48 forward and backward passes of one example)" in message
    # the batches were sliced to single examples: no advice to shrink them further
    assert "batches cut into slices of 1 (" in message  # the estimates are the slices'
    assert "already cuts the batches into single examples" in message
    assert "smaller batches" not in message
    # an estimate and a budget 1% apart read differently
    assert format_bytes(smallest) != format_bytes(0.99 * smallest)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (3 * 2**10, "3.00 KiB"), (300 * 2**10, "300 KiB"),
     (3_125_728, "2.98 MiB"), (64 * 2**20, "64.0 MiB"), (560 * 2**20, "560 MiB"),
     (5 * 2**30, "5120 MiB"), (12 * 2**30, "12.0 GiB")],
)  # fmt: skip
def test_format_bytes_keeps_three_significant_digits(n, text):
    assert format_bytes(n) == text


def test_the_smallest_budget_named_works_where_it_is_the_dual_solves():
    # many pairs of few examples: the Gram matrix is small, Lanczos's basis is not
    _, _, problem = mlp_problem(n=20, batch=10)
    refused = _estimates(problem, k=20)
    est = refused.estimates
    assert refused.smallest == est["dual"] < min(est["factored"], est["streaming"])
    assert "products stream" not in str(refused)  # the smallest does not stream
    plan = _plan(problem, refused.smallest, k=20)  # the factors' cap left no room before
    assert (plan.strategy, plan.solver) == ("dual", "dual")
    assert plan.estimated_peak <= refused.smallest


def test_a_dual_plans_peak_counts_the_temporaries_of_its_k_columns_not_the_budget():
    _, _, problem = mlp_problem()
    for budget in (2**30, 2**24):
        plan = _plan(problem, budget)
        assert (plan.strategy, plan.solver) == ("dual", "dual")
        # the dual solve multiplies k = 3 columns at a time: its peak grows by their
        # temporaries beyond the estimate's one column, whatever the budget leaves
        grown = plan.estimated_peak - dict(plan.estimates)["dual"]
        assert 0 <= grown <= 2 * 8 * (3 - 1) * plan.operator.widest


def test_a_model_that_is_not_factored_linearises_then_streams():
    torch.manual_seed(0)
    model = _Recurrent().to(F64).eval()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(40, 5, 3, generator=g, dtype=F64), torch.randn(40, 2, generator=g, dtype=F64)
    problem = CurvatureProblem.build(
        model, list(model.parameters()), loader(X, y, 10), "regression", torch.Size([2]), dtype=F64
    )
    refused = _estimates(problem)
    est = refused.estimates
    assert set(est) == {"linearised", "streaming"} and est["streaming"] < est["linearised"]
    # est: on one-example slices (no whole batch streams within 1 byte); the whole
    # batches' estimates are those of a plan with room for them
    whole = _plan(problem, est["linearised"])
    assert whole.strategy == "linearised" and "slices" not in whole.operator_name
    linearised = dict(whole.estimates)["linearised"]
    assert _plan(problem, linearised).strategy == "linearised"
    assert _plan(problem, linearised - 1).strategy == "streaming"
    streaming = _plan(problem, est["streaming"])
    assert streaming.strategy == "streaming"  # of curvlinops' products: no factors here
    assert streaming.operator_name.startswith("curvlinops")


def test_a_requested_dual_solve_beyond_the_budget_becomes_lanczos():
    _, _, problem = mlp_problem()
    est = _estimates(problem).estimates
    if est["dual"] <= est["factored"]:
        pytest.skip("the Gram matrix is the smaller here")
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        with pytest.warns(UserWarning, match="Gram matrix does not fit"):
            plan = plan_solve(problem, 3, "dual", memory_budget=est["factored"])
    assert (plan.strategy, plan.solver) == ("factored", "lanczos")


# ---------------------------------------------------------------------- fits
def _fit(model, data, **kwargs):
    la = ActiveSubspaceLaplace(model, "regression", n_components=3, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    return la


def test_a_tight_budget_costs_time_not_exactness():
    model, data, problem = mlp_problem()
    smallest = _estimates(problem).smallest
    free = _fit(model, data)
    tight = _fit(model, data, memory_budget=smallest)
    assert free.lanczos_info.strategy in ("dual", "factored")
    assert tight.lanczos_info.strategy == "streaming"
    torch.testing.assert_close(tight.eigenvalues, free.eigenvalues, rtol=1e-6, atol=0)
    X = torch.cat([X for X, _ in data])
    _, J = output_jacobian(model, X)  # unit-noise mean-loss GGN: (1/N) sum J^T J
    dense = torch.einsum("ncd,nce->de", J, J) / X.shape[0]
    reference = torch.linalg.eigvalsh(dense).flip(0)[:3]
    torch.testing.assert_close(tight.eigenvalues, reference, rtol=1e-6, atol=0)
    overlap = (tight.eigenvectors.T @ free.eigenvectors).abs().diagonal()
    torch.testing.assert_close(overlap, torch.ones(3, dtype=F64), rtol=0, atol=1e-6)


def test_the_record_holds_the_budget_the_strategy_and_the_peaks():
    model, data, _ = mlp_problem()
    la = _fit(model, data, memory_budget="256 MiB")
    info = la.lanczos_info
    assert info.memory_budget == 256 * 2**20 and info.plan["budget_bytes"] == 256 * 2**20
    assert info.strategy in STRATEGIES and info.strategy == info.plan["strategy"]
    assert 0 < info.estimated_peak_bytes <= info.memory_budget
    assert info.plan["peak_method"] in ("VmHWM", "cuda", "none")
    if info.plan["peak_method"] == "none":
        assert info.measured_peak_bytes is None and info.plan["measured_peak_bytes"] == -1
    else:
        assert 0 <= info.measured_peak_bytes < 2**31
    again = la.compute_eigenpairs(data)
    assert again.strategy == info.strategy and again.plan["peak_method"] == info.plan["peak_method"]
    default = _fit(model, data).lanczos_info  # half the free memory: positive, recorded
    assert default.memory_budget > 0 and default.estimated_peak_bytes <= default.memory_budget


def test_a_measured_peak_beyond_the_budget_and_its_slack_warns():
    from types import SimpleNamespace

    from laplace_glas.curvature.memory.budget import HOST_SLACK
    from laplace_glas.curvature.memory.peak import with_measured_peak

    model, data, _ = mlp_problem()
    info = _fit(model, data, memory_budget="256 MiB").lanczos_info
    budget = 256 * 2**20

    def measured(n_bytes, method):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = with_measured_peak(info, SimpleNamespace(bytes=n_bytes, method=method))
        return out, [str(w.message) for w in caught if "measured peak" in str(w.message)]

    out, said = measured(budget + HOST_SLACK + 2**20, "VmHWM")
    assert out.measured_peak_bytes == budget + HOST_SLACK + 2**20 and len(said) == 1
    smaller = budget - HOST_SLACK - 2**20  # as far below the budget as the peak was above
    assert f"memory_budget={budget} (256 MiB) by 33.0 MiB" in said[0]
    assert f"the {info.strategy} strategy's estimate" in said[0]
    assert f"memory_budget={smaller} " in said[0]
    assert measured(budget + HOST_SLACK, "VmHWM")[1] == []  # within the process's slack
    # an overrun beyond half the budget: no budget is named (it would not be sure to hold)
    said = measured(3 * budget, "VmHWM")[1]
    assert len(said) == 1 and "no smaller budget is sure to hold" in said[0]
    assert "leaves the missing room" not in said[0]
    assert len(measured(budget + 1, "cuda")[1]) == 1  # the allocator's own count: no slack
    assert measured(None, "none")[1] == []
    unbudgeted = replace(info, plan={**info.plan, "budget_bytes": -1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_measured_peak(unbudgeted, SimpleNamespace(bytes=2**40, method="VmHWM"))


def test_a_state_saved_before_budgets_still_loads():
    model, data, _ = mlp_problem()
    la = _fit(model, data, memory_budget="256 MiB")
    state = la.state_dict()
    la2 = ActiveSubspaceLaplace(model, "regression", n_components=3)
    la2.load_state_dict(state)
    assert la2.lanczos_info.plan == la.lanczos_info.plan
    old_keys = ("strategy", "estimated_peak_bytes", "estimates", "measured_peak_bytes")
    record = []
    for key, value in state["eigenpairs"]:
        if key == "plan":
            value = tuple((k, v) for k, v in value if k not in (*old_keys, "peak_method"))
        record.append((key, value))
    state["eigenpairs"] = tuple(record)
    la3 = ActiveSubspaceLaplace(model, "regression", n_components=3)
    la3.load_state_dict(state)
    info = la3.lanczos_info
    assert (info.strategy, info.estimated_peak_bytes, info.measured_peak_bytes) == (None,) * 3
    assert info.memory_budget == 256 * 2**20
    torch.testing.assert_close(la3.eigenvalues, la.eigenvalues)


def test_a_fit_refused_by_its_budget_leaves_the_posterior_as_it_was():
    model, data, problem = mlp_problem()
    smallest = _estimates(problem).smallest
    la = ActiveSubspaceLaplace(model, "regression", n_components=3, memory_budget=smallest - 1)
    with pytest.raises(MemoryBudgetError, match=f"memory_budget={smallest} "):
        la.fit(data)
    assert not hasattr(la, "eigenvalues")  # still unfitted
    fitted = _fit(model, data)
    before = fitted.eigenvalues.clone()
    fitted.memory_budget = smallest - 1
    with pytest.raises(MemoryBudgetError):
        fitted.fit(data)
    assert torch.equal(fitted.eigenvalues, before)
    assert fitted.lanczos_info.strategy in ("dual", "factored")
    fitted.memory_budget = "a lot"  # set after the constructor: checked at the fit
    with pytest.raises(ValueError, match="memory_budget must be"):
        fitted.fit(data)
    fitted.memory_budget = "256 MiB"
    fitted.fit(data)
    assert fitted.lanczos_info.memory_budget == 256 * 2**20


# ---------------------------------------------------------------------- slices
class _LoraAttention(nn.Module):
    """A one-layer transformer classifier on mapping batches: frozen embedding and
    attention block, a trainable low-rank adapter (LoRA-like) on the embeddings and a
    trainable head.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        for p in self.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, X):
        h = self.embed(X["input_ids"])
        h = self.block(h + self.lora_B(self.lora_A(h)))
        return self.head(h.mean(1))


def _lora_problem(n: int = 24, batch: int = 8):
    torch.manual_seed(0)
    model = _LoraAttention().to(F64).eval()
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 20, (n, 6), generator=g), torch.randint(0, 3, (n,), generator=g)
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]
    data = torch.utils.data.DataLoader(rows, batch_size=batch)
    params = [p for p in model.parameters() if p.requires_grad]
    problem = CurvatureProblem.build(
        model, params, data, "classification", torch.Size([3]), dtype=F64
    )
    return model, data, problem, ids, labels


def test_a_budget_below_a_whole_batch_streams_slices_of_it_exactly():
    model, data, problem, ids, labels = _lora_problem()
    refused = _estimates(problem)
    smallest = refused.smallest
    whole = _plan(problem, 2**40, solver="lanczos").estimated_peak  # of whole batches
    assert whole > smallest  # one batch's graph does not fit
    tight = _plan(problem, smallest)
    assert tight.strategy == "streaming" and "slices of 1)" in tight.operator_name
    assert tight.estimated_peak == smallest
    # a budget between: the fewest equal slices that fit (the reference solver streams)
    mid = (smallest + whole) // 2
    between = _plan(problem, mid, solver="lanczos")
    assert between.strategy == "streaming" and between.estimated_peak <= mid
    size = int(between.operator_name.rsplit("slices of ", 1)[1].rstrip(")"))
    assert 1 < size < 8

    def fit(**kwargs):
        la = ActiveSubspaceLaplace(model, "classification", n_components=3, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.fit(data)
        return la

    free = fit()
    for budget, solver in ((smallest, "auto"), (mid, "lanczos")):
        la = fit(memory_budget=budget, solver=solver)
        info = la.lanczos_info
        assert info.strategy == "streaming" and "slices of" in str(info.operator)
        torch.testing.assert_close(la.eigenvalues, free.eigenvalues, rtol=1e-6, atol=0)
        if info.plan["peak_method"] == "VmHWM":  # the process warmed up by the fit above
            assert info.measured_peak_bytes <= budget + budget_module.HOST_SLACK
    X = {"input_ids": ids}
    out, J = output_jacobian(model, X)
    ggn, N = softmax_ggn(out, J, labels)
    reference = torch.linalg.eigvalsh(ggn / N).flip(0)[:3]
    torch.testing.assert_close(la.eigenvalues, reference, rtol=1e-6, atol=0)


def test_a_budget_below_one_example_names_the_smallest_that_then_fits():
    model, data, problem, _, _ = _lora_problem()
    smallest = _estimates(problem).smallest
    la = ActiveSubspaceLaplace(model, "classification", n_components=3, memory_budget=smallest - 1)
    with pytest.raises(MemoryBudgetError, match=f"memory_budget={smallest} ") as refused:
        la.fit(data)
    assert refused.value.estimates["streaming"] == smallest
    la.memory_budget = smallest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(data)
    assert la.lanczos_info.strategy == "streaming"
    assert la.lanczos_info.estimated_peak_bytes <= smallest


class _BatchCentred(_LoraAttention):
    """Examples interact (the logits are centred over the batch): not to be sliced."""

    def forward(self, X):
        out = super().forward(X)
        return out - out.mean(0)


def test_a_model_whose_examples_interact_is_not_sliced():
    model, data, problem, _, _ = _lora_problem()
    centred = _BatchCentred().to(F64).eval()
    centred.load_state_dict(model.state_dict())
    params = [p for p in centred.parameters() if p.requires_grad]
    problem = CurvatureProblem.build(
        centred, params, data, "classification", torch.Size([3]), dtype=F64
    )
    whole = _plan(problem, 2**40, solver="lanczos").estimated_peak
    with pytest.raises(MemoryBudgetError) as refused:
        _plan(problem, whole - 1, solver="lanczos")
    assert refused.value.smallest == whole  # whole batches: no slice stands for them
    # the planner's own choice: the smallest budget it names streams whole batches too
    # (the linearised graphs rebuilt per batch, whose estimate lies below curvlinops')
    with pytest.raises(MemoryBudgetError) as refused:
        _plan(problem, 1)
    smallest = refused.value.smallest
    assert smallest < whole
    plan = _plan(problem, smallest)
    assert plan.strategy == "streaming" and plan.estimated_peak == smallest
    assert "rebuilt per batch" in plan.operator_name and "slices" not in plan.operator_name
    assert "slices" not in _plan(problem, whole).operator_name


def test_sub_batches_cut_every_batch_into_its_examples_in_order():
    X, y = torch.arange(10.0).view(10, 1), torch.arange(10)
    sliced = SubBatches(loader(X, y, 4), 3)
    parts = list(sliced)
    assert [len(b) for _, b in parts] == [3, 1, 3, 1, 2] and len(sliced) == 6  # bound
    assert torch.equal(torch.cat([x for x, _ in parts]), X)
    assert torch.equal(torch.cat([b for _, b in parts]), y)
    rows = [
        {"input_ids": torch.tensor([i, i]), "labels": torch.tensor(i), "n": 7} for i in range(5)
    ]
    mapped = list(SubBatches(torch.utils.data.DataLoader(rows, batch_size=4), 2))
    assert [m["labels"].tolist() for m in mapped] == [[0, 1], [2, 3], [4]]
    assert mapped[0]["input_ids"].shape == (2, 2) and torch.equal(
        mapped[0]["n"], torch.tensor([7, 7])
    )
    # a loader without batch_size: counted from the first batch's size the caller gives
    batches = [(X[:4], y[:4]), (X[4:8], y[4:8]), (X[8:], y[8:])]
    sliced = SubBatches(batches, 2, full=4)
    assert len(sliced) == 6 and len(list(sliced)) == 5  # a bound: the last batch is short
    assert len(SubBatches(loader(X, y, 4), 3, full=2)) == 6  # the loader's own size first
    model = mlp([1, 4, 2], dtype=torch.float32).eval()
    assert slices_agree(model, X, 3)
    assert not slices_agree(lambda x: model(x) - model(x).mean(0), X, 3)  # examples interact
    assert not slices_agree(lambda x: model(x).sum(0), X, 3)  # no batch axis out
