"""The training batches kept by the pass at the MAP and replayed by the fit's later passes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import CountingLoader, fit_quietly, mlp, mlp_problem, output_jacobian
from torch.utils.data import TensorDataset

from laplace_glas.curvature import fit as fit_module
from laplace_glas.curvature.data.example_counts import survey_batch_sizes
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.data.replay import OBJECT_BYTES as OBJECT
from laplace_glas.curvature.data.replay import BatchKeeper, ReplayedBatches, item_contents

F64 = torch.float64


def test_item_contents_counts_each_storage_once_the_objects_and_the_strings():
    t = torch.zeros(3, 4, dtype=F64)
    item = (t, t[1:], torch.zeros(5, dtype=torch.int64), t[:0])
    found = item_contents(item)
    assert sorted(found.storages.values()) == [40, 96]  # the views: t's storage, once
    assert len(found.spans) == 2  # t and its view merged; the empty view reads nothing
    assert found.objects == {id(x) for x in item} and found.other_bytes == 5 * OBJECT
    mapping = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "n": [1, np.int64(2)]}
    mapping["text"] = "abc"
    found = item_contents(mapping)
    assert list(found.storages.values()) == [48] and found.other_bytes == 3 + 3 * OBJECT
    assert found.objects == {id(mapping), id(mapping["input_ids"]), id(mapping["n"])}
    assert item_contents([np.zeros(4, dtype=np.float32), None]) is None
    assert item_contents((t, object())) is None  # a size not known: not kept


def test_the_keeper_keeps_a_pass_within_its_limit_or_none_of_it():
    def batch():
        return torch.zeros(10, dtype=F64)  # 80 bytes and a tensor's OBJECT

    each = 80 + OBJECT
    keeper = BatchKeeper(2 * each + 10)
    first = batch()
    keeper.add(first)
    keeper.add(batch())
    kept = keeper.kept()
    assert kept.nbytes == 2 * each and len(kept) == 2 and kept.items[0] is first
    keeper.add(batch())  # past the limit: every batch let go, also the later ones
    keeper.add(batch())
    assert keeper.kept() is None
    nothing = BatchKeeper(0)
    nothing.add(batch())
    assert nothing.kept() is None
    unknown = BatchKeeper(10**6)
    unknown.add((batch(), object()))
    unknown.add(batch())
    assert unknown.kept() is None
    assert BatchKeeper(10**6).kept() is None  # an empty pass
    rows = BatchKeeper(10**6)  # views of distinct rows of one tensor: kept, counted once
    data = torch.zeros(4, 10, dtype=F64)
    for i in range(4):
        rows.add((data[i], "a"))
    assert len(rows.kept()) == 4 and rows.nbytes == 320 + 4 * (2 * OBJECT + 1)


def _reusing_loaders():
    """Items that reuse an earlier item's memory or objects, by each way we know."""
    buffer = torch.zeros(10, dtype=F64)
    yield "refilled in place", [(buffer, "a"), (buffer[:5], "a")]
    same = [torch.zeros(3), torch.zeros(3)]
    yield "one list, new tensors", [same, same]
    swapped = torch.zeros(3)
    yield "one tensor, its storage swapped", [(swapped,), (swapped,)]
    mapping = {"x": torch.zeros(3)}
    yield "one mapping", [mapping, mapping]


@pytest.mark.parametrize("name, items", list(_reusing_loaders()))
def test_items_reusing_an_earlier_items_objects_or_memory_are_not_kept(name, items):
    keeper = BatchKeeper(10**6)
    for item in items:
        keeper.add(item)
    assert keeper.kept() is None, name


def test_each_replay_hands_out_fresh_containers_of_the_same_tensors():
    X = torch.zeros(2, 3)
    item = ({"input_ids": X, "labels": [X]}, X)
    keeper = BatchKeeper(10**6)
    keeper.add(item)
    replay = keeper.kept()
    first = next(iter(replay))
    first[0].pop("input_ids")  # a model taking a key out of its input mapping
    first[0]["labels"].clear()
    again = next(iter(replay))
    assert again[0]["input_ids"] is X and again[0]["labels"][0] is X and again[1] is X
    assert len(replay) == 1
    assert survey_batch_sizes(replay, "input_ids") == survey_batch_sizes([item], "input_ids")


class AugmentingLoader:
    """Fresh input noise on every pass (random augmentation); records each pass's inputs."""

    def __init__(self, X, y, batch_size):
        self.X, self.y, self.batch_size = X, y, batch_size
        self.generator = torch.Generator().manual_seed(1)
        self.passes: list[list[torch.Tensor]] = []

    def __len__(self):
        return -(-len(self.X) // self.batch_size)

    def __iter__(self):
        seen: list[torch.Tensor] = []
        self.passes.append(seen)
        for start in range(0, len(self.X), self.batch_size):
            X = self.X[start : start + self.batch_size]
            X = X + 0.1 * torch.randn(X.shape, generator=self.generator, dtype=X.dtype)
            seen.append(X)
            yield X, self.y[start : start + self.batch_size]


def _toy():
    """A float64 3-8-2 MLP and 24 regression points."""
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 8, 2], dtype=F64).eval()
    return (
        model,
        torch.randn(24, 3, generator=g, dtype=F64),
        torch.randn(24, 2, generator=g, dtype=F64),
    )


