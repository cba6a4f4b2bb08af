"""Data loaders and small training helpers for the examples.

A leaf module: nothing in the core of :mod:`laplace_glas` imports it. Paths in,
tensors out; no plotting.

- :func:`known_noise_regression`: the paper's 1-D toy problem ``y = sin(3x) + sigma eps``
  with known noise ``sigma``.
- :func:`make_mlp` and :func:`train_map`: a tanh MLP and an Adam fit of its *mean* loss
  (the MAP that GLAS linearises around).
- :func:`load_concrete`: the UCI Concrete Compressive Strength data set (1030 x 8).
- :func:`standardize` and :func:`split`: the usual preprocessing.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from laplace_glas.applications.cli import DataNotFoundError

__all__ = [
    "CONCRETE_N_FEATURES",
    "known_noise_regression",
    "load_concrete",
    "make_mlp",
    "split",
    "standardize",
    "train_map",
]

#: Number of input features of the UCI concrete data (the ninth column is the target).
CONCRETE_N_FEATURES = 8

_CONCRETE_SOURCE = (
    "UCI Machine Learning Repository, 'Concrete Compressive Strength', id 165 "
    "(https://archive.ics.uci.edu/dataset/165/concrete+compressive+strength), "
    "licence CC BY 4.0; I-Cheng Yeh, Cement and Concrete Research 28(12), 1998"
)


def known_noise_regression(
    n: int,
    noise: float = 0.1,
    x_range: tuple[float, float] = (-2.0, 2.0),
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Draw the known-noise scalar regression problem ``y = sin(3x) + noise * eps``.

    Parameters
    ----------
    n : int
        Number of points (``>= 1``).
    noise : float, default=0.1
        Standard deviation ``sigma`` of the Gaussian observation noise (``>= 0``).
    x_range : tuple of float, default=(-2.0, 2.0)
        ``(low, high)`` of the uniform input distribution, ``low < high``.
    generator : torch.Generator, optional
        CPU generator for the inputs and the noise (torch's global RNG if None).
    dtype : torch.dtype, default=torch.float32
        Floating-point dtype of the returned tensors.

    Returns
    -------
    X : torch.Tensor
        ``(n, 1)`` inputs, ``x ~ U(low, high)``.
    y : torch.Tensor
        ``(n, 1)`` targets ``sin(3x) + noise * eps``, ``eps ~ N(0, 1)``.

    Raises
    ------
    ValueError
        If ``n < 1``, ``noise < 0`` or the range is empty or not finite.

    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}.")
    if not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}.")
    low, high = (float(v) for v in x_range)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"x_range must be finite with low < high, got {x_range!r}.")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}.")
    X = low + (high - low) * torch.rand(n, 1, generator=generator, dtype=dtype)
    eps = torch.randn(n, 1, generator=generator, dtype=dtype)
    y = torch.sin(3 * X) + noise * eps
    return X, y


def make_mlp(
    widths: Sequence[int],
    activation: type[nn.Module] = nn.Tanh,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> nn.Sequential:
    """A fully connected network ``Linear -> activation -> ... -> Linear``.

    ``make_mlp([1, 50, 50, 1])`` is the paper's 1-50-50-1 tanh MLP with
    ``D = 2701`` parameters.

    Parameters
    ----------
    widths : sequence of int
        Layer widths, input first and output last (at least two entries, all ``>= 1``).
    activation : type of torch.nn.Module, default=torch.nn.Tanh
        Activation class, instantiated between consecutive linear layers (not after
        the last one).
    dtype : torch.dtype, default=torch.float32
        Parameter dtype.
    seed : int, optional
        Seed for the initialisation. It is applied inside a forked RNG, so torch's
        global random state is left unchanged; if None, the global RNG is used.

    Returns
    -------
    torch.nn.Sequential
        The network.

    """
    widths = list(widths)
    if len(widths) < 2:
        raise ValueError(f"widths needs an input and an output width, got {widths!r}.")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be positive ints, got {widths!r}.")

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(fan_in, fan_out, dtype=dtype))
            if i < len(widths) - 2:
                layers.append(activation())
        return nn.Sequential(*layers)

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def train_map(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    *,
    steps: int = 2000,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int | None = None,
    loss: str = "mse",
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Fit ``model`` by Adam on the *mean* training loss (the MAP GLAS starts from).

    Parameters
    ----------
    model : torch.nn.Module
        The network; trained in place.
    X, y : torch.Tensor
        Training inputs ``(N, ...)`` and targets: ``(N, C)`` floats for ``'mse'``,
        ``(N,)`` integer labels for ``'ce'``.
    steps : int, default=2000
        Number of optimizer steps (each on one batch).
    lr : float, default=1e-2
        Adam learning rate.
    weight_decay : float, default=0.0
        Adam's (L2) weight decay.
    batch_size : int, optional
        Minibatch size; None (or ``>= N``) for full-batch steps. Minibatches are drawn
        without replacement, reshuffling after every pass over the data.
    loss : {'mse', 'ce'}, default='mse'
        Mean squared error (regression) or cross-entropy (classification), both
        averaged over the batch.
    generator : torch.Generator, optional
        CPU generator for the minibatch order (unused for full batches).

    Returns
    -------
    torch.nn.Module
        ``model``, in eval mode.

    """
    if loss not in ("mse", "ce"):
        raise ValueError(f"loss must be 'mse' or 'ce', got {loss!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}.")
    if X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(
            f"X and y need the same, non-zero number of rows; got {X.shape[0]} and {y.shape[0]}."
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}.")
    n = X.shape[0]
    full_batch = batch_size is None or batch_size >= n
    loss_fn: nn.Module = nn.MSELoss() if loss == "mse" else nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    order, position = torch.empty(0, dtype=torch.long), n
    for _ in range(steps):
        if full_batch:
            xb, yb = X, y
        else:
            if position + batch_size > n:
                order = torch.randperm(n, generator=generator).to(X.device)
                position = 0
            idx = order[position : position + batch_size]
            position += batch_size
            xb, yb = X[idx], y[idx]
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        optimizer.step()
    model.eval()
    return model


