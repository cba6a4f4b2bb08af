"""The documentation's set-up: CI runs the README's command, the API reference covers
every module, and nothing points outside the repository (the strict MkDocs build itself
runs in .ci/run)."""

from __future__ import annotations

import re
from pathlib import Path

import laplace_glas

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command_with_the_docs_build():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme.splitlines()
    assert "[test,plot,docs,llm,bench]" in ci and ci.endswith("mkdocs build --strict")
    assert "site/" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".venv/bin/mkdocs serve" in readme


def test_api_reference_has_a_page_for_every_module_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = re.findall(r"^\s+- [\w ]+: (api/\S+\.md)$", nav, flags=re.MULTILINE)
    documented = set()
    for page in pages:
        text = (ROOT / "docs" / page).read_text()
        documented.update(re.findall(r"^::: (laplace_glas[\w.]*)$", text, flags=re.MULTILINE))
    package = Path(laplace_glas.__file__).parent
    modules = {
        ".".join(("laplace_glas", *p.relative_to(package).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in package.rglob("*.py")
    }
    assert modules <= documented, modules - documented


def test_no_file_refers_to_the_specification_outside_the_repository():
    for path in ROOT.rglob("*"):
        if ".git" in path.parts or ".venv" in path.parts or not path.is_file():
            continue
        if path.suffix not in {".py", ".md", ".txt", ".toml", ".yml", ""}:
            continue
        text = path.read_text(errors="ignore")
        assert "GLAS" + ".md" not in text, path