@pytest.mark.parametrize("solver", ["auto", "lanczos"])
def test_every_pass_of_a_fit_sees_the_batches_of_the_pass_at_the_map(solver):
    # 'lanczos' multiplies with curvlinops' operator, a pass over the data per product:
    # an augmenting loader gave every product other data; now one fixed operator, the
    # GGN of the data whose loss the fit reports
    model, X, y = _toy()
    data = AugmentingLoader(X, y, batch_size=5)
    la = fit_quietly(model, data, solver=solver)
    assert len(data.passes) == 1
    seen = torch.cat(data.passes[0])
    with torch.no_grad():
        loss = 0.5 * ((model(seen) - y) ** 2).sum()
    torch.testing.assert_close(la.loss, loss, rtol=1e-12, atol=0)
    _, J = output_jacobian(model, seen)
    dense = torch.einsum("ncd,nce->de", J, J) / len(seen)
    reference = torch.linalg.eigvalsh(dense).flip(0)[:3]
    torch.testing.assert_close(la.eigenvalues, reference, rtol=1e-8, atol=0)


def test_batches_beyond_the_limit_are_read_from_the_loader(monkeypatch):
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 8, 2], dtype=F64).eval()
    dataset = TensorDataset(
        torch.randn(12, 3, generator=g, dtype=F64), torch.randn(12, 2, generator=g, dtype=F64)
    )
    CountingLoader.started = 0
    kept = fit_quietly(model, CountingLoader(dataset, batch_size=5))
    assert CountingLoader.started == 1
    monkeypatch.setattr(fit_module, "KEPT_BYTES", 0)
    CountingLoader.started = 0
    read = fit_quietly(model, CountingLoader(dataset, batch_size=5))
    assert CountingLoader.started == 2  # the pass at the MAP and the factors' pass
    torch.testing.assert_close(read.eigenvalues, kept.eigenvalues, rtol=1e-12, atol=0)
    assert read.lanczos_info.strategy == kept.lanczos_info.strategy


class RefillingLoader:
    """Yields the same two tensors on every step, refilled in place with the next batch."""

    def __init__(self, X, y, batch_size):
        self.X, self.y, self.batch_size = X, y, batch_size

    def __len__(self):
        return len(self.X) // self.batch_size

    def __iter__(self):
        Xb, yb = self.X[: self.batch_size].clone(), self.y[: self.batch_size].clone()
        for start in range(0, len(self.X), self.batch_size):
            Xb.copy_(self.X[start : start + self.batch_size])
            yb.copy_(self.y[start : start + self.batch_size])
            yield Xb, yb


@pytest.mark.parametrize("solver", ["auto", "lanczos"])
def test_a_loader_that_refills_its_tensors_is_read_on_every_pass(solver):
    # keeping its items would keep the last batch four times
    model, X, y = _toy()
    refilled = fit_quietly(model, RefillingLoader(X, y, 6), solver=solver)
    listed = fit_quietly(
        model, [(X[i : i + 6], y[i : i + 6]) for i in range(0, 24, 6)], solver=solver
    )
    torch.testing.assert_close(refilled.eigenvalues, listed.eigenvalues, rtol=1e-8, atol=0)
    torch.testing.assert_close(refilled.loss, listed.loss, rtol=1e-12, atol=0)


def test_the_problem_replays_the_kept_batches():
    model, data, _ = mlp_problem()
    batches = tuple(data)
    nbytes = sum(sum(item_contents(b).storages.values()) for b in batches)
    kept = ReplayedBatches(batches, nbytes)
    keeping = CurvatureProblem.build(
        model, list(model.parameters()), data, "regression", torch.Size([2]),
        dtype=F64, kept=kept,
    )  # fmt: skip
    assert keeping.loader is kept and keeping.replays is data and keeping.kept_bytes == nbytes
    assert keeping.replay_of(data) is kept and keeping.replay_of(kept) is kept
    assert keeping.data.loader is kept


def test_a_subsample_solve_keeps_no_batches():
    model, data, _ = mlp_problem()
    kept = ReplayedBatches(tuple(data), 1)
    sub = CurvatureProblem.build(
        model, list(model.parameters()), data, "regression", torch.Size([2]), dtype=F64,
        subsample_size=20, generator=torch.Generator().manual_seed(0), kept=kept,
    )  # fmt: skip
    assert sub.replays is None and sub.kept_bytes == 0 and sub.loader is not kept


def test_the_fitted_posterior_lets_the_kept_batches_go():
    g = torch.Generator().manual_seed(0)
    model = mlp([3, 8, 2], dtype=F64).eval()
    dataset = TensorDataset(
        torch.randn(12, 3, generator=g, dtype=F64), torch.randn(12, 2, generator=g, dtype=F64)
    )
    seen = []

    class Watching(torch.utils.data.DataLoader):
        def __iter__(self):
            for batch in super().__iter__():
                seen.append(weakref.ref(batch[0]))
                yield batch

    la = fit_quietly(model, Watching(dataset, batch_size=5))
    assert la.lanczos_info is not None and len(seen) == 3  # one pass: the batches were kept
    gc.collect()
    assert all(ref() is None for ref in seen)
