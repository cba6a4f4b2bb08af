"""Batch sizes known without a pass, and the planner's projections from the first batch
of a loader whose batches differ in size."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from conftest import mlp
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    TensorDataset,
)

from laplace_glas import MemoryBudgetError
from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.batches import SubBatches, XYBatches
from laplace_glas.curvature.data.example_counts import BatchSizes, survey_batch_sizes
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.budget import OverBudget, gram_build_numbers
from laplace_glas.curvature.memory.planner import plan_solve
from laplace_glas.curvature.operators.graph_bytes import forward_graph_bytes
from laplace_glas.curvature.operators.linearized import build_linearized_ggn

F64 = torch.float64
WIDTHS = [3, 64, 64, 2]  # D = 4,546: the dual solve is the cheaper for 610 rows


def _dataset(n, d=3):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 2, dtype=F64))


@pytest.mark.parametrize(
    ("n", "b", "drop_last", "expected"),
    [
        (100, 32, False, ((4, 1), (32, 3))),
        (100, 32, True, ((32, 3),)),
        (96, 32, False, ((32, 3),)),
        (5, 32, False, ((5, 1),)),
    ],
)
def test_a_data_loader_s_sizes_come_from_its_batch_size_and_sampler(n, b, drop_last, expected):
    data = DataLoader(_dataset(n), batch_size=b, drop_last=drop_last)
    sizes = survey_batch_sizes(data)
    assert sizes.counts == expected and sizes.first == min(b, n)
    # what iterating it gives
    assert sorted(len(X) for X, _ in data) == sorted(s for s, n in expected for _ in range(n))


def test_a_list_of_batches_is_read_batch_by_batch():
    batches = [(torch.zeros(b, 3), torch.zeros(b, 2)) for b in (5, 400, 120)]
    sizes = survey_batch_sizes(batches)
    assert sizes == BatchSizes(5, ((5, 1), (120, 1), (400, 1)))
    assert (sizes.largest, sizes.examples, sizes.batches) == (400, 525, 3)
    mapping = tuple({"input_ids": torch.zeros(b, 7), "labels": torch.zeros(b)} for b in (3, 9))
    assert survey_batch_sizes(mapping) == BatchSizes(3, ((3, 1), (9, 1)))
    assert survey_batch_sizes(XYBatches(batches)) == sizes
    # slices of at most 100 examples, as SubBatches cuts them
    sliced = SubBatches(batches, 100)
    assert survey_batch_sizes(sliced) == BatchSizes(5, ((5, 1), (20, 1), (100, 5)))
    assert sorted(len(X) for X, _ in XYBatches(sliced)) == [5, 20, *[100] * 5]


def test_loaders_whose_sizes_need_a_pass_are_not_surveyed():
    dataset = _dataset(10)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(dataset)

    for unknown in (
        DataLoader(Stream(), batch_size=4),
        (batch for batch in [dataset[:4]]),
        [],
        [(torch.zeros(0, 3), torch.zeros(0, 2))],
    ):
        assert survey_batch_sizes(unknown) is None


def test_a_batch_sampler_s_index_batches_are_counted_without_the_data_or_the_rng():
    dataset = _dataset(100)
    custom = DataLoader(dataset, batch_sampler=[list(range(60)), *[[i] for i in range(60, 100)]])
    assert survey_batch_sizes(custom) == BatchSizes(60, ((1, 40), (60, 1)))
    shuffled = BatchSampler(RandomSampler(dataset), batch_size=30, drop_last=False)
    torch.manual_seed(5)
    sizes = survey_batch_sizes(DataLoader(dataset, batch_sampler=shuffled))
    drawn_after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), drawn_after)  # the global random state restored
    assert sizes == BatchSizes(30, ((10, 1), (30, 3)))


def test_projections_scale_by_examples_and_a_fixed_share_by_batches():
    sizes = BatchSizes(first=5, counts=((5, 1), (400, 5)))
    assert sizes.to_loader(10) == 4010 and sizes.to_largest(10) == 800
    assert sizes.to_loader(3) == -(-3 * 2005 // 5)  # rounded up
    # 4 of 10 bytes whatever the batch's size: 6 x 4 + 6 x 2005 / 5
    assert sizes.to_loader(10, fixed=4) == 24 + 2406 and sizes.to_largest(10, fixed=4) == 484
    assert sizes.sliced(100) == BatchSizes(5, ((5, 1), (100, 20)))


class _Sized:
    """A re-iterable loader with a length whose batch sizes the survey cannot read."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _uneven(wrap=list, sizes=(5, 60, 60, 60, 60, 60)):
    """A float64 3-64-64-2 MLP on batches of ``sizes`` examples (the first short)."""
    g = torch.Generator().manual_seed(0)
    model = mlp(WIDTHS, dtype=F64).eval()
    batches = [
        (torch.randn(b, 3, generator=g, dtype=F64), torch.randn(b, 2, generator=g, dtype=F64))
        for b in sizes
    ]
    data = wrap(batches)
    problem = CurvatureProblem.build(
        model, list(model.parameters()), data, "regression", torch.Size([2]), dtype=F64
    )
    return problem, sum(sizes)


