"""The example data loaders and training helpers in laplace_glas.applications.data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from laplace_glas.applications.data import (
    concrete_splits,
    known_noise_regression,
    load_concrete,
    make_mlp,
    split,
    standardize,
    train_map,
)

CONCRETE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "concrete" / "Concrete_Data.csv"
)

HEADER = (
    "Cement;Blast Furnace Slag;Fly Ash;Water;Superplasticizer;Coarse Aggregate;"
    "Fine Aggregate;Age (day);Concrete compressive strength"
)


# ------------------------------------------------------------------ toy regression
def test_known_noise_regression_shapes_range_and_noise():
    g = torch.Generator().manual_seed(0)
    X, y = known_noise_regression(5000, noise=0.1, x_range=(-1.0, 3.0), generator=g)
    assert X.shape == (5000, 1) and y.shape == (5000, 1)
    assert X.dtype == y.dtype == torch.float32
    assert X.min() >= -1.0 and X.max() <= 3.0
    residual = y - torch.sin(3 * X)
    assert abs(float(residual.std()) - 0.1) < 0.005
    assert abs(float(residual.mean())) < 0.01


def test_known_noise_regression_noiseless_dtype_and_reproducible():
    X, y = known_noise_regression(
        50, noise=0.0, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    assert X.dtype == torch.float64
    torch.testing.assert_close(y, torch.sin(3 * X))
    X2, _ = known_noise_regression(
        50, noise=0.0, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    torch.testing.assert_close(X, X2, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 0}, {"n": -3}, {"n": 2.5}, {"n": 10, "noise": -0.1}, {"n": 10, "x_range": (1, 1)}],
)
def test_known_noise_regression_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        known_noise_regression(**kwargs)


# ------------------------------------------------------------------ MLP and MAP
def test_make_mlp_paper_architecture():
    model = make_mlp([1, 50, 50, 1])
    assert sum(p.numel() for p in model.parameters()) == 2701
    kinds = [type(m) for m in model]
    assert kinds == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]


def test_make_mlp_seed_is_reproducible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a = make_mlp([2, 8, 3], activation=nn.ReLU, dtype=torch.float64, seed=3)
    b = make_mlp([2, 8, 3], activation=nn.ReLU, dtype=torch.float64, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(a[1], nn.ReLU) and a[0].weight.dtype == torch.float64
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("widths", [[3], [], [2, 0, 1], [2, 1.5, 1]])
def test_make_mlp_rejects_bad_widths(widths):
    with pytest.raises(ValueError):
        make_mlp(widths)


def test_train_map_full_batch_fits_the_sine():
    X, y = known_noise_regression(100, generator=torch.Generator().manual_seed(0))
    model = train_map(make_mlp([1, 32, 32, 1], seed=0), X, y, steps=600, lr=2e-2)
    assert not model.training
    with torch.no_grad():
        rmse = float((model(X) - y).square().mean().sqrt())
    assert rmse < 0.15  # the noise level is 0.1


def test_train_map_minibatch_is_reproducible():
    X, y = known_noise_regression(100, generator=torch.Generator().manual_seed(0))

    def run():
        model = make_mlp([1, 8, 1], seed=0)
        g = torch.Generator().manual_seed(5)
        return train_map(model, X, y, steps=30, batch_size=32, weight_decay=1e-3, generator=g)

    for pa, pb in zip(run().parameters(), run().parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_train_map_classification_lowers_the_loss():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(2).repeat_interleave(50)
    X = torch.randn(100, 2, generator=g) + 3 * y[:, None].float()
    model = make_mlp([2, 8, 2], seed=0)
    with torch.no_grad():
        before = float(nn.functional.cross_entropy(model(X), y))
    train_map(model, X, y, steps=100, loss="ce", batch_size=20, generator=g)
    with torch.no_grad():
        after = float(nn.functional.cross_entropy(model(X), y))
    assert after < 0.5 * before


@pytest.mark.parametrize("kwargs", [{"loss": "hinge"}, {"steps": -1}, {"batch_size": 0}])
def test_train_map_rejects_bad_arguments(kwargs):
    X, y = torch.zeros(4, 1), torch.zeros(4, 1)
    with pytest.raises(ValueError):
        train_map(make_mlp([1, 1]), X, y, **kwargs)


# ------------------------------------------------------------------ concrete
@pytest.mark.skipif(
    not CONCRETE.is_file(),
    reason=f"UCI concrete data not found at {CONCRETE} (shared/data next to the repository)",
)
def test_load_concrete_real_file():
    X, y = load_concrete(CONCRETE)
    assert X.shape == (1030, 8) and y.shape == (1030, 1)
    assert X.dtype == y.dtype == torch.float32
    torch.testing.assert_close(X[0], torch.tensor([540.0, 0, 0, 162, 2.5, 1040, 676, 28]))
    torch.testing.assert_close(y[0], torch.tensor([79.99]))
    assert 2.0 < float(y.min()) and float(y.max()) < 83.0  # strength in MPa
    assert 1 <= float(X[:, 7].min()) and float(X[:, 7].max()) <= 365  # age in days


def test_load_concrete_accepts_decimal_commas_crlf_and_str_path(tmp_path):
    path = tmp_path / "c.csv"
    rows = [HEADER, "540;0;0;162;2,5;1040;676;28;79,99", "", "1;2;3;4;5;6;7;8;9.5"]
    path.write_bytes(("\r\n".join(rows) + "\r\n").encode())
    X, y = load_concrete(str(path))
    torch.testing.assert_close(X[0, 4], torch.tensor(2.5))
    torch.testing.assert_close(y[:, 0], torch.tensor([79.99, 9.5]))


def test_load_concrete_comma_separated(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text(HEADER.replace(";", ",") + "\n1,2,3,4,5,6,7,8,9\n")
    X, y = load_concrete(path)
    assert X.shape == (1, 8) and float(y) == 9.0


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("540;0;0;162;2.5;1040;676;28\n", "expected 9 fields"),
        ("540;0;0;162;abc;1040;676;28;79.99\n", "line 2"),
        ("540;0;0;162;2.5;1040;676;28;nan\n", "finite"),
        ("", "no data rows"),
    ],
)
def test_load_concrete_malformed_rows_raise_value_error(tmp_path, body, match):
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "\n" + body)
    with pytest.raises(ValueError, match=match):
        load_concrete(path)


def test_load_concrete_wrong_header_or_empty_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a;b;c\n1;2;3\n")
    with pytest.raises(ValueError, match="columns"):
        load_concrete(path)
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_concrete(path)


def test_load_concrete_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="UCI") as info:
        load_concrete(tmp_path / "nope" / "Concrete_Data.csv")
    assert "165" in str(info.value) and "CC BY 4.0" in str(info.value)


# ------------------------------------------------------------------ preprocessing
def test_standardize_uses_training_statistics():
    g = torch.Generator().manual_seed(0)
    train = torch.randn(100, 3, generator=g) * torch.tensor([1.0, 5.0, 0.0]) + 2.0
    test = torch.randn(20, 3, generator=g)
    train_s, test_s, mean, std = standardize(train, test)
    torch.testing.assert_close(train_s[:, :2].mean(0), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(train_s[:, :2].std(0), torch.ones(2))
    assert torch.equal(train_s[:, 2], torch.zeros(100))  # constant column: std set to 1
    assert std[0, 2] == 1.0
    torch.testing.assert_close(test_s * std + mean, test)
    assert len(standardize(train)) == 3


def test_standardize_needs_two_rows():
    with pytest.raises(ValueError):
        standardize(torch.ones(1, 3))


def test_split_partitions_the_rows():
    X = torch.arange(101, dtype=torch.float32).reshape(-1, 1)
    y = 2 * X
    parts = split(X, y, generator=torch.Generator().manual_seed(0))
    assert len(parts) == 3
    assert [p[0].shape[0] for p in parts] == [71, 15, 15]
    rows = torch.cat([p[0] for p in parts]).reshape(-1)
    assert torch.equal(rows.sort().values, X.reshape(-1))
    for Xp, yp in parts:
        assert torch.equal(yp, 2 * Xp)
    again = split(X, y, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(parts, again, strict=True))


def test_split_custom_fractions_and_errors():
    X, y = torch.zeros(10, 2), torch.zeros(10)
    parts = split(X, y, fractions=(0.5, 0.5))
    assert [p[0].shape[0] for p in parts] == [5, 5]
    with pytest.raises(ValueError, match="sum to 1"):
        split(X, y, fractions=(0.5, 0.4))
    with pytest.raises(ValueError):
        split(X, y, fractions=(1.2, -0.2))
    with pytest.raises(ValueError):
        split(X, torch.zeros(9))


@pytest.mark.skipif(
    not CONCRETE.is_file(),
    reason=f"UCI concrete data not found at {CONCRETE} (shared/data next to the repository)",
)
def test_concrete_splits_equal_load_split_standardize():
    parts = concrete_splits(CONCRETE, torch.Generator().manual_seed(3))
    X, y = load_concrete(CONCRETE)
    (Xtr, ytr), (Xc, yc), (Xte, yte) = split(X, y, generator=torch.Generator().manual_seed(3))
    expected_X = standardize(Xtr, Xc, Xte)[:3]
    expected_y = standardize(ytr, yc, yte)[:3]
    assert len(parts) == 3
    for (Xp, yp), Xe, ye in zip(parts, expected_X, expected_y):
        assert torch.equal(Xp, Xe) and torch.equal(yp, ye)
    assert abs(float(parts[0][0].mean())) < 1e-5 and abs(float(parts[0][1].std()) - 1) < 1e-5


def test_load_concrete_reads_ucis_xls_through_pandas(tmp_path, monkeypatch):
    """UCI ships Concrete_Data.xls: its first sheet (a header row of long names, then
    1030 rows of numbers) goes through pandas.read_excel (the 'xls' extra); here a
    stand-in pandas returns such a sheet."""
    import sys
    import types

    header = ["Cement (component 1)(kg in a m^3 mixture)"] + [f"c{j}" for j in range(8)]
    sheet = [header, [540.0, 0.0, 0.0, 162.0, 2.5, 1040.0, 676.0, 28, 79.99]]
    sheet.append([332.5, 142.5, 0.0, 228.0, 0.0, 932.0, 594.0, 270, 40.27])

    class Frame:
        def astype(self, kind):
            assert kind is str
            return types.SimpleNamespace(
                values=types.SimpleNamespace(tolist=lambda: [[str(v) for v in r] for r in sheet])
            )

    calls = []
    fake = types.SimpleNamespace(
        read_excel=lambda path, sheet_name, header: calls.append(path) or Frame()
    )
    monkeypatch.setitem(sys.modules, "pandas", fake)
    path = tmp_path / "Concrete_Data.xls"
    path.write_bytes(b"\xd0\xcf\x11\xe0")  # an OLE2 header; the stand-in does not read it
    X, y = load_concrete(path)
    assert calls == [path]
    assert (
        X.shape == (2, 8)
        and X[1, 7] == 270
        and torch.allclose(y[:, 0], torch.tensor([79.99, 40.27]))
    )


def test_load_concrete_xls_without_pandas_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    path = tmp_path / "Concrete_Data.xls"
    path.write_bytes(b"\xd0\xcf\x11\xe0")
    with pytest.raises(
        FileNotFoundError, match=r"needs pandas and xlrd \(pip install -e '\.\[xls\]'\)"
    ):
        load_concrete(path)


def test_a_missing_data_set_ends_an_example_with_one_line(tmp_path, capsys):
    from laplace_glas.applications.cli import run_example

    with pytest.raises(SystemExit) as info:
        run_example(lambda: load_concrete(tmp_path / "Concrete_Data.csv"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Concrete data not found") and err.count("\n") == 1
    assert "Traceback" not in err and "Concrete_Data.xls" in err
