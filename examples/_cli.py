"""The examples' ``--help`` formatter, importable before torch and laplace load.

Standard library only: each example parses its arguments with it before it imports
torch, laplace-torch and ``laplace_glas`` (whose ``__init__`` imports both), so that
``--help`` and argument errors answer at once. The scripts import it as ``_cli`` (the
script's folder is the first entry of ``sys.path`` when Python runs a script).
"""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` formatter that appends ``(default: X)`` only where it informs.

    argparse's :class:`~argparse.ArgumentDefaultsHelpFormatter` appends the default
    to every option, which prints ``(default: None)`` for options whose value is
    resolved later (e.g. one default for a full run and another for ``--quick``) and
    ``(default: False)`` for flags. This formatter leaves the help text alone where
    the default is ``None`` or ``False``, or where the text already mentions a default.
    The same rule as :class:`laplace_glas.applications.cli.HelpFormatter` (which the
    benchmarks use).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return action.help
        return super()._get_help_string(action)