def _plan(problem, budget, k=3):
    with warnings.catch_warnings(), autodiff_friendly(problem.model):
        warnings.simplefilter("ignore")
        return plan_solve(problem, k, memory_budget=budget)


def _even(n):
    """The same model on ``n`` examples in batches of 60 (a DataLoader)."""
    model = mlp(WIDTHS, dtype=F64).eval()
    data = DataLoader(_dataset(n), batch_size=60)
    return CurvatureProblem.build(
        model, list(model.parameters()), data, "regression", torch.Size([2]), dtype=F64
    )


def test_a_short_first_batch_projects_to_the_loader_s_examples():
    uneven, n = _uneven()
    plan = _plan(uneven, 2**30)
    even = _plan(_even(n), 2**30)
    assert (plan.strategy, even.strategy) == ("dual", "dual")
    # the same examples: the same estimates, though the first batch is 12 times shorter
    assert dict(plan.estimates)["dual"] == dict(even.estimates)["dual"]
    assert dict(plan.estimates)["factored"] == dict(even.estimates)["factored"]
    M = n * 2  # two output rows per example
    assert plan.estimated_peak >= gram_build_numbers(M) * 8  # the whole Gram matrix counted


def test_the_smallest_budget_named_for_a_short_first_batch_is_not_refused_again():
    uneven, _ = _uneven()
    with pytest.raises(MemoryBudgetError) as refused:
        _plan(uneven, 1)
    smallest = refused.value.smallest
    # a product's cost counts the single-example slices of all 305 examples
    assert "(305 forward and backward passes of one example)" in str(refused.value)
    plan = _plan(uneven, smallest)
    assert plan.estimated_peak <= smallest
    # streams the batches in slices sized from the largest batch, not the first
    assert plan.strategy == "streaming"
    # slices of one example: the kept graphs' refusal counts the 305 slices there are
    # (the slices of a full batch times the batches made 6 x 60)
    assert any("projected from 1 of 305 slices" in reason for reason in plan.reasons)


def test_built_factors_larger_than_their_projection_are_decided_on_again():
    # a loader with a length whose sizes the survey cannot read: the first batch (5
    # examples) projects the Gram matrix of 6 x 5 examples; the built factors hold 305
    loose, _ = _uneven(_Sized)
    surveyed, _ = _uneven()
    right = dict(_plan(surveyed, 2**30).estimates)
    # a budget between the first batch's projection and the built factors' dual estimate
    budget = right["dual"] - 1
    plan = _plan(loose, budget)
    assert plan.strategy != "dual"
    assert dict(plan.estimates)["dual"] >= right["dual"]
    assert plan.estimated_peak <= budget


