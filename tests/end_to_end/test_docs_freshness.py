"""Documented numbers and links that cannot silently go stale.

* **Links.** Every relative link of the README, the documentation and the served
  benchmark reports points at a file of the repository; a page of the site points at a
  file the site serves (``docs/`` or ``mkdocs_hooks.SERVED``), never at a folder (a
  folder link is broken on the built site and ``mkdocs build --strict`` does not see it).
* **Measurements.** A timing, memory figure or speed ratio in the README or the
  documentation (a table row or a sentence with ``12.3 s``, ``~5 min``, ``2.9 GB``,
  ``159x``, or a run time such as ``# seconds`` beside a command) sits in a paragraph,
  table or code block that carries -- itself, or in the paragraph right before or after
  it -- a marker ``measured <day> <Month> <year>`` and names the script that measured it
  (``examples/*.py`` or ``benchmarks/*.py``). A benchmark report dates itself in its
  first lines, and each of its sections with measurements names its script.
* **Scripts and figures.** Every script a marker names exists; every figure on a page
  is written by a script that the test-suite runs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATE = re.compile(rf"\b\d{{1,2}} (?:{MONTHS}) 20\d\d\b|\b20\d\d-\d\d-\d\d\b")
MARKER = re.compile(rf"[Mm]easured\b[^|]{{0,160}}?\b\d{{1,2}} (?:{MONTHS}) 20\d\d\b", re.DOTALL)
SCRIPT = re.compile(r"\b((?:examples|benchmarks)/[\w/]+\.py)\b")
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
MEASUREMENT = re.compile(
    rf"(?:~ ?{_NUMBER} ?(?:s|min|h|ms)\b"  # ~5 min
    rf"|\b{_NUMBER}(?: / {_NUMBER})* ?(?:s|ms|min|MiB|GiB|MB|GB)\b(?![-\w])"  # 26.6 / 42.3 s
    rf"|(?<![(\w.]){_NUMBER}(?:e\d+)?x\b(?![\w-])"  # 159x, 1e6x (not sin(3x))
    r"|#[^\n]*\b(?:seconds|minutes)\b)"  # a run time beside a command
)
SITE_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "api" not in p.parts)
REPORTS = [
    ROOT / "benchmarks" / "RESULTS.md",
    ROOT / "benchmarks" / "value_results.md",
    *sorted((ROOT / "benchmarks").glob("*/*.md")),
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def blocks(text: str) -> list[tuple[int, str]]:
    """Paragraphs, tables and fenced code blocks (one each) with their first line."""
    out, current, start, fenced = [], [], 0, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if not line.strip() and not fenced:
            if current:
                out.append((start, "\n".join(current)))
            current = []
            continue
        if not current:
            start = i
        current.append(line)
    if current:
        out.append((start, "\n".join(current)))
    return out


def site_files() -> set[str]:
    """Repository paths the built site serves."""
    hooks = pytest.importorskip("mkdocs_hooks", reason="the docs extra is not installed")
    served = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*")}
    for pattern in hooks.SERVED:
        served |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)}
    return served


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [
        link.split("#")[0]
        for link in LINK.findall(text)
        if not re.match(r"[a-z]+:", link) and not link.startswith("#")
    ]


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *REPORTS], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_resolve_in_the_repository(path):
    broken = [link for link in relative_links(path) if not (path.parent / link).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_site_pages_link_only_to_served_files():
    served = site_files()
    broken = []
    for path in [*SITE_PAGES, *(p for p in REPORTS if p.relative_to(ROOT).as_posix() in served)]:
        base = path.parent.relative_to(ROOT / "docs" if "docs" in path.parts else ROOT)
        for link in relative_links(path):
            target = (base / link).as_posix()
            resolved = Path(target).as_posix()
            parts = []
            for part in resolved.split("/"):
                if part == "..":
                    parts.pop()
                elif part not in ("", "."):
                    parts.append(part)
            if link.endswith("/") or "/".join(parts) not in served:
                broken.append(f"{path.relative_to(ROOT)} -> {link}")
    assert not broken, "links broken on the built site:\n" + "\n".join(broken)


def unmarked_measurements(path: Path) -> list[str]:
    found = blocks(path.read_text())
    bad = []
    for i, (line, block) in enumerate(found):
        prose = block if block.startswith("```") else re.sub(r"`[^`\n]+`", "", block)
        if not MEASUREMENT.search(prose):  # inline code is a formula, not a figure
            continue
        around = [b for _, b in found[max(i - 1, 0) : i + 2]]
        if not any(MARKER.search(b) for b in around) or not any(SCRIPT.search(b) for b in around):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {MEASUREMENT.search(prose).group(0)!r}")
    return bad


def test_every_documented_measurement_is_dated_and_names_its_script():
    bad = []
    for path in [ROOT / "README.md", *SITE_PAGES]:
        bad += unmarked_measurements(path)
    assert not bad, "measurements without 'measured <date>' and their script nearby:\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_reports_are_dated_and_name_their_scripts(path):
    text = path.read_text()
    assert DATE.search("\n".join(text.splitlines()[:8])), f"{path} has no date in its header"
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    undated = [
        s.splitlines()[0]
        for s in sections[1:]
        if MEASUREMENT.search(s) and not SCRIPT.search(s) and not SCRIPT.search(sections[0])
    ]
    assert not undated, f"{path.relative_to(ROOT)}: sections without their script: {undated}"


def test_every_named_script_exists():
    missing = set()
    for path in [ROOT / "README.md", *SITE_PAGES, *REPORTS]:
        missing |= {s for s in SCRIPT.findall(path.read_text()) if not (ROOT / s).exists()}
    assert not missing, missing


def test_every_figure_on_a_page_is_written_by_a_script_the_tests_run():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    sources = {
        p: p.read_text()
        for folder in ("examples", "benchmarks", "laplace_glas")
        for p in (ROOT / folder).rglob("*.py")
    }
    orphans = []
    for path in [ROOT / "README.md", *SITE_PAGES, *REPORTS]:
        for link in relative_links(path):
            if not link.endswith(".png"):
                continue
            stem = Path(link).stem
            writers = [
                p for p, src in sources.items() if stem in src or _pattern_of(stem).search(src)
            ]
            if not any(p.stem in tests for p in writers):
                orphans.append(f"{path.relative_to(ROOT)}: {link}")
    assert not orphans, "figures no tested script writes:\n" + "\n".join(orphans)


def _pattern_of(stem: str) -> re.Pattern:
    """A figure's name as an f-string writes it: ``toy_coverage_vs_k_N2000`` matches
    ``f"toy_coverage_vs_k_N{n}"``, ``ood_alignment_regression`` ``f"ood_alignment_{x}"``."""
    heads = {stem[:i] for i in range(5, len(stem)) if stem[i].isdigit() or stem[i - 1] == "_"}
    return re.compile("|".join(re.escape(h) + r"\{" for h in sorted(heads)))


def test_getting_started_installs_what_the_readme_installs_and_lists_every_extra():
    readme = (ROOT / "README.md").read_text().splitlines()
    page = (ROOT / "docs" / "getting-started.md").read_text()
    commands = [line for line in page.splitlines() if line.startswith("python3 -m venv")]
    assert commands and all(line in readme for line in commands), commands
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^(\w+) = \[", section, flags=re.MULTILINE)
    listed = page.split("Optional extras:")[1].split("\n\n")[0]
    assert extras and all(f"`{extra}`" in listed for extra in extras), (extras, listed)


# ------------------------------------------------------- headline numbers tied to reports
def _paper_f_coverage_rows() -> dict[tuple[str, str, str], list[str]]:
    """The paper report's f-coverage table: ``(N, scaling, pred_type) -> cells``."""
    text = (ROOT / "benchmarks" / "paper" / "report.md").read_text()
    table = text.split("interval of f, WITHOUT observation noise", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[tuple(cells[:3])] = cells[3:]
    return rows


HEADLINE = re.compile(
    r"mean-loss scaling reaches 90%\s+coverage(?: of f)? at k = (\d+) for N = 100 and N = 2000"
    r"[^.]*?standard\s+scaling\s+stays below (\d+)% \(N = 100\) and (\d+)% \(N = 2000\)",
    re.DOTALL,
)


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"],
                         ids=lambda p: p.name)  # fmt: skip
