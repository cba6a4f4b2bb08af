"""The documentation build's Python: an MkDocs hook and a griffe extension.

* ``on_files`` (MkDocs hook, see ``hooks`` in ``mkdocs.yml``): MkDocs only serves
  files under ``docs/``. Rather than keeping copies there, the benchmark reports
  (Markdown) and their figures are added to the site under their repository paths
  (``benchmarks/...``), so the reports' own relative links keep working and the pages
  link to ``benchmarks/paper/<figure>.png``.
* ``SphinxToMarkdown`` (griffe extension, loaded by mkdocstrings): rewrites the reST
  constructs of the package's docstrings as Markdown.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
SERVED = (
    "benchmarks/RESULTS.md",
    "benchmarks/paper/*.md",
    "benchmarks/alignment/*.md",
    "benchmarks/*/*.png",
)


def on_files(files: Files, config) -> Files:
    """Add the benchmark reports and figures to the site's files."""
    for pattern in SERVED:
        for path in sorted(ROOT.glob(pattern)):
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


# The package's docstrings are numpy-style with a few reST constructs (``:func:`name```
# roles, ``.. math::`` blocks). SphinxToMarkdown turns roles into cross-references (links
# where the target is documented here, code otherwise) and math blocks into
# ``$$ ... $$`` for MathJax (inline ``\(\displaystyle ...\)`` inside list items).

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):`(~?)([\w.]+)`")
_MATH = re.compile(
    r"(\n[ \t]*\n)?^([ \t]*)\.\. math::[ \t]*\n((?:[ \t]*\n|\2[ \t]+\S.*\n?)+)", re.MULTILINE
)


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """Full path of ``name`` as seen from ``obj`` (its class, then its module)."""
    if "." in name or name == obj.package.path:
        return name
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += [p for p in (obj.parent, obj.module) if p is not None]
    for scope in scopes:
        member = scope.members.get(name)
        if member is not None:
            return member.target_path if member.is_alias else member.path
    return None


def _roles_to_markdown(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match) -> str:
        short, name = match.groups()
        path = _resolve(obj, name)
        shown = name.rsplit(".", 1)[-1] if short else name
        if path is not None and path.startswith("laplace_glas"):
            return f"[`{shown}`][{path}]"
        return f"`{shown}`"

    return _ROLE.sub(replace, text)


def _math_to_markdown(text: str) -> str:
    def replace(match: re.Match) -> str:
        before, indent, body = match.groups()
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        if indent:  # inside a list item: a blank line or a display block would end it
            return f"\n{indent}\\(\\displaystyle {' '.join(lines)}\\)\n"
        before = before or ""
        return before + "$$\n" + "".join(f"{line}\n" for line in lines) + "$$\n\n"

    return _MATH.sub(replace, text)


def _convert(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        text = _math_to_markdown(obj.docstring.value)
        obj.docstring.value = _roles_to_markdown(obj, text)
    for member in obj.members.values():
        if not member.is_alias:
            _convert(member)


class SphinxToMarkdown(griffe.Extension):
    """Rewrite the reST roles and math blocks of docstrings as Markdown."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        """Convert every docstring of the package once all of it is loaded."""
        _convert(pkg)
