"""Plots render headless (Agg) and write non-empty PNGs."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_glas, loader

pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")

from laplace_glas import activity_scores, select_dimension
from laplace_glas.plotting import (
    plot_coverage_vs_k,
    plot_cumulative_activity,
    plot_predictive_band,
)


@pytest.fixture(scope="module")
def la(toy_regression):
    return fit_glas(*toy_regression, n_components=5)


def test_plots_write_pngs(la, toy_regression, tmp_path):
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    _, X, y = toy_regression
    paths = [tmp_path / f"{name}.png" for name in ("activity", "coverage", "band")]
    plot_cumulative_activity({"mean": activity_scores(la)}, path=paths[0])
    sel = select_dimension(la, loader(X, y), pred_type="glm")
    fig = plot_coverage_vs_k({"mean": sel, "again": sel}, path=paths[1])
    assert len(fig.axes[0].lines) == 3  # two curves and the nominal level
    xs = torch.linspace(-2, 2, 50).reshape(-1, 1)
    f, var = la(xs)
    sd = var.reshape(-1, 1).sqrt()
    plot_predictive_band(xs, f, f - 1.645 * sd, f + 1.645 * sd, X, y, path=paths[2])
    for p in paths:
        assert p.exists() and p.stat().st_size > 1000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_module_imports_matplotlib_at_import_time():
    """matplotlib is optional: no module of the package imports it at module level.

    (laplace-torch's torchmetrics imports matplotlib itself when it is installed, so
    blocking it in a subprocess would test torchmetrics, not us.)
    """
    import ast
    from pathlib import Path

    import laplace_glas

    for path in Path(laplace_glas.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "matplotlib" for n in names), path.name


def test_plotting_without_matplotlib_says_how_to_install(monkeypatch):
    import sys

    import laplace_glas.plotting as plotting

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"laplace-glas\[plot\]"):
        plotting.plot_cumulative_activity(torch.rand(5))


def test_band_legend_names_the_level_and_sits_below_the_axes():
    x = torch.linspace(-2, 2, 30)
    fig = plot_predictive_band(
        x, x, x - 1, x + 1, x, x, label="GLAS", level=0.8, title="toy, N = 30"
    )
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "GLAS: 80% interval" in labels and "GLAS: mean" in labels
    assert ax.get_title() == "toy, N = 30"
    # the legend's box lies below the axes' box: it cannot cover the data
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = ax.get_legend().get_window_extent(renderer)
    assert legend_box.y1 <= ax.get_window_extent(renderer).y0
    assert (
        "90% interval"
        in [
            t.get_text() for t in plot_predictive_band(x, x, x, x).axes[0].get_legend().get_texts()
        ][-1]
    )


def test_coverage_plot_has_the_given_title():
    from laplace_glas import CoverageRow, DimensionSelection

    rows = [
        CoverageRow(k=k, prior_precision=1.0, coverage=0.3 * k, mean_width=1.0, nll=0.0)
        for k in (1, 2, 3)
    ]
    sel = DimensionSelection(
        k=3, prior_precision=1.0, reached=True, coverage=0.9, level=0.9, rows=rows
    )
    fig = plot_coverage_vs_k(sel, title="Concrete, N = 721")
    assert fig.axes[0].get_title() == "Concrete, N = 721"
    assert plot_coverage_vs_k(sel).axes[0].get_title() == ""
    fig = plot_cumulative_activity(torch.rand(50), title="SMILES LSTM")
    assert fig.axes[0].get_title() == "SMILES LSTM"


def test_long_titles_wrap_and_k_ticks_are_integers():
    from laplace_glas import CoverageRow, DimensionSelection

    rows = [
        CoverageRow(k=k, prior_precision=1.0, coverage=0.3 * k, mean_width=1.0, nll=0.0)
        for k in (1, 2, 3)
    ]
    sel = DimensionSelection(
        k=3, prior_precision=1.0, reached=True, coverage=0.9, level=0.9, rows=rows
    )
    title = "Known-noise regression: GLAS predictive of f without noise, k = 20"
    fig = plot_coverage_vs_k(sel, title=title)
    ax = fig.axes[0]
    assert "\n" in ax.get_title() and ax.get_title().replace("\n", " ") == title
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