def _parse_number(field: str) -> float:
    """A float from a CSV field, accepting a decimal comma (``'2,5'``)."""
    text = field.strip()
    if "," in text and "." not in text:
        text = text.replace(",", ".")
    value = float(text)  # ValueError on anything else
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {field!r}")
    return value


def _read_concrete_excel(path: Path) -> list[tuple[int, str]]:
    """The first sheet of UCI's ``Concrete_Data.xls`` as ``';'``-joined numbered lines,
    read with pandas (and xlrd for ``.xls``, openpyxl for ``.xlsx``): the optional
    ``xls`` extra.
    """
    try:
        import pandas
    except ImportError:
        raise DataNotFoundError(
            f"reading {path.name} needs pandas and xlrd (pip install -e '.[xls]'); or pass "
            "--data PATH to a ';'-separated Concrete_Data.csv (the sheet saved as CSV)."
        ) from None
    try:
        frame = pandas.read_excel(path, sheet_name=0, header=None)
    except ImportError as err:  # pandas without the engine for this format
        raise DataNotFoundError(
            f"reading {path.name} needs pandas' Excel engine ({err}); pip install -e "
            "'.[xls]', or pass --data PATH to a ';'-separated Concrete_Data.csv."
        ) from None
    rows = frame.astype(str).values.tolist()
    return [(i, ";".join(row)) for i, row in enumerate(rows, start=1)]


