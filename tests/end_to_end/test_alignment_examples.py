"""The out-of-distribution and active-learning examples: their AUROC and a quick run each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONCRETE = ROOT.parent / "shared" / "data" / "concrete" / "Concrete_Data.csv"
needs_concrete = pytest.mark.skipif(
    not CONCRETE.exists(), reason=f"UCI Concrete data not found at {CONCRETE}"
)


def load(name: str, monkeypatch):
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_auroc_is_the_share_of_correctly_ordered_pairs(monkeypatch):
    auroc = load("ood_detection", monkeypatch).auroc
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 6, (23,), generator=g).double()
    b = torch.randint(2, 9, (17,), generator=g).double()
    pairs = (b[None, :] > a[:, None]).double() + 0.5 * (b[None, :] == a[:, None]).double()
    assert auroc(a, b) == pytest.approx(float(pairs.mean()), abs=1e-12)
    assert auroc(torch.zeros(3), torch.ones(4)) == 1.0
    assert auroc(torch.ones(3), torch.zeros(4)) == 0.0


@needs_concrete
def test_ood_detection_quick(monkeypatch, capsys, tmp_path):
    module = load("ood_detection", monkeypatch)
    module.main(["--quick", "--steps", "100", "--data", str(CONCRETE), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "shifted = the 15% largest-cement rows" in out
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:4]
        for line in out.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    for k in (2, 5):
        for score in ("variance (zero)", "variance (prior)", "residual", "1 - captured"):
            cells = rows[f"GLAS k = {k}: {score}"]
            assert all(0.0 <= float(c) <= 1.0 for c in cells), cells
    for name in ("KronLaplace (all weights)", "DiagLaplace (all weights)"):
        assert all(0.0 <= float(c) <= 1.0 for c in rows[name])
    assert rows["MAP 1 - max softmax"][0].strip() == "-"
    assert "| concrete regression |" in out and "| concrete classification |" in out
    for likelihood in ("regression", "classification"):
        png = tmp_path / f"ood_alignment_{likelihood}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_concrete
def test_active_learning_quick(monkeypatch, capsys, tmp_path):
    module = load("active_learning", monkeypatch)
    args = ["--quick", "--max-labels", "60", "--steps", "100", "--data", str(CONCRETE)]
    module.main([*args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| strategy | RMSE @ 60 | coverage @ 60 |" in out
    for strategy in ("glas", "kron", "random"):
        line = next(x for x in out.splitlines() if x.startswith(f"| {strategy} |"))
        rmse, cov = (c.strip() for c in line.split("|")[2:4])
        assert 0 < float(rmse) < 2 and 0 <= float(cov.rstrip("%")) <= 100
    assert (tmp_path / "active_learning.png").stat().st_size > 1000


def test_active_learning_refuses_inconsistent_sizes(monkeypatch):
    module = load("active_learning", monkeypatch)
    with pytest.raises(SystemExit):
        module.parse_args(["--start", "60", "--max-labels", "50"])


@pytest.mark.parametrize("seeds", [1, 3])
def test_active_learning_figure_names_its_seeds_and_frames_the_nominal_line(monkeypatch, seeds):
    """Curves that stay below 90%: the 90% line sits inside the frame, not on it; one
    seed draws no sd band and the title says 'one seed'."""
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PolyCollection

    module = load("active_learning", monkeypatch)
    g = torch.Generator().manual_seed(0)
    rounds = torch.arange(50, 110, 10, dtype=torch.float64)
    results = {
        strategy: [
            torch.stack(
                [
                    rounds,
                    0.5 + 0.1 * torch.rand(6, generator=g),
                    0.7 + 0.1 * torch.rand(6, generator=g),
                ],
                dim=1,
            ).tolist()
            for _ in range(seeds)
        ]
        for strategy in ("glas", "kron", "random")
    }
    fig = module.plot_curves(results, None)
    title = fig._suptitle.get_text()
    coverage = fig.axes[1]
    low, high = coverage.get_ylim()
    assert low < 0.7 and high > 0.95  # the data and the nominal line with room
    bands = [c for c in coverage.collections if isinstance(c, PolyCollection)]
    if seeds == 1:
        assert "one seed" in title and "sd" not in title and not bands
    else:
        assert "mean +- sd over 3 seeds" in title and len(bands) == 3