def test_kept_graphs_refused_after_a_short_first_batch_need_the_whole_loader_s_share():
    uneven, _ = _uneven()
    sizes = survey_batch_sizes(uneven.loader)
    with autodiff_friendly(uneven.model):
        kept = build_linearized_ggn(uneven.loss_on_data(), budget_bytes=2**30)
        refused = build_linearized_ggn(uneven.loss_on_data(), budget_bytes=1, batch_sizes=sizes)
        by_batches = build_linearized_ggn(uneven.loss_on_data(), budget_bytes=1)
    assert isinstance(refused, OverBudget) and isinstance(by_batches, OverBudget)
    # projected from the first batch's 5 examples to all 305, each batch's pullback (D
    # numbers) and heap pages (one per storage), whatever its size, to every batch: the
    # kept graphs' bytes and pages to 1%
    assert refused.needed - refused.batch_bytes == pytest.approx(kept.resident_bytes, rel=0.01)
    per_batch = [b.saved_bytes for b in _kept_batches(uneven)]
    assert refused.batch_bytes == pytest.approx(max(per_batch), rel=0.01)  # the largest's
    assert by_batches.needed < 0.6 * kept.resident_bytes  # six first batches: 30 examples


def _kept_batches(problem):
    """The kept graphs of each batch of ``problem`` alone."""
    loss = problem.loss_on_data()
    with autodiff_friendly(problem.model):
        for batch in problem.loader:
            yield build_linearized_ggn(replace(loss, data=XYBatches([batch])), budget_bytes=2**30)


def test_a_refusal_of_kept_graphs_on_sliced_batches_counts_slices():
    uneven, _ = _uneven()
    sliced = SubBatches(uneven.loader, 20)
    loss = replace(uneven.loss_on_data(), data=XYBatches(sliced))
    with autodiff_friendly(uneven.model):
        reason = build_linearized_ggn(loss, budget_bytes=1000)
    assert isinstance(reason, OverBudget)
    assert f"projected from 1 of {len(sliced)} slices and" in reason
    assert "1000 B of the budget left for them" in reason  # the room, not the budget


def test_batches_sliced_from_one_tensor_count_only_their_rows():
    # a list of views X[i : i + b] of one data set: each batch holds b rows of memory,
    # not the data set's (which was counted, then scaled to the largest batch)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(1000, 3, generator=g, dtype=F64), torch.randn(1000, 2, dtype=F64)
    model = mlp(WIDTHS, dtype=F64).eval()
    views = [(X[i : i + 100], y[i : i + 100]) for i in range(0, 1000, 100)]
    copies = [(a.clone(), b.clone()) for a, b in views]
    assert forward_graph_bytes(model, views) == forward_graph_bytes(model, copies)
    problems = [
        CurvatureProblem.build(model, list(model.parameters()), data, "regression",
                               torch.Size([2]), dtype=F64)
        for data in (views, copies)
    ]  # fmt: skip
    with autodiff_friendly(model):
        kept = [build_linearized_ggn(p.loss_on_data(), budget_bytes=2**30) for p in problems]
    # the views' rows are counted once per storage (the data set exists anyway), the
    # copies' once per batch: never more for the views, at most the data set less
    data_set = X.nbytes + y.nbytes
    assert 0 <= kept[1].saved_bytes - kept[0].saved_bytes <= data_set


class _Unsized:
    """A re-iterable loader without a length."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_a_loader_without_a_length_is_estimated_as_one_with_it():
    # the same equal batches: the estimate after the build counts the join's layer, as
    # the first batch's projection does
    sized, _ = _uneven(_Sized, sizes=(60,) * 5)
    unsized, _ = _uneven(_Unsized, sizes=(60,) * 5)
    by_length = dict(_plan(sized, 2**30).estimates)
    built = dict(_plan(unsized, 2**30).estimates)
    for strategy in ("factored", "dual"):
        assert built[strategy] == pytest.approx(by_length[strategy], rel=0.01)