def load_concrete(path: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """Read the UCI Concrete Compressive Strength data from a CSV file (or UCI's
    ``Concrete_Data.xls`` with the optional ``xls`` extra: pandas and xlrd).

    The expected format is that of ``Concrete_Data.csv``: one header row, then one row
    per mix with 8 features (cement, blast furnace slag, fly ash, water,
    superplasticizer, coarse aggregate, fine aggregate, age in days) and the target
    (compressive strength, MPa), ``;``-separated (``,`` is accepted as the separator
    when the header holds no ``;``). Decimal commas are accepted with ``;`` as the
    separator; CRLF line ends, a UTF-8 byte-order mark and blank lines are ignored.
    The file of the UCI repository has 1030 rows.

    Parameters
    ----------
    path : str or os.PathLike
        The CSV file, or an ``.xls`` / ``.xlsx`` workbook whose first sheet holds the
        same table (needs pandas and its Excel engine, ``pip install -e '.[xls]'``).

    Returns
    -------
    X : torch.Tensor
        ``(n, 8)`` float32 features, unscaled.
    y : torch.Tensor
        ``(n, 1)`` float32 compressive strength (MPa).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist (the message says where to get the data), or it
        is a workbook and pandas or its Excel engine is not installed.
    ValueError
        If the file has no data rows, a row has the wrong number of fields, or a
        field is not a finite number (the message names the line).

    """
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(
            f"Concrete data not found at {str(path)!r}: pass --data PATH to the "
            f"Concrete_Data.xls of the {_CONCRETE_SOURCE} (read with pip install -e "
            "'.[xls]') or to that sheet saved as a ';'-separated CSV."
        )
    if path.suffix.lower() in (".xls", ".xlsx"):
        lines = _read_concrete_excel(path)
    else:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            lines = [(i, line.strip()) for i, line in enumerate(handle, start=1)]
    lines = [(i, line) for i, line in lines if line]
    if not lines:
        raise ValueError(f"{path}: the file is empty.")

    n_columns = CONCRETE_N_FEATURES + 1
    delimiter = ";" if ";" in lines[0][1] else ","
    header = lines[0][1].split(delimiter)
    if len(header) != n_columns:
        raise ValueError(
            f"{path}, line {lines[0][0]}: expected {n_columns} {delimiter!r}-separated "
            f"columns (8 features and the target), got {len(header)}."
        )
    try:  # a file without a header row starts with data
        [_parse_number(field) for field in header]
        body = lines
    except ValueError:
        body = lines[1:]

    rows: list[list[float]] = []
    for line_no, line in body:
        fields = line.split(delimiter)
        if len(fields) != n_columns:
            raise ValueError(
                f"{path}, line {line_no}: expected {n_columns} fields, got {len(fields)}: {line!r}."
            )
        try:
            rows.append([_parse_number(field) for field in fields])
        except ValueError as err:
            raise ValueError(f"{path}, line {line_no}: {err}.") from None
    if not rows:
        raise ValueError(f"{path}: the file has a header but no data rows.")
    data = torch.tensor(rows, dtype=torch.float64).to(torch.float32)
    return data[:, :CONCRETE_N_FEATURES].contiguous(), data[:, CONCRETE_N_FEATURES:].contiguous()


def standardize(train: Tensor, *others: Tensor) -> tuple[Tensor, ...]:
    """Scale columns to zero mean and unit variance with the *training* statistics.

    Parameters
    ----------
    train : torch.Tensor
        ``(n, ...)`` training data; the statistics are taken over dimension 0.
    *others : torch.Tensor
        Further tensors (validation, test) transformed with the same statistics.

    Returns
    -------
    tuple of torch.Tensor
        ``(train_std, *others_std, mean, std)``. ``std`` is the (unbiased) standard
        deviation of ``train``, with constant columns given ``std = 1`` so they map to
        zero instead of NaN. Undo with ``z * std + mean``.

    """
    if train.ndim == 0 or train.shape[0] < 2:
        raise ValueError("standardize needs at least two training rows.")
    mean = train.mean(dim=0, keepdim=True)
    std = train.std(dim=0, keepdim=True)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return ((train - mean) / std, *((t - mean) / std for t in others), mean, std)


def split(
    X: Tensor,
    y: Tensor,
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
    generator: torch.Generator | None = None,
) -> tuple[tuple[Tensor, Tensor], ...]:
    """Randomly partition ``(X, y)`` into disjoint parts (train/calibration/test).

    Parameters
    ----------
    X, y : torch.Tensor
        Inputs and targets with the same number of rows.
    fractions : sequence of float, default=(0.7, 0.15, 0.15)
        Non-negative shares of the rows, summing to 1. Part sizes are rounded so that
        they add up to the number of rows.
    generator : torch.Generator, optional
        CPU generator for the permutation (torch's global RNG if None).

    Returns
    -------
    tuple of (X_part, y_part)
        One pair per entry of ``fractions`` (three by default).

    """
    n = X.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"X and y need the same number of rows; got {n} and {y.shape[0]}.")
    fractions = [float(f) for f in fractions]
    if not fractions or any(f < 0 or not math.isfinite(f) for f in fractions):
        raise ValueError(f"fractions must be finite and >= 0, got {fractions!r}.")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must sum to 1, got {fractions!r} (sum {sum(fractions)}).")
    perm = torch.randperm(n, generator=generator).to(X.device)
    bounds, cumulative = [0], 0.0
    for f in fractions:
        cumulative += f
        bounds.append(round(min(cumulative, 1.0) * n))
    bounds[-1] = n
    parts = []
    for start, stop in itertools.pairwise(bounds):
        idx = perm[start:stop]
        parts.append((X[idx], y[idx]))
    return tuple(parts)


def concrete_splits(
    path: str | os.PathLike,
    generator: torch.Generator | None = None,
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
) -> tuple[tuple[Tensor, Tensor], ...]:
    """UCI Concrete as standardised train / calibration / test ``(X, y)`` pairs.

    :func:`load_concrete`, then :func:`split` with ``generator``, then inputs and
    targets each standardised with the training part's statistics.
    """
    X, y = load_concrete(path)
    parts = split(X, y, fractions, generator=generator)
    Xs = standardize(*(X for X, _ in parts))[: len(parts)]
    ys = standardize(*(y for _, y in parts))[: len(parts)]
    return tuple(zip(Xs, ys))
