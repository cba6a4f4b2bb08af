"""Command-line helpers shared by the example scripts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["DataNotFoundError", "HelpFormatter", "run_example"]


class DataNotFoundError(FileNotFoundError):
    """A data set an example or benchmark reads is not where it was looked for, or is
    in a format whose optional reader is not installed (the message says which).
    """


def run_example(main: Callable[[], Any]) -> None:
    """Run an example's ``main``; a missing data set ends it with one line on stderr
    (``error: ...``, exit status 2) instead of a traceback.
    """
    try:
        result = main()
    except DataNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(result if isinstance(result, int) else 0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` formatter that appends ``(default: X)`` only where it informs.

    argparse's :class:`~argparse.ArgumentDefaultsHelpFormatter` appends the default
    to every option, which prints ``(default: None)`` for options whose value is
    resolved later (e.g. one default for a full run and another for ``--quick``) and
    ``(default: False)`` for flags. This formatter leaves the help text alone where
    the default is ``None`` or ``False``, or where the text already mentions a default.
    The examples use the same class from ``examples/_cli.py``, which they import
    before torch (importing this module runs ``laplace_glas/__init__``, which loads
    torch and laplace-torch).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return action.help
        return super()._get_help_string(action)
