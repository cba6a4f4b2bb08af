"""Uniform access to training batches: ``(X, y)`` tuples or dict-like batches.

laplace-torch accepts loaders yielding ``(X, y)`` or a mapping holding the input
(the whole mapping is passed to the model) and the target under ``dict_key_y``.
curvlinops wants ``(X, y)`` pairs; :class:`XYBatches` adapts one to the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

__all__ = [
    "MissingKeyError",
    "SubBatches",
    "XYBatches",
    "batch_copy",
    "batch_input",
    "batch_size",
    "batch_to_device",
    "check_finite",
    "check_input_dtype",
    "concatenate_inputs",
    "dataset_size",
    "scored_pair",
    "slice_batch",
    "slices_agree",
    "split_batch",
    "split_batch_to",
    "subsample_loader",
]


class MissingKeyError(KeyError, ValueError):
    """A dict batch lacks the key ``dict_key_x`` or ``dict_key_y`` names.

    A ``KeyError``, as laplace-torch's own lookup raises, and a ``ValueError`` with a
    message that names the key and the batch's keys.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def split_batch(data: Any, dict_key_y: str = "labels") -> tuple[Any, torch.Tensor]:
    """``(X, y)`` of one batch; a mapping stays whole as ``X``."""
    if isinstance(data, MutableMapping):
        if dict_key_y not in data:
            raise MissingKeyError(
                f"A dict batch has no target under dict_key_y={dict_key_y!r}; its keys are "
                f"{sorted(map(str, data.keys()))}."
            )
        return data, data[dict_key_y]
    try:
        X, y = data
    except (TypeError, ValueError):
        raise ValueError(
            "Each batch must be an (X, y) pair or a mapping with the target under "
            f"dict_key_y='{dict_key_y}'."
        ) from None
    return X, y


def split_batch_to(
    data: Any, device: torch.device | str, dict_key_y: str = "labels"
) -> tuple[Any, torch.Tensor]:
    """:func:`split_batch` with a tensor input and the target moved to ``device`` (a
    mapping input is passed whole, as it is, to the model).
    """
    X, y = split_batch(data, dict_key_y)
    if not isinstance(y, torch.Tensor):
        where = f" under dict_key_y={dict_key_y!r}" if isinstance(data, MutableMapping) else ""
        raise TypeError(
            f"The batch's targets{where} are a {type(y).__name__}, not a tensor: give "
            "them as a torch.Tensor (e.g. torch.tensor(labels), as Hugging Face's data "
            "collators return them)."
        )
    return (X.to(device) if isinstance(X, torch.Tensor) else X), y.to(device)


