"""The package layout: the core apart from the applications, imports kept light.

The rules a reader relies on (ARCHITECTURE in the docs): ``import laplace_glas`` loads no
application helper and nothing POSIX-only; the core never imports an application module.
Long modules and functions are reported (``LayoutWarning``), not refused.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
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


# the class itself: laplace.py and the modules that hold its mixins and subclasses
CLASS_MODULES = {
    "laplace.py",
    "subsets.py",
    "curvature/fit.py",
    "posterior/hyperparameters.py",
    "posterior/subspace.py",
    "predictive/prior_gram.py",
    "predictive/subspace_predictive.py",
}
# names under which modules outside the class receive a fitted posterior object
POSTERIOR_NAMES = {"la", "laplace", "glas", "view", "other", "posterior", "fitted"}


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_at_most_eight_loose_modules_at_the_top():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(loose) <= 8, loose


class LayoutWarning(UserWarning):
    """A smell the layout report names without failing: a module or a function longer
    than usual. A module is as long as its one concern needs; the report is a prompt to
    look, not a limit to write towards.
    """


def test_modules_over_500_lines_are_reported():
    long = {relative(p): n for p in core_modules() if (n := len(p.read_text().splitlines())) > 500}
    if long:
        warnings.warn(f"modules over 500 lines: {long}", LayoutWarning, stacklevel=1)


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of each function body (its docstring left out)."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            docstring = isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant
            )
            first = body[1] if docstring and len(body) > 1 else body[0]
            lengths[f"{relative(path)}:{node.name}"] = node.end_lineno - first.lineno + 1
    return lengths


def test_function_bodies_over_80_lines_are_reported():
    long = {
        name: n for path in core_modules() for name, n in function_lengths(path).items() if n > 80
    }
    if long:
        warnings.warn(f"function bodies over 80 lines: {long}", LayoutWarning, stacklevel=1)


def private_reads_of_the_posterior(path: Path) -> list[str]:
    """``la._x`` and ``getattr(la, "_x")`` on a fitted posterior received from outside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in POSTERIOR_NAMES
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{relative(path)}:{node.lineno}: {node.value.id}.{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in POSTERIOR_NAMES
        ):
            found.append(
                f"{relative(path)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})"
            )
    return found


def test_no_module_outside_the_class_reads_the_posteriors_private_state():
    found = [
        hit
        for path in core_modules()
        if relative(path) not in CLASS_MODULES
        for hit in private_reads_of_the_posterior(path)
    ]
    assert not found, found


def test_the_private_state_check_catches_a_private_read(tmp_path):
    probe = PACKAGE / "diagnostics" / "_probe_for_the_layout_test.py"
    probe.write_text("def f(la):\n    return la._tau, getattr(la, '_device')\n")
    try:
        assert len(private_reads_of_the_posterior(probe)) == 2
    finally:
        probe.unlink()


def test_curvature_does_not_import_the_layers_above_it():
    """Dependency direction: laplace -> diagnostics -> predictive -> posterior -> curvature."""
    above = {
        "curvature": (
            "laplace_glas.posterior",
            "laplace_glas.predictive",
            "laplace_glas.diagnostics",
            "laplace_glas.laplace",
            "laplace_glas.subsets",
            "laplace_glas.io",
        ),
        "posterior": (
            "laplace_glas.predictive",
            "laplace_glas.diagnostics",
            "laplace_glas.laplace",
            "laplace_glas.subsets",
            "laplace_glas.io",
        ),
        "predictive": (
            "laplace_glas.diagnostics",
            "laplace_glas.laplace",
            "laplace_glas.subsets",
            "laplace_glas.io",
        ),
        "diagnostics": ("laplace_glas.laplace", "laplace_glas.subsets", "laplace_glas.io"),
    }
    wrong = []
    for package, forbidden in above.items():
        for path in (PACKAGE / package).rglob("*.py"):
            for name in imported_modules(path):
                if name.startswith(forbidden):
                    wrong.append(f"{relative(path)} imports {name}")
    assert not wrong, wrong


def test_import_prints_no_deprecation_warning_of_the_dependencies():
    """laplace-torch's and curvlinops' imports call the deprecated ``torch.jit.script``."""
    subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import laplace_glas"], check=True
    )


def test_the_first_forward_mode_product_prints_no_deprecation_warning():
    """torch loads its forward-AD decompositions through ``torch.jit.script`` at the first
    JVP (curvlinops' GGN products, the 'glm' predictive): the import does it quietly."""
    code = (
        "import laplace_glas, torch\n"
        "torch.func.jvp(torch.sin, (torch.ones(2),), (torch.ones(2),))\n"
    )
    subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], check=True)


def private_imports(path: Path) -> list[str]:
    """``from laplace_glas.x import _name`` in ``path``: a helper another module needs is
    part of its owner's interface, public there."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("laplace_glas"):
            found.extend(
                f"{relative(path)}:{node.lineno}: {node.module}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            )
    return found


def test_no_module_imports_another_modules_private_names():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in private_imports(path)]
    assert not found, found


def test_the_private_import_check_catches_one(tmp_path, monkeypatch):
    module = tmp_path / "m.py"
    module.write_text("from laplace_glas.curvature.solvers.eigenpairs import _hidden, ZERO_GGN\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert private_imports(module) == ["m.py:1: laplace_glas.curvature.solvers.eigenpairs._hidden"]


def module_names_extending_another(package: Path) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` of modules in one folder whose name ``b`` is ``a`` plus a suffix
    (``kron`` / ``kron_blocks``): names a newcomer cannot tell apart."""
    pairs = []
    for folder in sorted({path.parent for path in package.rglob("*.py")}):
        stems = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
        pairs += [
            (f"{folder.name}/{a}", f"{folder.name}/{b}")
            for a in stems
            for b in stems
            if a != b and b.startswith(a)
        ]
    return pairs


def test_no_module_name_is_another_s_plus_a_suffix(tmp_path):
    assert module_names_extending_another(PACKAGE) == []
    (tmp_path / "kron.py").write_text("")
    (tmp_path / "kron_blocks.py").write_text("")
    assert module_names_extending_another(tmp_path) == [
        (f"{tmp_path.name}/kron", f"{tmp_path.name}/kron_blocks")
    ]
