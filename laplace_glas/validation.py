"""Argument checks shared by the modules: one message for one kind of mistake.

Every check refuses a value the library cannot use where it enters (constructor,
setter, ``load_state_dict``, method argument) with a ``ValueError`` or an
:class:`ArgumentTypeError` that names the argument and the accepted range, and returns
the value in the form the library stores.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "ArgumentTypeError",
    "check_model_output",
    "choice",
    "finite_number",
    "flag",
    "homoscedastic_noise",
    "integer",
    "lanczos_basis_size",
    "parameter_dtype",
    "positive_int",
    "positive_scalar",
    "prior_precision_values",
    "reiterable",
    "scalar_prior_precision",
    "scalar_value",
    "seed",
    "tolerance",
    "user_stacklevel",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a string for a number, a float16 model, ...).

    A ``TypeError`` by Python's convention and a ``ValueError`` by laplace-torch's,
    which raises ``ValueError`` for these mistakes: code written against either
    catches it.
    """


SUPPORTED_DTYPES = (torch.float32, torch.float64)
"""Parameter dtypes the eigen-solve and the closed forms run in."""

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def positive_int(name: str, value: Any, *, allow_none: bool = True) -> int | None:
    """``value`` as an ``int`` (numpy integers included), or None where allowed.

    Bools, non-integers and values below 1 are refused with a ``ValueError`` that
    names the argument.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        wanted = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")
    return int(value)


def integer(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` in ``[low, high]`` (numpy integers included, bools not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}.")
    return int(value)


def seed(value: Any) -> int:
    """A seed ``torch.Generator.manual_seed`` accepts."""
    return integer("seed", value, *_SEED_RANGE)


def scalar_value(name: str, value: Any) -> float:
    """A real number given as a Python/numpy number or a one-element tensor/array.

    Raises ``TypeError`` for anything else (strings, bools, complex numbers, tensors
    of more than one element: the message names their shape).
    """
    if isinstance(value, bool) or isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a real number, got {value!r}.")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ArgumentTypeError(
                f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}."
            )
        if value.is_complex() or value.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must be a real number, got a {value.dtype} tensor.")
        return float(value.detach().reshape(()).item())
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and getattr(value, "size", None) == 1:  # numpy array
        return scalar_value(name, value.reshape(()).item())
    raise ArgumentTypeError(
        f"{name} must be a real number, got {type(value).__name__} ({value!r})."
    )


def finite_number(name: str, value: Any, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite real ``value`` in ``[low, high]`` (see :func:`scalar_value`)."""
    number = scalar_value(name, value)
    if not (math.isfinite(number) and low <= number <= high):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {number}.")
    return number


