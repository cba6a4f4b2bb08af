"""Argument checks shared by the modules: one message for one kind of mistake."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["positive_int"]


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
