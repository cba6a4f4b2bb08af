"""Figures (matplotlib is an optional extra, imported only when a plot is made).

Each function returns the matplotlib ``Figure`` and, given ``path``, saves it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "plot_alignment",
    "plot_coverage_vs_k",
    "plot_cumulative_activity",
    "plot_predictive_band",
]


def _pyplot():
    try:
        import matplotlib

        if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "ps", "cairo"):
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Plotting needs matplotlib: pip install 'laplace-glas[plot]'.") from err
    return plt


def _finish(fig: Any, path: str | Path | None) -> Any:
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _title(ax: Any, title: str | None, width: int = 48) -> None:
    """``title`` wrapped to ``width`` characters, so that a long one is not clipped."""
    if title is not None:
        ax.set_title(textwrap.fill(title, width), fontsize="medium")


def _curves(value: Any, name: str, kind: str, label: str, fits: Any) -> dict[str, Any]:
    """``value`` (one item or a mapping ``label -> item``) as a non-empty mapping whose
    items pass ``fits``; a named error otherwise (before a figure is made).
    """
    items = dict(value) if isinstance(value, Mapping) else {label: value}
    if not items:
        raise ValueError(f"{name} is empty: give one {kind} or a mapping label -> {kind}.")
    for key, item in items.items():
        if not fits(item):
            raise TypeError(
                f"{name} must be a {kind} or a mapping label -> {kind}; the entry "
                f"{key!r} is {type(item).__name__}."
            )
    return items


def _legend_below(ax: Any) -> None:
    """Legend under the axes (x label included), where it cannot hide data."""
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=min(len(handles), 2),
        fontsize="small",
        frameon=False,
    )


def plot_cumulative_activity(
    scores: torch.Tensor | Mapping[str, torch.Tensor],
    path: str | Path | None = None,
    title: str | None = None,
) -> Any:
    """Cumulative activity share of the top-n weights, log-log axes.

    ``scores`` is one ``(D,)`` tensor or a mapping ``label -> scores``; ``title``
    names the model or data set.
    """
    from laplace_glas.diagnostics.activity import cumulative_activity

    curves = _curves(scores, "scores", "(D,) tensor", "activity", torch.is_tensor)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, s in curves.items():
        n, share = cumulative_activity(s.detach().cpu())
        ax.loglog(n.numpy(), share.numpy(), label=label)
    ax.set_xlabel("number of weights (sorted by activity)")
    ax.set_ylabel("cumulative share of activity")
    ax.grid(True, which="both", alpha=0.3)
    _legend_below(ax)
    _title(ax, title)
    return _finish(fig, path)


def plot_coverage_vs_k(
    selections: Any, path: str | Path | None = None, title: str | None = None
) -> Any:
    """Calibration coverage against k for one or several ``DimensionSelection``s.

    ``selections`` is one selection or a mapping ``label -> selection`` (e.g. mean vs
    summed loss scaling); ``title`` names the data, e.g. ``"Concrete, N = 721"``. The
    legend sits below the axes, off the curves.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    items = _curves(
        selections, "selections", "DimensionSelection", "GLAS", lambda s: hasattr(s, "best_per_k")
    )
    fig, ax = plt.subplots(figsize=(5, 4))
    level = None
    for label, selection in items.items():
        rows = selection.best_per_k()
        ax.plot([r.k for r in rows], [r.coverage for r in rows], marker="o", ms=3, label=label)
        level = selection.level
    if level is not None:
        ax.axhline(level, color="k", ls="--", lw=1, label=f"nominal {level:.0%}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # k is a count
    ax.set_xlabel("k (subspace dimension)")
    ax.set_ylabel("calibration coverage")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    _legend_below(ax)
    _title(ax, title)
    return _finish(fig, path)


def plot_predictive_band(
    x: torch.Tensor,
    mean: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    x_train: torch.Tensor | None = None,
    y_train: torch.Tensor | None = None,
    label: str = "GLAS",
    path: str | Path | None = None,
    level: float = 0.9,
    title: str | None = None,
) -> Any:
    """Predictive mean and interval band of a 1-D regression, with the training data.

    ``[lower, upper]`` is a central interval of nominal probability ``level``, named
    so in the legend (which sits below the axes, off the data); ``title`` names the
    data set.
    """
    tensors = {"x": x, "mean": mean, "lower": lower, "upper": upper}
    sizes = {k: v.numel() if torch.is_tensor(v) else None for k, v in tensors.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ValueError(
            "x, mean, lower and upper must be tensors of the same number of points; got "
            + ", ".join(
                f"{k}: {tuple(v.shape) if torch.is_tensor(v) else type(v).__name__}"
                for k, v in tensors.items()
            )
            + "."
        )
    if not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}.")
    plt = _pyplot()
    x, mean, lower, upper = (t.detach().cpu().reshape(-1).numpy() for t in (x, mean, lower, upper))
    order = x.argsort()
    fig, ax = plt.subplots(figsize=(6, 4.6))
    if x_train is not None and y_train is not None:
        ax.scatter(
            x_train.detach().cpu().reshape(-1).numpy(),
            y_train.detach().cpu().reshape(-1).numpy(),
            s=4,
            c="0.5",
            label="training data",
        )
    ax.plot(x[order], mean[order], c="C0", label=f"{label}: mean")
    ax.fill_between(
        x[order],
        lower[order],
        upper[order],
        color="C0",
        alpha=0.3,
        label=f"{label}: {level:.0%} interval",
    )
    ax.set_xlabel("x")
    ax.set_ylabel("f(x)")
    _legend_below(ax)
    _title(ax, title)
    return _finish(fig, path)


def plot_alignment(
    alignments: Mapping[str, Any],
    path: str | Path | None = None,
    title: str | None = None,
    complement: str = "own",
) -> Any:
    """Captured share ``||J U||_F^2 / ||J||_F^2`` against the 'glm' variance, per input.

    ``alignments`` maps a label (e.g. ``"in-distribution"``, ``"shifted"``) to a
    :class:`~laplace_glas.diagnostics.alignment.Alignment`; ``complement`` picks the
    variance: ``'own'`` (default: the posterior's own, its complement included,
    :attr:`~laplace_glas.diagnostics.alignment.Alignment.total_variance`), ``'zero'``
    (``sum_j v_j ||J u_j||^2``) or ``'prior'`` (``+ residual / tau``). The variance axis
    is logarithmic; the legend sits below the axes.
    """
    if complement not in ("zero", "prior", "own"):
        raise ValueError(f"complement must be 'own', 'zero' or 'prior', got {complement!r}.")
    fits = lambda a: hasattr(a, "captured") and hasattr(a, "combined")  # noqa: E731
    alignments = _curves(alignments, "alignments", "Alignment", "GLAS", fits)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.4))
    for label, result in alignments.items():
        variance = {
            "own": result.total_variance, "zero": result.variance, "prior": result.combined
        }[complement]  # fmt: skip
        ax.scatter(
            result.captured.detach().cpu().numpy(),
            variance.detach().cpu().clamp_min(1e-30).numpy(),
            s=8,
            alpha=0.6,
            label=label,
        )
    ax.set_yscale("log")
    ax.set_xlabel("captured share of ||J(x)||_F^2")
    shown = complement
    if complement == "own":
        shown = "/".join(dict.fromkeys(r.complement for r in alignments.values()))
    ax.set_ylabel(f"'glm' variance (complement='{shown}')")
    ax.grid(True, alpha=0.3)
    _legend_below(ax)
    _title(ax, title)
    return _finish(fig, path)
