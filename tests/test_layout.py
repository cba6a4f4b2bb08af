"""The package layout: core modules apart from application helpers; old paths still work."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import laplace_glas

MOVED = {
    "laplace_glas.batches": "laplace_glas.curvature.batches",
    "laplace_glas.block_krylov": "laplace_glas.curvature.block_krylov",
    "laplace_glas.fitting": "laplace_glas.curvature.fitting",
    "laplace_glas.losses": "laplace_glas.curvature.losses",
    "laplace_glas.subspace": "laplace_glas.curvature.subspace",
    "laplace_glas.compare": "laplace_glas.applications.compare",
    "laplace_glas.data": "laplace_glas.applications.data",
    "laplace_glas.smiles": "laplace_glas.applications.smiles",
}


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_old_module_paths_import_the_moved_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert getattr(laplace_glas, old.rsplit(".", 1)[1]) is importlib.import_module(new)


def test_old_from_imports_work_in_a_fresh_interpreter():
    code = (
        "from laplace_glas.subspace import Eigenpairs\n"
        "from laplace_glas.smiles import SmilesLSTM\n"
        "import laplace_glas.data as d\n"
        "assert Eigenpairs.__module__ == 'laplace_glas.curvature.subspace'\n"
        "assert SmilesLSTM.__module__ == 'laplace_glas.applications.smiles'\n"
        "assert d.__name__ == 'laplace_glas.applications.data'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_modules_do_not_import_the_applications():
    """The core (everything outside applications/) never imports an application helper."""
    from pathlib import Path

    root = Path(laplace_glas.__file__).parent
    for path in root.rglob("*.py"):
        if "applications" in path.parts or (path.name == "__init__.py" and path.parent == root):
            continue
        assert "laplace_glas.applications" not in path.read_text(), path
