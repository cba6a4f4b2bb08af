"""Predictive quality of GLAS against laplace-torch's posteriors and the plain network.

Does GLAS's predictive beat laplace-torch's KFAC (and the MAP network) where users look?
For each data set and seed (``--seeds``, default 0 1 2) one float64 tanh MLP is trained
to its MAP (Adam on the mean loss, ``train_map``); then every method is fitted on the
same network and training data:

* ``MAP``: the network alone (regression: N(f, sigma^2); classification: softmax);
* laplace-torch ``kron``, ``diag``, last-layer ``kron`` (``subset_of_weights=
  'last_layer'``) and ``full`` (only when D <= ``--full-max-params``, 3000; 1000 with ``--quick``);
* GLAS (``hessian_structure='glas'``, ``n_components = --k``, 20) in each variant of
  ``--variants`` (a JSON list of constructor-keyword dicts). The default variants are
  ``{}`` (the library default: 'sum', 'auto'), the loss scalings 'mean' and 'sum' with
  each of the complements 'zero', 'diag' and 'kron' (the last two only if the installed
  laplace_glas accepts them), and ``{"loss_scaling": "sum", "complement": "prior"}``;
* on the classification tasks: Kron and the GLAS default with the Monte Carlo link
  (``link_approx='mc'``, 2,000 draws), Kron with the normalised Laplace bridge
  (``'bridge_norm'``), and ``GLAS posterior curvature`` (the default posterior
  refitted by ``fit_posterior_curvature``: the softmax Hessian averaged over the
  posterior's own predictive, to its fixed point, the prior by the evidence after
  every fit; ``fit [s]`` is all of it) with the probit, Monte Carlo and
  ``'bridge_norm'`` links, and with ``complement='diag'`` (the complement that follows
  the averaged Hessian on any model; ``'auto'``'s ``'kron_diag'`` on the sequence
  models does not).

``--methods`` keeps only the rows named (e.g. ``--methods MAP kron``);
``--fixed-point-steps 1 2 4 8`` runs each posterior-curvature row once per ``n_steps``
given.

Every posterior's prior precision is tuned by its own ``la.optimize_prior_precision()``
(laplace-torch's default: ``method='marglik'``, a scalar prior; GLAS solves the same
1-D optimum in closed form), and every prediction is the ``'glm'`` predictive (probit
link for classification). ``fit [s]`` is ``la.fit``, ``prior [s]`` the tuning.

Data sets (all offline):

* ``gap``: 1-D "in-between" regression, x uniform on [-2, -0.7] U [0.7, 2], y = sin(3x)
  + 0.1 eps. ``gap ratio``: the mean epistemic (function-space) predictive std over the
  gap x in [-0.5, 0.5] divided by its mean over the training inputs (> 1: the posterior
  knows it has not seen the gap). Test NLL on fresh points from the same two clusters.
* ``concrete``: UCI Concrete (``../shared/data/concrete/Concrete_Data.csv`` from the
  repository root; skipped with a reason if absent), standardised, 70% train / 10%
  calibration / 20% test. Test NLL, coverage and mean width of central 90% intervals of y.
* ``blobs``: 4 overlapping Gaussian classes in 2-D, plus out-of-distribution inputs on
  a ring at 3x the training data's RMS radius. Test NLL, accuracy, ECE (15 equal-width
  bins), Brier score and OOD AUROC (score 1 - max prob, in-distribution test points
  against the ring; rank-based, ties counted half).
* ``lstm``: sequence classification where KFAC does not reach: an ``nn.LSTM(2, 16)``
  and a linear head (200 full-batch Adam steps) read 12 steps of 2 noisy features and
  name which of 3 slopes their running sum follows. OOD inputs: the same sequences
  scaled by 4 with their steps in random order. The same metrics as ``blobs``.
* ``transformer``: the same task through a one-layer ``nn.TransformerEncoder`` (width
  16, 2 heads, mean-pooled, linear head): attention's weights, its LayerNorms and the
  read-in are outside KFAC's layers (``complement='auto'`` resolves to ``'kron_diag'``).
* ``wine``: scikit-learn's bundled wine data (178 rows, 13 standardised features, 3
  classes; 70% train / 30% test), a 13-32-32-3 tanh MLP; OOD inputs from N(0, 4^2 I).
  The metrics of ``blobs``.
* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, 10 classes, 70% / 30%),
  a two-convolution CNN (``DigitsCNN``); the shifted test set is the test images
  rotated by 30-45 degrees (``rotated NLL`` / ``ECE``), OOD inputs are the test images
  with their pixels permuted. ``wine`` and ``digits`` need scikit-learn (the ``bench``
  extra) and are skipped with a reason without it.

Regression noise: ``sigma`` is a plug-in estimate the same for every method (passed as
``sigma_noise``, not refitted): the MAP's training RMSE on the gap toy, its RMSE on a
held-out 10% calibration split on Concrete (whose MAP over-fits); the predictive of y
is N(f_mu, f_var + sigma^2).

Cells are mean +- sd over the seeds. A method that raises for a seed (or yields a
non-finite metric) is recorded as failed for that seed, with a short reason, and the
run goes on. ``--quick`` (1 seed, fewer points and steps, k = 5) is a smoke test of
well under a minute. Example::

    python benchmarks/value.py --out benchmarks/value_results.md
"""

