"""The package layout: the core apart from the applications, imports kept light.

The rules a reader relies on (ARCHITECTURE in the docs): ``import laplace_glas`` loads no
application helper and nothing POSIX-only; the core never imports an application module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import laplace_glas

PACKAGE = Path(laplace_glas.__file__).parent


def core_modules() -> list[Path]:
    """Every module of the package outside ``applications/``."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "applications" not in p.parts]


def test_import_loads_no_application_and_nothing_posix_only():
    code = (
        "import sys\n"
        "import laplace_glas\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('laplace_glas.applications'))\n"
        "assert not loaded, loaded\n"
        "assert 'resource' not in sys.modules\n"
        "assert 'matplotlib' not in sys.modules or 'torchmetrics' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_0_1_alias_modules_are_gone():
    code = (
        "import importlib\n"
        "for old in ('subspace', 'smiles', 'data', 'compare', 'batches', 'fitting'):\n"
        "    try:\n"
        "        importlib.import_module('laplace_glas.' + old)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(old)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def imported_modules(path: Path) -> set[str]:
    """The modules ``path`` imports (absolute names), at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_core_modules_do_not_import_the_applications():
    for path in core_modules():
        assert not any(
            name.startswith("laplace_glas.applications") for name in imported_modules(path)
        ), path