def positive_scalar(
    name: str,
    value: Any,
    *,
    allow_zero: bool = False,
    dtype: torch.dtype | None = None,
    power: int = 1,
) -> float:
    """A finite real ``value > 0`` (``>= 0`` with ``allow_zero``).

    Used for ``sigma_noise``, ``temperature`` and the scalar prior precision, where
    zero, negative, NaN or infinite values give NaN or negative variances. With a
    ``dtype``, a nonzero ``value ** power`` and its reciprocal must also be finite and
    nonzero in that dtype (``sigma ** 2``, ``1 / tau`` and ``1 / T`` are computed in
    the model's precision: 1e-300 would become 0, 1e30 squared inf in float32).
    """
    number = scalar_value(name, value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        wanted = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {wanted}, got {number}.")
    if dtype is not None and number > 0:
        info = torch.finfo(dtype)
        low, high = math.log(info.tiny) / power, math.log(info.max) / power
        if not low < math.log(number) < high:
            raise ValueError(
                f"{name}={number:g} is out of the range {math.exp(low):.1e}..{math.exp(high):.1e} "
                f"that {str(dtype).replace('torch.', '')} computations with it can represent."
            )
    return number


def parameter_dtype(params: Iterable[torch.Tensor]) -> torch.dtype:
    """The common dtype of ``params``: float32 or float64.

    Half precision is refused: the eigen-solve (ARPACK, Rayleigh-Ritz) and the closed
    forms lose all accuracy in 16 bits, and SciPy has no bfloat16.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        raise ArgumentTypeError(
            f"The parameters under inference mix dtypes ({names}); convert the model "
            "to one of float32 or float64, e.g. model.float()."
        )
    (dtype,) = dtypes
    if dtype not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(
            f"GLAS needs float32 or float64 parameters, got {str(dtype).replace('torch.', '')}"
            ": the eigen-solve and the closed-form posterior lose their accuracy in 16-bit "
            "floats. Fit a float32 copy (model.float()) and cast back for inference if needed."
        )
    return dtype


def check_model_output(out: Any) -> torch.Tensor:
    """The model's output must be one tensor ``(batch, ..., outputs)``."""
    if isinstance(out, torch.Tensor):
        return out
    kind = type(out).__name__
    hint = ""
    if isinstance(out, (tuple, list)):
        hint = " (e.g. `return self.net(x)[0]`)"
    elif hasattr(out, "keys"):
        keys = ", ".join(repr(k) for k in list(out.keys())[:5])
        hint = f" (e.g. `return self.net(x)['logits']`; the output has keys {keys})"
        if "logits" in out.keys():
            hint += "; for a Hugging Face model: laplace_glas.huggingface.LogitsModel(model)"
    raise ArgumentTypeError(
        f"The model returned a {kind}, but GLAS (like laplace-torch) needs one tensor of "
        "shape (batch, outputs) or (batch, seq_len, classes). Wrap the model in an "
        f"nn.Module whose forward returns that tensor{hint}."
    )


def reiterable(name: str, loader: Any) -> Any:
    """``loader`` must yield its batches again on every ``iter()`` (a ``DataLoader``,
    a list of batches): the fit passes over the data many times.
    """
    if isinstance(loader, Iterator) or not isinstance(loader, Iterable):
        what = "a one-shot iterator" if isinstance(loader, Iterator) else type(loader).__name__
        raise ArgumentTypeError(
            f"{name} must be re-iterable (a DataLoader or a list of batches), got {what}: "
            "the eigen-solve passes over the data once per GGN product."
        )
    return loader


def scalar_prior_precision(prior_precision: Any, dtype: torch.dtype | None = None) -> None:
    """GLAS's closed forms take one prior precision ``tau >= 0`` for all weights.

    ``tau = 0`` (a flat prior) is accepted here; the computations that need a proper
    prior (the complement's variance, the evidence, directions without curvature)
    refuse it where they are asked for.
    """
    if isinstance(prior_precision, torch.Tensor) and prior_precision.numel() != 1:
        raise ValueError(
            "prior_precision must be one number: GLAS's closed forms need a scalar "
            f"(isotropic) prior precision; got one of shape {tuple(prior_precision.shape)}."
        )
    positive_scalar("prior_precision", prior_precision, allow_zero=True, dtype=dtype)


def prior_precision_values(
    prior_precision: Any, n_layers: int, n_params: int, dtype: torch.dtype | None = None
) -> None:
    """A prior precision GLAS can use: one number ``tau >= 0`` (see
    :func:`scalar_prior_precision`), or a 1-D tensor of ``n_layers`` (one per parameter
    tensor) or ``n_params`` (one per weight) positive, finite values.
    """
    if isinstance(prior_precision, torch.Tensor) and prior_precision.ndim > 1:
        raise ValueError(
            "prior_precision must be a number or a 1-D tensor (as in laplace-torch), got "
            f"one of shape {tuple(prior_precision.shape)}."
        )
    if not isinstance(prior_precision, torch.Tensor) or prior_precision.numel() == 1:
        scalar_prior_precision(prior_precision, dtype)
        return
    if prior_precision.ndim != 1 or prior_precision.numel() not in (n_layers, n_params):
        raise ValueError(
            "prior_precision must be one number, one value per parameter tensor "
            f"(n_layers={n_layers}) or one per weight (D={n_params}); got one of shape "
            f"{tuple(prior_precision.shape)}."
        )
    if not prior_precision.is_floating_point():
        raise TypeError(
            f"prior_precision must be a floating-point tensor, got {prior_precision.dtype}."
        )
    values = prior_precision.detach()
    if dtype is not None:
        values = values.to(dtype)
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(
            "A layerwise or diagonal prior_precision must be positive and finite in every "
            f"entry; got min {float(values.min()):.3g}, max {float(values.max()):.3g}."
        )


def homoscedastic_noise(
    sigma_noise: Any, dtype: torch.dtype | None = None, likelihood: str = "regression"
) -> None:
    """One homoscedastic observation noise ``sigma > 0`` (exactly 1 for classification)."""
    if isinstance(sigma_noise, torch.Tensor) and sigma_noise.ndim > 1:
        raise ValueError(
            "sigma_noise must be a scalar or a one-element vector (as in laplace-torch); "
            f"got a tensor of shape {tuple(sigma_noise.shape)}."
        )
    if isinstance(sigma_noise, torch.Tensor) and sigma_noise.numel() > 1:
        raise ValueError(
            "sigma_noise must be one scalar (homoscedastic noise, as in laplace-torch); "
            f"got a tensor of shape {tuple(sigma_noise.shape)}. For outputs of different "
            "scales, standardise the targets."
        )
    sigma = positive_scalar("sigma_noise", sigma_noise, dtype=dtype, power=2)
    if likelihood != "regression" and sigma != 1:
        raise ValueError(
            f"sigma_noise is for regression; {likelihood} needs sigma_noise=1, got {sigma}."
        )


def lanczos_basis_size(ncv: Any, k: int, n_params: int) -> int | None:
    """ARPACK's basis size ``ncv`` (None: its default) must satisfy ``k < ncv <= D``."""
    ncv = positive_int("ncv", ncv)
    if ncv is not None and not k < ncv <= n_params:
        raise ValueError(
            f"ncv (the Lanczos basis size) must satisfy n_components < ncv <= D, i.e. "
            f"{k} < ncv <= {n_params}; got ncv={ncv}."
        )
    return ncv


def tolerance(value: Any) -> float:
    """A solver tolerance: a finite number >= 0 (0: the dtype's precision)."""
    try:
        tol = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"tol must be a non-negative number, got {value!r}.") from None
    if not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a non-negative number, got {value!r}.")
    return tol