from __future__ import annotations

# The environment the caller runs in is measured (OpenMP's default wait policy and
# thread counts unless set): machine_description reports it. A tuned setting
# (OMP_WAIT_POLICY=PASSIVE) is the caller's, measured beside the default, never instead.
import argparse
import importlib.util
import json
import math
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401  (registers hessian_structure='glas')
from laplace_glas import fit_posterior_curvature
from laplace_glas.applications.data import concrete_splits, make_mlp, train_map

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONCRETE = ROOT.parent / "shared" / "data" / "concrete" / "Concrete_Data.csv"
DATASETS = ("gap", "concrete", "blobs", "lstm", "transformer", "wine", "digits")
SKLEARN_DATASETS = ("wine", "digits")  # bundled with scikit-learn (the 'bench' extra)
SEQUENCE_LENGTH = 12
DTYPE = torch.float64
LEVEL = 0.9
Z90 = statistics.NormalDist().inv_cdf(0.5 + LEVEL / 2)
ECE_BINS = 15
MC_LINK_SAMPLES = 2000
LIKELIHOODS = {name: "classification" for name in DATASETS} | {
    "gap": "regression",
    "concrete": "regression",
}
BASE_VARIANTS: list[dict[str, Any]] = [
    {},
    {"loss_scaling": "mean", "complement": "zero"},
    {"loss_scaling": "sum", "complement": "zero"},
    {"loss_scaling": "sum", "complement": "prior"},
]
DIAG_VARIANTS: list[dict[str, Any]] = [
    {"loss_scaling": "mean", "complement": "diag"},
    {"loss_scaling": "sum", "complement": "diag"},
]
KRON_VARIANTS: list[dict[str, Any]] = [
    {"loss_scaling": "mean", "complement": "kron"},
    {"loss_scaling": "sum", "complement": "kron"},
]


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the report."""
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ data
@dataclass
class Problem:
    """One data set at one seed: the trained MAP network and its evaluation inputs."""

    likelihood: str
    model: nn.Module
    X_train: Tensor
    y_train: Tensor
    X_test: Tensor
    y_test: Tensor
    sigma: float | None = None  # regression noise (MAP training RMSE)
    X_gap: Tensor | None = None  # gap: inputs in the gap
    X_ood: Tensor | None = None  # classification: out-of-distribution inputs
    X_shift: Tensor | None = None  # digits: the test images rotated (labels y_test)
    info: str = ""


@dataclass
class Config:
    """Sizes of one run (default or --quick)."""

    width: int
    steps: int
    n_gap: int
    n_blobs: int
    n_test: int
    max_images: int | None = None  # digits: at most this many training images


def gap_points(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` points, half on [-2, -0.7], half on [0.7, 2]; y = sin(3x) + 0.1 eps."""
    u = torch.rand(n, 1, generator=g, dtype=DTYPE)
    side = torch.ones(n, 1, dtype=DTYPE)
    side[: n // 2] = -1.0
    X = side * (0.7 + 1.3 * u)
    y = torch.sin(3 * X) + 0.1 * torch.randn(n, 1, generator=g, dtype=DTYPE)
    return X, y


def blob_points(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` points of 4 unit-variance Gaussian classes centred at (+-1.5, +-1.5)."""
    centres = torch.tensor([[1.5, 1.5], [-1.5, 1.5], [-1.5, -1.5], [1.5, -1.5]], dtype=DTYPE)
    y = torch.arange(n) % 4
    X = centres[y] + torch.randn(n, 2, generator=g, dtype=DTYPE)
    return X, y


def slope_sequences(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` sequences of 12 steps with 2 features: feature 0 steps by the class's slope
    (-0.5, 0, +0.5) plus unit noise, feature 1 is noise; the label is the slope (the
    Bayes classifier, from the sum of feature 0, is right about 70% of the time)."""
    y = torch.arange(n) % 3
    noise = torch.randn(n, SEQUENCE_LENGTH, 2, generator=g, dtype=DTYPE)
    slope = (y.to(DTYPE) - 1) * 0.5
    noise[:, :, 0] += slope[:, None]
    return noise, y


class SequenceClassifier(nn.Module):
    """An LSTM or a one-layer transformer encoder over the steps, then a linear head."""

    def __init__(self, kind: str, seed: int, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        if kind == "lstm":
            self.body = nn.LSTM(2, width, batch_first=True)
        else:
            self.read_in = nn.Linear(2, width)
            layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
            self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "lstm":
            return self.head(self.body(x)[0][:, -1])
        return self.head(self.body(self.read_in(x)).mean(1))


class DigitsCNN(nn.Sequential):
    """Two 3x3 convolutions (8 and 16 channels, ReLU, 2x2 max-pooling) and a linear
    head over 10 classes, for 1 x 8 x 8 images (D = 1,898)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        super().__init__(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64, 10),
        )  # fmt: skip


def rotated(images: Tensor, low: float, high: float, g: torch.Generator) -> Tensor:
    """``images (N, 1, H, W)`` each rotated by an angle uniform in ``[low, high]``
    degrees, clockwise or anticlockwise at random (bilinear, zeros outside)."""
    n = len(images)
    degrees = low + (high - low) * torch.rand(n, generator=g, dtype=images.dtype)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(images.dtype)
    angle = sign * degrees * math.pi / 180
    cos, sin, zero = angle.cos(), angle.sin(), torch.zeros_like(angle)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = nn.functional.affine_grid(theta, list(images.shape), align_corners=False)
    return nn.functional.grid_sample(images, grid, align_corners=False)


def shuffled_split(
    X: Tensor, y: Tensor, train_fraction: float, g: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A random ``train_fraction`` of the rows for training, the rest for testing."""
    order = torch.randperm(len(X), generator=g)
    n = int(train_fraction * len(X))
    return X[order[:n]], y[order[:n]], X[order[n:]], y[order[n:]]


def sklearn_problem(
    name: str, seed: int, g: torch.Generator, max_images: int | None = None
) -> Problem:
    """The two tasks on data bundled with scikit-learn (no download).

    ``wine``: 178 wines, 13 standardised features, 3 cultivars; a 13-32-32-3 tanh MLP;
    70% train / 30% test; OOD inputs drawn from N(0, 4^2 I) (4x the data's std).
    ``digits``: 1,797 8x8 handwritten digits; :class:`DigitsCNN`; 70% / 30%; the
    shifted test set is the test images rotated by 30-45 degrees; OOD inputs are the test
    images with their 64 pixels in one fixed random order. ``max_images`` keeps only
    the first that many training images and half as many test images (``--quick``).
    """
    from sklearn.datasets import load_digits, load_wine

    if name == "wine":
        data = load_wine()
        X, y = torch.tensor(data.data, dtype=DTYPE), torch.tensor(data.target)
        X, y, Xt, yt = shuffled_split(X, y, 0.7, g)
        mean, std = X.mean(0), X.std(0)
        X, Xt = (X - mean) / std, (Xt - mean) / std
        X_ood = 4 * torch.randn(len(Xt), X.shape[1], generator=g, dtype=DTYPE)
        model = make_mlp([13, 32, 32, 3], dtype=DTYPE, seed=seed)
        train_map(model, X, y, steps=1000, lr=1e-2, weight_decay=1e-4, loss="ce")
        info = f"train {len(X)}, test {len(Xt)}, OOD {len(X_ood)} from N(0, 16 I)"
        return Problem("classification", model, X, y, Xt, yt, X_ood=X_ood, info=info)
    data = load_digits()
    X = torch.tensor(data.images, dtype=DTYPE).unsqueeze(1) / 16.0
    X, y, Xt, yt = shuffled_split(X, torch.tensor(data.target), 0.7, g)
    if max_images is not None:
        X, y, Xt, yt = X[:max_images], y[:max_images], Xt[: max_images // 2], yt[: max_images // 2]
    X_shift = rotated(Xt, 30.0, 45.0, g)
    pixels = torch.randperm(64, generator=g)
    X_ood = Xt.reshape(len(Xt), 64)[:, pixels].reshape(Xt.shape)
    model = DigitsCNN(seed).to(DTYPE)
    train_map(model, X, y, steps=600, lr=5e-3, weight_decay=1e-4, loss="ce")
    info = (
        f"train {len(X)}, test {len(Xt)}, shifted test {len(X_shift)} (rotated 30-45 "
        f"degrees), OOD {len(X_ood)} (pixels permuted)"
    )
    return Problem("classification", model, X, y, Xt, yt, X_ood=X_ood, X_shift=X_shift, info=info)


def rmse(model: nn.Module, X: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        return float((model(X) - y).square().mean().sqrt())


def make_problem(name: str, seed: int, cfg: Config, concrete_path: Path) -> Problem:
    """Data of ``name`` at ``seed`` and the MAP network trained on it."""
    g = torch.Generator().manual_seed(seed)
    hidden = [cfg.width, cfg.width]
    if name == "gap":
        X, y = gap_points(cfg.n_gap, g)
        Xt, yt = gap_points(cfg.n_test, g)
        model = make_mlp([1, *hidden, 1], dtype=DTYPE, seed=seed)
        train_map(model, X, y, steps=cfg.steps, lr=1e-2, weight_decay=1e-4, generator=g)
        sigma = rmse(model, X, y)
        X_gap = torch.linspace(-0.5, 0.5, 101, dtype=DTYPE).reshape(-1, 1)
        info = f"train {len(X)}, test {len(Xt)}, gap grid 101 points"
        return Problem("regression", model, X, y, Xt, yt, sigma, X_gap=X_gap, info=info)
    if name == "concrete":
        (X, y), (Xc, yc), (Xt, yt) = concrete_splits(concrete_path, g, fractions=(0.7, 0.1, 0.2))
        X, y, Xc, yc, Xt, yt = (t.to(DTYPE) for t in (X, y, Xc, yc, Xt, yt))
        model = make_mlp([X.shape[1], *hidden, 1], dtype=DTYPE, seed=seed)
        train_map(model, X, y, steps=cfg.steps, lr=3e-3, weight_decay=1e-4, generator=g)
        # the MAP over-fits (training RMSE ~0.1 against ~0.3 held out): sigma is
        # estimated on a held-out calibration split, as a user without test data would
        sigma = rmse(model, Xc, yc)
        info = (
            f"train {len(X)}, calibration {len(Xc)} (sigma), test {len(Xt)} (standardised); "
            f"MAP training / test RMSE {rmse(model, X, y):.3f} / {rmse(model, Xt, yt):.3f}"
        )
        return Problem("regression", model, X, y, Xt, yt, sigma, info=info)
    if name == "blobs":
        X, y = blob_points(cfg.n_blobs, g)
        Xt, yt = blob_points(cfg.n_test, g)
        model = make_mlp([2, *hidden, 4], dtype=DTYPE, seed=seed)
        train_map(model, X, y, steps=cfg.steps, lr=1e-2, weight_decay=1e-4, loss="ce")
        spread = float((X - X.mean(0)).square().sum(1).mean().sqrt())
        angle = 2 * math.pi * torch.rand(cfg.n_test, generator=g, dtype=DTYPE)
        X_ood = X.mean(0) + 3 * spread * torch.stack([angle.cos(), angle.sin()], 1)
        info = (
            f"train {len(X)}, test {len(Xt)}, OOD ring {len(X_ood)} points at radius "
            f"{3 * spread:.2f} (3x the RMS radius {spread:.2f})"
        )
        return Problem("classification", model, X, y, Xt, yt, X_ood=X_ood, info=info)
    if name in ("lstm", "transformer"):
        X, y = slope_sequences(cfg.n_blobs, g)
        Xt, yt = slope_sequences(cfg.n_test, g)
        model = SequenceClassifier(name, seed).to(DTYPE)
        # 200 full-batch steps: the MAP fits its training data (~95%) and is over-confident
        # on the test data (test accuracy ~67%, NLL ~1.2), the case a posterior should mend
        train_map(model, X, y, steps=200, lr=1e-2, weight_decay=1e-4, loss="ce")
        order = torch.argsort(torch.rand(cfg.n_test, SEQUENCE_LENGTH, generator=g), dim=1)
        X_ood = 4 * torch.gather(slope_sequences(cfg.n_test, g)[0], 1,
                                 order[..., None].expand(-1, -1, 2))  # fmt: skip
        with torch.no_grad():
            train_acc = float((model(X).argmax(1) == y).double().mean())
        info = (
            f"train {len(X)} sequences of {SEQUENCE_LENGTH} steps (MAP training accuracy "
            f"{train_acc:.2f}), test {len(Xt)}, OOD {len(X_ood)} (x4, steps shuffled)"
        )
        return Problem("classification", model, X, y, Xt, yt, X_ood=X_ood, info=info)
    if name in SKLEARN_DATASETS:
        return sklearn_problem(name, seed, g, cfg.max_images)
    raise ValueError(f"unknown data set {name!r}")


# --------------------------------------------------------------------------- metrics
def auroc(score_neg: Tensor, score_pos: Tensor) -> float:
    """Area under the ROC curve of ``score_pos`` (label 1) against ``score_neg`` (label
    0), by the Mann-Whitney rank sum with tied scores given their average rank."""
    scores = torch.cat([score_neg, score_pos]).double()
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    upper = torch.cumsum(counts, 0).double()  # rank of each distinct value's last copy
    avg_rank = upper - (counts.double() - 1) / 2
    ranks = avg_rank[inverse]
    n_neg, n_pos = len(score_neg), len(score_pos)
    u = float(ranks[n_neg:].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_neg * n_pos)


def ece(probs: Tensor, y: Tensor, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error of the top-class confidence, equal-width bins."""
    conf, pred = probs.max(1)
    correct = (pred == y).double()
    bins = torch.clamp((conf * n_bins).long(), max=n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        mask = bins == b
        if mask.any():
            total += float(mask.sum()) * abs(float(correct[mask].mean() - conf[mask].mean()))
    return total / len(y)


def regression_metrics(f_mu: Tensor, f_var: Tensor, y: Tensor, sigma: float) -> dict[str, float]:
    var_y = f_var + sigma**2
    resid = y.reshape(f_mu.shape) - f_mu
    nll = 0.5 * (torch.log(2 * math.pi * var_y) + resid.square() / var_y)
    half = Z90 * var_y.sqrt()
    return {
        "nll": float(nll.mean()),
        "cov90": float((resid.abs() <= half).double().mean()),
        "width90": float((2 * half).mean()),
    }


def classification_metrics(probs: Tensor, y: Tensor, probs_ood: Tensor) -> dict[str, float]:
    probs = probs.clamp(min=1e-12)
    onehot = nn.functional.one_hot(y, probs.shape[1]).to(probs.dtype)
    return {
        "nll": float(-probs.gather(1, y.reshape(-1, 1)).log().mean()),
        "acc": float((probs.argmax(1) == y).double().mean()),
        "ece": ece(probs, y),
        "brier": float((probs - onehot).square().sum(1).mean()),
        "auroc": auroc(1 - probs.max(1).values, 1 - probs_ood.max(1).values),
    }


# --------------------------------------------------------------------------- methods
@dataclass
class Method:
    """A posterior built by ``Laplace(model, lik, subset, structure, **kwargs)``; the MAP
    network alone when ``structure`` is None."""

    name: str
    subset: str = "all"
    structure: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_params: int | None = None
    fixed_point: bool = False  # GLAS refitted by fit_posterior_curvature (classification)
    fixed_point_steps: int = 8  # its n_steps
    link: str = "probit"  # classification's link_approx ('mc': MC_LINK_SAMPLES draws)


def glas_label(variant: dict[str, Any]) -> str:
    if not variant:
        return "GLAS (default)"
    return "GLAS " + ", ".join(f"{key}={value}" for key, value in variant.items())


def accepts(variant: dict[str, Any]) -> bool:
    """Whether the installed laplace_glas constructs a GLAS posterior with ``variant``."""
    model = make_mlp([1, 3, 1], dtype=DTYPE, seed=0)
    try:
        Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas", **variant)
    except ValueError:
        return False
    return True


def methods(variants: list[dict[str, Any]], k: int, full_max_params: int) -> list[Method]:
    out = [
        Method("MAP"),
        Method("kron", structure="kron"),
        Method("diag", structure="diag"),
        Method("last-layer kron", subset="last_layer", structure="kron"),
        Method("full", structure="full", max_params=full_max_params),
    ]
    for variant in variants:
        kwargs = {"n_components": k, **variant}
        out.append(Method(glas_label(variant), structure="glas", kwargs=kwargs))
    glas = {"n_components": k}
    out += [
        Method("kron, MC link", structure="kron", link="mc"),
        Method("GLAS (default), MC link", structure="glas", kwargs=glas, link="mc"),
        Method("GLAS posterior curvature", structure="glas", kwargs=glas, fixed_point=True),
        Method(
            "GLAS posterior curvature, MC link",
            structure="glas",
            kwargs=glas,
            fixed_point=True,
            link="mc",
        ),
        Method(
            "GLAS posterior curvature, complement=diag",
            structure="glas",
            kwargs={**glas, "complement": "diag"},
            fixed_point=True,
        ),
        Method(
            "GLAS posterior curvature, complement=diag, MC link",
            structure="glas",
            kwargs={**glas, "complement": "diag"},
            fixed_point=True,
            link="mc",
        ),
        Method("kron, bridge_norm link", structure="kron", link="bridge_norm"),
        Method(
            "GLAS posterior curvature, bridge_norm link",
            structure="glas",
            kwargs=glas,
            fixed_point=True,
            link="bridge_norm",
        ),
    ]
    return out


def per_step_count(method_list: list[Method], steps: list[int]) -> list[Method]:
    """Each posterior-curvature method once per ``n_steps`` in ``steps`` (named
    ``'<name>, n_steps=<n>'``), the other methods as they are."""
    return [
        variant
        for m in method_list
        for variant in (
            [replace(m, name=f"{m.name}, n_steps={n}", fixed_point_steps=n) for n in steps]
            if m.fixed_point
            else [m]
        )
    ]


def applies(method: Method, likelihood: str) -> bool:
    """Whether ``method`` runs on a problem of ``likelihood``: the posterior curvature
    and the link choice are classification's."""
    return likelihood == "classification" or (not method.fixed_point and method.link == "probit")


def predict(la: Any, problem: Problem, X: Tensor, batch: int = 250, link: str = "probit") -> Any:
    """The 'glm' predictive (``link`` for classification: laplace-torch's
    ``link_approx``, 'mc' with ``MC_LINK_SAMPLES`` draws from a generator seeded 0 per
    batch) of ``X``, or the MAP's."""
    parts = []
    with torch.no_grad():
        for start in range(0, len(X), batch):
            xb = X[start : start + batch]
            if la is None:
                out = problem.model(xb)
                if problem.likelihood == "classification":
                    parts.append(out.softmax(-1))
                else:
                    parts.append((out, torch.zeros_like(out)))
            elif problem.likelihood == "classification" and link == "mc":
                g = torch.Generator().manual_seed(0)
                parts.append(
                    la(
                        xb,
                        pred_type="glm",
                        link_approx="mc",
                        n_samples=MC_LINK_SAMPLES,
                        generator=g,
                    )
                )
            elif problem.likelihood == "classification":
                parts.append(la(xb, pred_type="glm", link_approx=link))
            else:
                f_mu, f_var = la(xb, pred_type="glm")
                if f_var.ndim == 3:
                    f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
                parts.append((f_mu, f_var.reshape(f_mu.shape).clamp(min=0)))
    if problem.likelihood == "classification":
        return torch.cat(parts)
    return torch.cat([m for m, _ in parts]), torch.cat([v for _, v in parts])


def evaluate(la: Any, problem: Problem, link: str = "probit") -> dict[str, float]:
    if problem.likelihood == "classification":
        probs = predict(la, problem, problem.X_test, link=link)
        probs_ood = predict(la, problem, problem.X_ood, link=link)
        metrics = classification_metrics(probs, problem.y_test, probs_ood)
        if problem.X_shift is not None:
            shifted = classification_metrics(
                predict(la, problem, problem.X_shift, link=link), problem.y_test, probs_ood
            )
            metrics.update(shift_nll=shifted["nll"], shift_ece=shifted["ece"])
        return metrics
    f_mu, f_var = predict(la, problem, problem.X_test)
    metrics = regression_metrics(f_mu, f_var, problem.y_test, problem.sigma)
    if problem.X_gap is not None:
        if la is None:
            metrics["gap_ratio"] = math.nan  # no posterior: no epistemic std
        else:
            std_gap = predict(la, problem, problem.X_gap)[1].sqrt().mean()
            std_train = predict(la, problem, problem.X_train)[1].sqrt().mean()
            metrics["gap_ratio"] = float(std_gap / std_train)
    return metrics


def short(err: BaseException, limit: int = 70) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_method(method: Method, problem: Problem) -> dict[str, Any]:
    """Fit, tune and evaluate one method; raises on failure. A GLAS posterior whose
    complement ``fit`` resolved adds it under ``"resolved"``."""
    if method.structure is None:
        return {**evaluate(None, problem), "fit_s": 0.0, "prior_s": 0.0}
    kwargs = dict(method.kwargs)
    if problem.likelihood == "regression":
        kwargs["sigma_noise"] = problem.sigma
    la = Laplace(
        problem.model,
        problem.likelihood,
        subset_of_weights=method.subset,
        hessian_structure=method.structure,
        **kwargs,
    )
    loader = DataLoader(TensorDataset(problem.X_train, problem.y_train), batch_size=256)
    start = time.perf_counter()
    if method.fixed_point:  # its evidence chooses the prior after every fit: all in fit_s
        fit_posterior_curvature(la, loader, n_steps=method.fixed_point_steps)
        fit_s, prior_s = time.perf_counter() - start, 0.0
    else:
        la.fit(loader)
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        la.optimize_prior_precision()  # laplace-torch's default: method='marglik'
        prior_s = time.perf_counter() - start
    prior = la.prior_precision
    prior = float(prior.detach().double().mean()) if isinstance(prior, Tensor) else float(prior)
    metrics = evaluate(la, problem, method.link)
    metrics.update(fit_s=fit_s, prior_s=prior_s, prior=prior)
    bad = [key for key, value in metrics.items() if key != "gap_ratio" and not math.isfinite(value)]
    if bad:
        raise FloatingPointError(f"non-finite {', '.join(bad)}")
    if method.structure == "glas" and getattr(la, "complement_reason", None):
        metrics["resolved"] = la.complement
    return metrics


# ---------------------------------------------------------------------------- tables
# (key, column header, format) per data set
COLUMNS = {
    "gap": [
        ("nll", "test NLL", ".3f"),
        ("gap_ratio", "gap ratio", ".2f"),
    ],
    "concrete": [
        ("nll", "test NLL", ".3f"),
        ("cov90", "90% coverage", ".3f"),
        ("width90", "90% width", ".3f"),
    ],
    "blobs": [
        ("nll", "test NLL", ".3f"),
        ("acc", "accuracy", ".3f"),
        ("ece", "ECE", ".3f"),
        ("brier", "Brier", ".3f"),
        ("auroc", "OOD AUROC", ".3f"),
    ],
}
COLUMNS["lstm"] = COLUMNS["transformer"] = COLUMNS["wine"] = COLUMNS["blobs"]
COLUMNS["digits"] = [
    *COLUMNS["blobs"][:3],
    ("shift_nll", "rotated NLL", ".3f"),
    ("shift_ece", "rotated ECE", ".3f"),
    COLUMNS["blobs"][4],
]
COMMON = [
    ("prior", "prior prec.", ".3g"),
    ("fit_s", "fit [s]", ".2f"),
    ("prior_s", "prior [s]", ".2f"),
]


def cell(values: list[float], spec: str) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, spec)
    return f"{format(mean, spec)} ± {format(statistics.stdev(values), spec)}"


@dataclass
class Row:
    results: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    n_failed: int = 0


def table(dataset: str, rows: dict[str, Row], n_seeds: int) -> str:
    columns = COLUMNS[dataset] + COMMON
    lines = [
        "| method | " + " | ".join(title for _, title, _ in columns) + " | note |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for name, row in rows.items():
        notes = list(dict.fromkeys(row.notes))
        if not row.results:
            cells = [notes[0] if notes else "failed"] + ["–"] * (len(columns) - 1)
            lines.append(f"| {name} | " + " | ".join(cells) + " | |")
            continue
        cells = [
            cell([r.get(key, math.nan) for r in row.results], spec) for key, _, spec in columns
        ]
        if name == "MAP":
            cells[-3:] = ["–", "–", "–"]
        if row.n_failed:
            notes.insert(0, f"{len(row.results)}/{n_seeds} seeds")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(notes)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="[0 1 2; quick 0]")
    parser.add_argument("--k", type=int, default=None, help="GLAS n_components [20; quick 5]")
    parser.add_argument(
        "--variants",
        type=str,
        default=None,
        help="GLAS variants, a JSON list of constructor-kwarg dicts "
        '(default: [{}], mean and sum with complement="zero", sum with "prior", and '
        'mean and sum with "diag" / "kron" where supported)',
    )
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="only these rows, by their names in the tables (default: all)",
    )
    parser.add_argument(
        "--fixed-point-steps",
        type=int,
        nargs="+",
        default=None,
        help="run each 'GLAS posterior curvature' row once per n_steps given (default: "
        "fit_posterior_curvature's own, 8)",
    )
    parser.add_argument("--concrete-data", type=Path, default=DEFAULT_CONCRETE)
    parser.add_argument(
        "--full-max-params", type=int, default=None, help="[3000; quick 1000: not wine, digits]"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, small sizes, k = 5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    args = parser.parse_args(argv)
    args.seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    args.k = args.k or (5 if args.quick else 20)
    if args.full_max_params is None:
        args.full_max_params = 1000 if args.quick else 3000
    if args.variants is not None:
        variants = json.loads(args.variants)
        if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
            parser.error("--variants must be a JSON list of objects")
        args.variants = variants
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    cfg = (
        Config(width=16, steps=300, n_gap=60, n_blobs=120, n_test=100, max_images=120)
        if args.quick
        else Config(width=32, steps=2000, n_gap=150, n_blobs=400, n_test=400)
    )
    out: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        out.append(text)

    argv_shown = sys.argv[1:] if argv is None else argv
    emit("# Predictive quality: GLAS vs laplace-torch's posteriors and the MAP network")
    emit()
    emit(f"machine: {machine_description()}")
    emit()
    emit(f"date: {time.strftime('%-d %B %Y, %H:%M UTC', time.gmtime())}")
    emit()
    emit(f"command: `{shlex.join(['python', 'benchmarks/value.py', *argv_shown])}`")
    emit()

    variants = args.variants
    if variants is None:
        variants = list(BASE_VARIANTS)
        for extra in (DIAG_VARIANTS, KRON_VARIANTS):
            if accepts(extra[0]):
                variants.extend(extra)
            else:
                name = extra[0]["complement"]
                emit(
                    f"note: this laplace_glas does not accept complement='{name}'; "
                    f"the GLAS complement={name} variants are skipped."
                )
                emit()
    method_list = methods(variants, args.k, args.full_max_params)
    if args.methods is not None:
        unknown = sorted(set(args.methods) - {m.name for m in method_list})
        if unknown:
            raise SystemExit(f"--methods: no rows named {unknown}")
        method_list = [m for m in method_list if m.name in args.methods]
    if args.fixed_point_steps is not None:
        method_list = per_step_count(method_list, args.fixed_point_steps)
    emit(
        f"Seeds {' '.join(map(str, args.seeds))}; float64 tanh MLPs 2 x {cfg.width} hidden, "
        f"MAP by {cfg.steps} full-batch Adam steps; GLAS k = {args.k}; prior precision "
        "of every posterior by `la.optimize_prior_precision()` (marglik); 'glm' predictive "
        "(probit for classification). Regression sigma = the MAP's RMSE on the training "
        "data (gap) or on a held-out calibration split (Concrete), plug-in, not refitted; "
        "y-predictive variance = f-variance + sigma^2. Cells: mean ± sd "
        "over seeds; fit and prior tuning in seconds. wine and digits are scikit-learn's "
        "bundled data sets (the 'bench' extra) with their own networks and training: wine "
        "a 13-32-32-3 tanh MLP, 1000 steps; digits a small CNN, 600 steps."
    )

    for dataset in args.datasets:
        emit()
        emit(f"## {dataset}")
        emit()
        if dataset == "concrete" and not args.concrete_data.is_file():
            emit(f"skipped: the Concrete data is not at {args.concrete_data}")
            continue
        if dataset in SKLEARN_DATASETS and importlib.util.find_spec("sklearn") is None:
            emit("skipped: scikit-learn is not installed (`pip install -e '.[bench]'`)")
            continue
        rows = {m.name: Row() for m in method_list if applies(m, LIKELIHOODS[dataset])}
        infos, dims = [], set()
        for seed in args.seeds:
            start = time.perf_counter()
            problem = make_problem(dataset, seed, cfg, args.concrete_data)
            D = sum(p.numel() for p in problem.model.parameters())
            dims.add(D)
            sigma = "" if problem.sigma is None else f", sigma {problem.sigma:.3f}"
            infos.append(f"seed {seed}: {problem.info}{sigma}")
            log(f"[{dataset} seed {seed}] MAP in {time.perf_counter() - start:.1f} s, D = {D}")
            for method in method_list:
                if method.name not in rows:
                    continue
                row = rows[method.name]
                if method.max_params is not None and D > method.max_params:
                    row.notes.append(f"skipped: D = {D} > {method.max_params}")
                    continue
                start, status = time.perf_counter(), "ok"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        result = run_method(method, problem)
                    resolved = result.pop("resolved", None)
                    if resolved is not None:
                        row.notes.append(f"'auto' -> '{resolved}'")
                    row.results.append(result)
                    status = f"ok, test NLL {result['nll']:.4f}"
                except Exception as err:  # a failed method must not stop the benchmark
                    row.n_failed += 1
                    status = f"failed: {short(err)}"
                    row.notes.append(status)
                elapsed = time.perf_counter() - start
                log(f"[{dataset} seed {seed}] {method.name}: {elapsed:.1f} s, {status}")
        emit(f"D = {', '.join(map(str, sorted(dims)))} weights. " + "; ".join(infos) + ".")
        emit()
        emit(table(dataset, rows, len(args.seeds)))

    emit()
    emit(f"total {time.perf_counter() - started:.0f} s")
    if args.out is not None:
        args.out.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
