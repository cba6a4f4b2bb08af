"""End-to-end: examples/reproduce_paper.py --quick writes a report with tables and figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "reproduce_paper.py"


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_reproduce_paper_quick(tmp_path):
    result = run_script("--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch.set_num_threads(1)" in result.stdout

    report = tmp_path / "report.md"
    assert report.is_file()
    text = report.read_text(encoding="utf-8")
    for heading in (
        "## Wall times",
        "## 1. Known-noise scalar regression",
        "## 2. UCI concrete",
        "interval of f, WITHOUT observation noise",
        "interval of y = f + noise",
        "### Drift of the nonlinear predictive mean",
        "torch.set_num_threads(1)",
    ):
        assert heading in text, f"missing {heading!r} in report.md"
    header = "| N | scaling | pred_type | selected k | k = 1 | k = 2 | k = 5 | k = 10 | paper |"
    assert text.count(header) >= 2  # toy: without and with noise
    for scaling in ("mean", "sum"):
        for pred in ("glm", "nn"):
            rows = re.findall(rf"^\| 100 \| {scaling} \| {pred} \| .+ \|$", text, re.MULTILINE)
            assert len(rows) >= 2, f"no toy rows for {scaling} / {pred}"

    figures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert any("coverage_vs_k" in f for f in figures)
    assert any("band" in f for f in figures)
    for name in figures:
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, f"figure {name} missing or empty"
    assert (tmp_path / "results.json").is_file()


def test_reproduce_paper_help():
    result = run_script("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--out", "--seeds", "--threads", "--concrete"):
        assert option in result.stdout