def scored_pair(
    batch: Any,
    likelihood: str,
    ignore_index: int,
    dict_key_y: str,
    needs: str,
    error: type[ValueError] = ValueError,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(X, y)`` of ``batch`` with the padded classification targets left out (``(None,
    None)`` when nothing is left), for a curvature pass that takes tensor inputs and one
    class label per input (``complement='diag'`` and ``'kron'``).

    ``needs`` names the caller in the messages (``"complement='diag' needs tensor inputs
    (...)"``); a batch it cannot take raises ``error``.
    """
    X, y = split_batch(batch, dict_key_y)
    complement = needs.split(" ", 1)[0]
    if not isinstance(X, torch.Tensor):
        raise error(f"{needs}; got inputs of type {type(X).__name__}.")
    if likelihood != "regression":
        if y.ndim != 1:
            raise error(
                f"{complement} takes one class label per input (outputs (batch, C)); got "
                f"targets of shape {tuple(y.shape)}. Use complement='zero' or 'prior'."
            )
        keep = y != ignore_index
        if not bool(keep.any()):
            return None, None
        X, y = X[keep], y[keep]
    return X, y


def batch_input(X: Any, dict_key_x: str = "input_ids") -> Any:
    """The entry of a dict batch that holds the batch axis, ``X[dict_key_x]`` (any
    other input is returned as it is).

    Raises
    ------
    MissingKeyError
        When a dict batch has no entry ``dict_key_x`` (the message names the batch's
        keys).

    """
    if isinstance(X, Mapping):
        if dict_key_x not in X:
            raise MissingKeyError(
                f"A dict batch has no input under dict_key_x={dict_key_x!r}; its keys are "
                f"{sorted(map(str, X.keys()))}."
            )
        return X[dict_key_x]
    return X


def batch_size(X: Any, dict_key_x: str = "input_ids") -> int:
    """Number of data points in an input batch."""
    return int(batch_input(X, dict_key_x).shape[0])


def concatenate_inputs(
    Xs: list[Any], dict_key_y: str = "labels", pad_value: float | None = None
) -> torch.Tensor | dict[str, Any]:
    """Input batches joined along the batch axis.

    Tensors are concatenated; for mappings (e.g. ``input_ids`` and ``attention_mask``
    of a Hugging Face batch) every tensor entry is concatenated on its own and the
    target ``dict_key_y`` is dropped. With a ``pad_value``, sequence entries
    (``ndim >= 2``) of different lengths are right-padded on axis 1 with it (an
    attention mask of 0 there hides the padding from the model; padded targets are
    ``ignore_index``); without one, such entries raise in ``torch.cat``.
    """

    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        if (
            pad_value is not None
            and tensors[0].ndim >= 2
            and len({t.shape[1] for t in tensors}) > 1
        ):
            length = max(t.shape[1] for t in tensors)
            tensors = [
                torch.nn.functional.pad(
                    t, [0, 0] * (t.ndim - 2) + [0, length - t.shape[1]], value=pad_value
                )
                for t in tensors
            ]
        return torch.cat(tensors)

    if not isinstance(Xs[0], MutableMapping):
        return join(Xs)
    keys = [k for k, v in Xs[0].items() if k != dict_key_y and isinstance(v, torch.Tensor)]
    return {key: join([X[key] for X in Xs]) for key in keys}


def check_finite(what: str, tensor: Any, batch_index: int) -> None:
    """Raise ``ValueError`` if a floating tensor holds NaN or inf."""
    if isinstance(tensor, MutableMapping):
        for key, value in tensor.items():
            check_finite(f"{what}['{key}']", value, batch_index)
        return
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{what} of batch {batch_index} contains NaN or inf.")


def check_input_dtype(what: str, X: Any, dtype: torch.dtype, batch_index: int) -> None:
    """Raise a ``TypeError`` naming the conversion if a floating input tensor is not in
    the model's ``dtype`` (a float64 batch for a float32 model fails inside the first
    layer otherwise).
    """
    if isinstance(X, torch.Tensor) and X.is_floating_point() and X.dtype != dtype:
        have, want = (str(t).replace("torch.", "") for t in (X.dtype, dtype))
        raise TypeError(
            f"{what} of batch {batch_index} are {have} but the model's parameters are "
            f"{want}: convert the data (x.to(torch.{want})) or the model (model.to(torch.{have}))."
        )


def _map_tensors(X: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to ``X`` if it is a tensor, else to the tensor values of a mapping
    (other values and other inputs unchanged).
    """
    if isinstance(X, torch.Tensor):
        return fn(X)
    if isinstance(X, Mapping):
        return {
            key: fn(value) if isinstance(value, torch.Tensor) else value for key, value in X.items()
        }
    return X


def batch_to_device(X: Any, device: torch.device | str) -> Any:
    """``X`` on ``device``: a tensor, or the tensor values of a mapping (other values and
    other inputs unchanged).
    """
    return _map_tensors(X, lambda t: t.to(device))


def batch_copy(X: Any) -> Any:
    """``X`` with its tensors copied: a tensor, or a mapping's tensor values (for data
    kept beyond the loader's next step, which may refill its tensors in place).
    """
    return _map_tensors(X, torch.Tensor.clone)


class XYBatches:
    """Re-iterable view of a loader as ``(X, y)`` pairs, for curvlinops."""

    def __init__(self, loader: Iterable, dict_key_y: str = "labels"):
        self.loader = loader
        self.dict_key_y = dict_key_y

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        for data in self.loader:
            yield split_batch(data, self.dict_key_y)

    def __len__(self) -> int:
        """The loader's number of batches (``TypeError`` if it has no length)."""
        return len(self.loader)

    @property
    def unit(self) -> str:
        """What one of its batches is called in messages: ``'slice'`` for the slices of
        :class:`SubBatches`, else ``'batch'``.
        """
        return "slice" if isinstance(self.loader, SubBatches) else "batch"


class SubBatches:
    """Re-iterable view of a loader whose batches are cut into slices of at most
    ``size`` examples along the first axis (a memory bound: a product's graph is one
    slice's).

    Every tensor whose first axis has the batch's length is sliced (``X``, ``y``, the
    entries of a mapping batch); other entries are passed whole. A summed (or per-
    example averaged) loss has the same curvature on the slices as on their batch.
    ``len`` is ``count`` where the caller knows it (the planner, from the batch sizes),
    else the loader's batches times the slices of a full one: of the loader's
    ``batch_size``, else of ``full`` (the caller's largest batch's size), else of
    ``size`` (an upper bound when some batches are shorter).
    """

    def __init__(
        self,
        loader: Iterable,
        size: int,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        full: int | None = None,
        count: int | None = None,
    ):
        self.loader, self.size = loader, max(1, int(size))
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.full = getattr(loader, "batch_size", None) or full
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        for data in self.loader:
            b = batch_size(split_batch(data, self.dict_key_y)[0], self.dict_key_x)
            for start in range(0, b, self.size):
                yield slice_batch(data, b, start, start + self.size)

    def __len__(self) -> int:
        """The number of slices: ``count`` where the caller knows it, else counted from
        full batches (``TypeError`` if the loader has no length).
        """
        if self.count is not None:
            return self.count
        full = self.full or self.size
        return len(self.loader) * -(-full // self.size)


def slice_batch(value: Any, b: int, start: int, stop: int) -> Any:
    """``value[start:stop]`` for the tensors of a batch whose first axis is ``b`` long
    (mappings, tuples and lists entry by entry; anything else whole).
    """
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.ndim > 0 and value.shape[0] == b else value
    if isinstance(value, Mapping):
        items = {k: slice_batch(v, b, start, stop) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:
            return items
    if isinstance(value, tuple | list):
        return type(value)(slice_batch(v, b, start, stop) for v in value)
    return value


def slices_agree(model: Any, X: Any, size: int, dict_key_x: str = "input_ids") -> bool:
    """Whether ``model``'s outputs on the ``size``-example slices of the input batch
    ``X`` (:func:`slice_batch`) are its outputs on ``X`` cut the same way (no
    gradients): the check that the first axis is the batch axis and that the examples
    do not interact, before :class:`SubBatches` may stand for the batches.
    """
    b = batch_size(X, dict_key_x)
    with torch.no_grad():
        whole = model(X)
        if not isinstance(whole, torch.Tensor) or whole.ndim == 0 or whole.shape[0] != b:
            return False
        for start in range(0, b, size):
            part = model(slice_batch(X, b, start, start + size))
            atol = 1e-5 * float(whole.abs().max()) + 1e-30
            if not torch.allclose(part, whole[start : start + size], rtol=1e-4, atol=atol):
                return False
    return True


def dataset_size(
    loader: Iterable, dict_key_x: str = "input_ids", dict_key_y: str = "labels"
) -> int:
    """``len(loader.dataset)`` when there is one, else a count over the batches."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        try:
            return len(dataset)
        except TypeError:
            pass
    return sum(batch_size(split_batch(d, dict_key_y)[0], dict_key_x) for d in loader)


def subsample_loader(loader: DataLoader, size: int, generator: torch.Generator) -> DataLoader:
    """A loader over ``size`` points drawn without replacement from ``loader.dataset``.

    Keeps the batch size and collate function; the draw is fixed by ``generator``.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise ValueError("subsample_size needs a DataLoader with a `dataset`.")
    n = len(dataset)
    if not 1 <= size <= n:
        raise ValueError(f"subsample_size={size} must lie in [1, {n}] (the data set size).")
    index = torch.randperm(n, generator=generator)[:size].sort().values.tolist()
    return DataLoader(
        Subset(dataset, index),
        batch_size=loader.batch_size or 1,
        shuffle=False,
        collate_fn=loader.collate_fn,
    )