def flag(name: str, value: Any) -> bool:
    """``value`` must be a bool (numpy bools included)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


def choice(name: str, value: Any, allowed: tuple[str, ...], meaning: str = "") -> str:
    """``value`` must be one of the strings ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        names = [repr(a) for a in allowed]
        options = " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)
        raise ValueError(f"{name} must be {options}{meaning}, got {value!r}.")
    return value


def trainable_size_and_dtype(model: Any) -> tuple[int, torch.dtype]:
    """``D`` and the floating dtype of a model's parameters that require grad; a clear
    error for an object that is not a module, has no such parameters or has tensors on
    the 'meta' device.
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    meta = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type == "meta"
    ]
    if meta:
        raise ValueError(
            f"The model's tensors {meta[:3]}{' ...' if len(meta) > 3 else ''} are on the "
            "'meta' device (shapes without values): GLAS needs weights on a device that "
            "holds data ('cpu' or 'cuda'). Materialise them first, e.g. "
            "model.to_empty(device='cpu') and then model.load_state_dict(weights)."
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trainable)
    if n_params == 0:
        raise ValueError(
            "The model has no parameters that require grad: there is nothing to put a posterior on."
        )
    return n_params, parameter_dtype(trainable)


def finite_targets(loader: Iterable, dict_key_y: str, what: str) -> None:
    """Every floating target of ``loader`` (``(X, y)`` or mapping batches) is finite;
    a ``ValueError`` naming ``what`` otherwise.
    """
    for batch in loader:
        targets = batch[dict_key_y] if isinstance(batch, Mapping) else batch[1]
        if (
            isinstance(targets, torch.Tensor)
            and targets.is_floating_point()
            and not torch.isfinite(targets).all()
        ):
            raise ValueError(
                f"The targets of {what} data contain NaN or inf: every prior precision "
                "would score alike."
            )


def grid_validation_data(
    loader: Iterable, dict_key_y: str, regression_outputs: int | None = None
) -> None:
    """The grid search's validation ``loader`` is not empty and its floating targets are
    finite; for regression (``regression_outputs``: the model's ``C``) its targets have
    the outputs' ``C`` on their last axis; a ``ValueError`` naming the problem otherwise.
    """
    first = next(iter(loader), None)
    if first is None:
        raise ValueError("val_loader is empty: there is nothing to score the grid on.")
    targets = first[dict_key_y] if isinstance(first, Mapping) else first[1]
    if (
        regression_outputs is not None
        and isinstance(targets, torch.Tensor)
        and (targets.ndim < 2 or targets.shape[-1] != regression_outputs)
    ):
        raise ValueError(
            f"The grid search's validation targets have shape {tuple(targets.shape)}, the "
            f"model's outputs {regression_outputs} per row: give regression targets of shape "
            f"(N, {regression_outputs}) (e.g. y.reshape(-1, {regression_outputs})), as for fit."
        )
    finite_targets(loader, dict_key_y, "the grid search's validation")


def grid_bounds_and_loss(log_min: Any, log_max: Any, loss: Any) -> None:
    """The grid search's exponent bounds are finite reals with ``log_min < log_max`` and
    its ``loss`` is ``None`` or a callable (a torchmetrics ``Metric`` is one); a named
    error otherwise.
    """
    log_min = finite_number("log_prior_prec_min", log_min)
    log_max = finite_number("log_prior_prec_max", log_max)
    if loss is not None and not callable(loss):
        raise ArgumentTypeError(
            "loss must be a torchmetrics.Metric or a callable (preds, targets) -> float, "
            f"got {type(loss).__name__} ({loss!r})."
        )
    if not log_min < log_max:
        raise ValueError(
            f"log_prior_prec_min must be below log_prior_prec_max, got {log_min} and {log_max}."
        )


_PACKAGE = str(Path(__file__).resolve().parent)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called from here that names the first
    frame outside the package (the user's call, however deep the package's own calls).
    """
    level, frame = 1, inspect.currentframe().f_back  # the caller's frame
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level