def test_the_paper_headline_states_what_the_report_prints(path):
    """The README's and the benchmarks page's headline on the known-noise problem: the k
    at which mean-loss scaling reaches 90% (every seed's selected k) and the bound on
    the standard scaling's best coverage (the report's best over seeds, rounded up)."""
    rows = _paper_f_coverage_rows()
    match = HEADLINE.search(" ".join(path.read_text().split()))
    assert match, f"{path.name} no longer states the paper headline in the form checked"
    k, below_100, below_2000 = map(int, match.groups())
    for n in ("100", "2000"):
        assert rows[(n, "mean", "glm")][0] == ", ".join([str(k)] * 3)
    for n, bound in (("100", below_100), ("2000", below_2000)):
        best = [float(b) for b in re.findall(r"best ([\d.]+)%", rows[(n, "sum", "glm")][0])]
        assert len(best) == 3 and math.ceil(max(best)) == bound, (n, best, bound)


def _value_rerun_tables() -> dict[str, dict[str, dict[str, str]]]:
    """``benchmarks/value_results.md``'s re-run with the new defaults: task -> method ->
    column -> the mean (the text before ' ± ')."""
    text = (ROOT / "benchmarks" / "value_results.md").read_text()
    rerun = text.split("## Re-run with the new defaults", 1)[1]
    tables = {}
    for section in rerun.split("\n### ")[1:]:
        task, body = section.split("\n", 1)
        lines = [line for line in body.splitlines() if line.startswith("|")]
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        rows = {}
        for line in lines[2:]:
            cells = [c.strip().split(" ± ")[0] for c in line.strip("|").split("|")]
            rows[cells[0]] = dict(zip(header, cells, strict=False))
        tables[task.strip()] = rows
    return tables


def test_the_swap_faq_table_states_what_the_value_benchmark_printed():
    """The FAQ's KronLaplace / default / old-default table is the value benchmark's
    re-run, cell by cell (gap NLL and ratio, Concrete NLL, blobs NLL, ECE, AUROC)."""
    tables = _value_rerun_tables()
    rows_of = {
        "`KronLaplace`": "kron",
        "new default (`'sum'`, `'kron'`)": "GLAS (default)",
        "old default (`'mean'`, `'zero'`)": "GLAS loss_scaling=mean, complement=zero",
    }
    text = (ROOT / "docs" / "faq.md").read_text()
    checked = 0
    for line in text.splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if cells[0] not in rows_of:
            continue
        method = rows_of[cells[0]]
        gap, concrete, blobs = (tables[t][method] for t in ("gap", "concrete", "blobs"))
        expected = [gap["test NLL"], gap["gap ratio"], concrete["test NLL"], blobs["test NLL"],
                    blobs["ECE"], blobs["OOD AUROC"]]  # fmt: skip
        numbers = [float(c) for c in cells[1:]]
        assert numbers == pytest.approx([float(e) for e in expected], abs=0.051), (method, cells)
        checked += 1
    assert checked == 3
