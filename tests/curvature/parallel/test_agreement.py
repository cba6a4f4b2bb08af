"""The agreement's encodings, against plain Python and NumPy references (the exchange
itself runs between two gloo ranks in tests/curvature/parallel/test_distributed.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from laplace_glas.curvature.parallel.agreement import (
    Setting,
    generator_checksum,
    loss_description,
    loss_settings,
    shard_is_empty,
    weights_checksum,
)
from laplace_glas.curvature.parallel.distributed import failed_ranks


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "None"),
        (7, "7"),
        (0.0, "0"),
        (1e-7, "1e-07"),
        (2**40, str(2**40)),
        (True, "'True'"),
        ("reward_modeling", "'reward_modeling'"),
        (torch.bfloat16, "'torch.bfloat16'"),
        ("x" * 30, "'" + "x" * 18 + "...'"),
    ],
)
def test_a_setting_is_named_from_its_code(value, text):
    setting = Setting("s", value)
    codes = setting.encode()
    assert len(codes) == Setting.WIDTH
    assert all(float(np.float64(c)) == c and abs(c) < 2**53 for c in codes)
    assert setting.decode(torch.tensor(codes, dtype=torch.float64)) == text
    # another value of the setting never shares the code
    assert Setting("s", "lanczos").encode() != codes


def test_long_texts_that_share_their_head_differ_in_code():
    a, b = Setting("s", "x" * 18 + "a").encode(), Setting("s", "x" * 18 + "b").encode()
    assert a[:-1] == b[:-1] and a[-1] != b[-1]


def test_weights_checksum_matches_numpy():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double()]
    ref = np.zeros(6)
    for j, t in enumerate(tensors):
        x = t.reshape(-1).double().numpy()
        ref += [x.sum(), x @ x, (j + 1) * x.sum(), x[1:] @ x[:-1], abs(x).sum(), 0]
        ref[5] += (j + 1) * abs(x).sum()
    np.testing.assert_allclose(weights_checksum(tensors, "cpu").numpy(), ref, rtol=1e-14)
    swapped = weights_checksum(tensors[::-1], "cpu")  # the same numbers in other tensors
    assert not torch.equal(swapped[2], weights_checksum(tensors, "cpu")[2])


def test_generator_checksum_follows_the_state():
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert generator_checksum(a) == generator_checksum(b)
    state = a.get_state().long().numpy()
    assert generator_checksum(a) == int(sum((i + 1) * int(v) for i, v in enumerate(state)))
    torch.randn(1, generator=b)
    assert generator_checksum(a) != generator_checksum(b)


def test_shard_is_empty_and_failed_ranks():
    assert shard_is_empty([]) and not shard_is_empty([1])
    assert shard_is_empty(iter(())) and not shard_is_empty(iter([1]))
    assert failed_ranks(torch.tensor([0.0, 1.0, 0.0, 1.0])) == [1, 3]


def test_the_loss_settings_differ_where_the_loss_does_and_not_with_its_state():
    def encoded(loss_fn):
        return [(setting.name, setting.encode()) for setting in loss_settings(loss_fn)]

    summed, mean = nn.MSELoss(reduction="sum"), nn.MSELoss()
    assert loss_description(None) is None
    # as many settings whatever the loss: the ranks' rows must have one length
    assert len(encoded(None)) == len(encoded(summed)) == len(encoded(nn.CrossEntropyLoss()))
    assert encoded(summed) != encoded(mean)
    assert ("loss_fn.reduction", Setting("", "sum").encode()) in encoded(summed)
    assert encoded(nn.CrossEntropyLoss(label_smoothing=0.1)) != encoded(nn.CrossEntropyLoss())
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]))
    assert encoded(weighted) != encoded(nn.CrossEntropyLoss(weight=torch.tensor([2.0, 1.0])))
    assert encoded(weighted) == encoded(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0])))
    assert encoded(nn.MSELoss()) == encoded(mean)

    class LoggingMSE(nn.Module):  # state a training loop leaves behind is not a setting
        def __init__(self):
            super().__init__()
            self.reduction, self.last_value = "sum", 0.0

        def forward(self, f, y):
            loss = 0.5 * ((f - y) ** 2).sum()
            self.last_value = float(loss)
            return loss

    used = LoggingMSE()
    used(torch.ones(2), torch.zeros(2))
    assert encoded(used) == encoded(LoggingMSE())
