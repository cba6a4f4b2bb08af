"""The constructor's settings, checked: the eigen-solve's and the predictive's
(:func:`solver_settings`), laplace-torch's own arguments (:func:`laplace_arguments`) and
the memory budget (:func:`parse_memory_budget`).

Built from the argument checks of :mod:`laplace_glas.validation`; like them, each
refuses a value the library cannot use with an error naming the argument and the
accepted range.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import torch

from laplace_glas.validation import (
    ArgumentTypeError,
    choice,
    finite_number,
    flag,
    homoscedastic_noise,
    integer,
    lanczos_basis_size,
    positive_int,
    tolerance,
)
from laplace_glas.validation import seed as checked_seed

__all__ = ["laplace_arguments", "parse_memory_budget", "solver_settings"]

_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_FORMS = (
    "a number of bytes >= 1 (fractions rounded down), or a string of a number and an "
    "optional unit (bytes without one): B, kB, MB, GB, "
    "TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '512MB', '1.5GiB', "
    "'64 MiB' (units case-insensitive: 'mb' is MB); or None for half of the free memory "
    "of the model's device"
)


def parse_memory_budget(value: Any) -> int | None:
    """``memory_budget`` in bytes (``None`` stays ``None``: the default share).

    Accepts a number of bytes ``>= 1`` (numpy numbers included, bools not) or a string such
    as ``'512MB'``, ``'1.5GiB'``, ``'64 MiB'`` or ``'1000000'``: a positive number, an
    optional space and an optional unit, ``B``, ``kB``, ``MB``, ``GB``, ``TB`` (powers
    of 1000) or ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), case-insensitive.
    Fractions of a byte are rounded down; the result must be at least 1 byte.
    """
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and value >= 1):
            raise ValueError(f"memory_budget must be {_BUDGET_FORMS}; got {value!r}.")
        return int(value)
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"memory_budget must be {_BUDGET_FORMS}; got {type(value).__name__} ({value!r})."
        )
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if unit is not None and unit not in _BYTE_UNITS and unit != "":
        match = None
    if match is not None:
        number = float(match.group(1)) * _BYTE_UNITS[unit or "b"]
        if math.isfinite(number) and number >= 1:
            return int(number)
    raise ValueError(f"memory_budget must be {_BUDGET_FORMS}; got {value!r}.")


def solver_settings(
    n_components: int,
    n_params: int,
    *,
    solver: str,
    block_size: Any,
    tol: Any,
    maxiter: Any,
    ncv: Any,
    seed: Any,
    generator: Any,
    subsample_size: Any,
    rank_threshold: Any,
    jvp_chunk_size: Any,
    sample_chunk_size: Any,
    ignore_index: Any,
    progress_bar: Any,
    memory_budget: Any = None,
) -> dict[str, Any]:
    """The eigen-solve's and the predictive's settings of the constructor, checked:
    a mapping from attribute name to value (``solver`` is checked by the caller).
    """
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
    ):
        raise ValueError(f"generator must be a CPU torch.Generator or None, got {generator!r}.")
    block_size, maxiter, ncv, subsample_size, jvp_chunk_size = (
        positive_int(name, value)
        for name, value in (
            ("block_size", block_size),
            ("maxiter", maxiter),
            ("ncv", ncv),
            ("subsample_size", subsample_size),
            ("jvp_chunk_size", jvp_chunk_size),
        )
    )
    lanczos_basis_size(ncv, n_components, n_params)
    if rank_threshold is not None:
        rank_threshold = finite_number("rank_threshold", rank_threshold, 0.0, 1.0)
    return {
        "solver": solver,
        "block_size": block_size,
        "tol": tolerance(tol),
        "maxiter": maxiter,
        "ncv": ncv,
        "seed": checked_seed(seed),
        "generator": generator,
        "subsample_size": subsample_size,
        "rank_threshold": rank_threshold,
        "jvp_chunk_size": jvp_chunk_size,
        "sample_chunk_size": positive_int("sample_chunk_size", sample_chunk_size, allow_none=False),
        "ignore_index": integer("ignore_index", ignore_index),
        "progress_bar": flag("progress_bar", progress_bar),
        "memory_budget": parse_memory_budget(memory_budget),
    }


def laplace_arguments(
    likelihood: Any,
    likelihoods: tuple[str, ...],
    *,
    sigma_noise: Any,
    dtype: torch.dtype,
    enable_backprop: Any,
    dict_key_x: Any,
    dict_key_y: Any,
) -> tuple[str, bool]:
    """The checked laplace-torch arguments of the constructor: the likelihood (one of
    ``likelihoods``) and ``enable_backprop``; ``dict_key_x`` / ``dict_key_y`` must be
    strings and ``sigma_noise`` one homoscedastic noise (checked here because
    laplace-torch compares it with 1 before its setter runs, a crash for a tensor).
    """
    likelihood = choice("likelihood", likelihood, likelihoods)
    enable_backprop = flag("enable_backprop", enable_backprop)
    for name, key in (("dict_key_x", dict_key_x), ("dict_key_y", dict_key_y)):
        if not isinstance(key, str):
            raise ArgumentTypeError(f"{name} must be a str, got {key!r}.")
    homoscedastic_noise(sigma_noise, dtype, likelihood)
    return likelihood, enable_backprop
