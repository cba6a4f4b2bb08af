"""End-to-end: the example scripts run in their --quick mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "known_noise_regression.py"


CONCRETE = ROOT.parent / "shared" / "data" / "concrete" / "Concrete_Data.csv"


def run_example(
    *args: str, timeout: float = 300, script: Path = EXAMPLE
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_known_noise_regression_help():
    result = run_example("--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--n-train" in result.stdout


def test_known_noise_regression_quick(tmp_path):
    result = run_example("--quick", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for section in (
        "Lanczos",
        "Posterior variances",
        "90% interval of f on a grid",
        "(a) Coverage of the 90% interval of f, WITHOUT observation noise",
        "(b) Coverage of the 90% interval of y = f + noise, WITH sigma^2 added",
        "smallest k whose calibration coverage",
    ):
        assert section in out, f"missing section {section!r} in:\n{out}"
    # both coverage tables list every k of the quick run, for both scalings and predictives
    header = "mean / glm |        mean / nn |        sum / glm |         sum / nn"
    assert out.count(header) == 2
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 |", "2 |", "5 |"))]
    assert len([r for r in rows if r.count("%") == 4]) == 6
    # the paper's result in miniature: mean-loss scaling reaches 90% by k = 2 ('glm')
    assert "mean / glm: k =  2" in out or "mean / glm: k =  1" in out
    assert "sum / glm: none of k" in out


@pytest.mark.skipif(not CONCRETE.exists(), reason=f"UCI Concrete data not found at {CONCRETE}")
def test_concrete_quick(tmp_path):
    result = run_example(
        "--quick",
        "--data",
        str(CONCRETE),
        "--out",
        str(tmp_path),
        script=ROOT / "examples" / "concrete.py",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("selection: k =") == 2 and "test coverage at the selection" in out
    assert "top 0.1% of weights" in out and "95% of the activity is carried by" in out
    for name in ("concrete_coverage_vs_k.png", "concrete_activity.png"):
        assert (tmp_path / name).stat().st_size > 1000


def _load_example(path: Path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.stem)
def test_example_help_is_clean(script, monkeypatch, capsys):
    """--help: no literal '%%', no '(default: None)' beside a stated default, every
    option explained."""
    import argparse

    parsers = []
    parse_args = argparse.ArgumentParser.parse_args

    def recording_parse_args(self, *args, **kwargs):
        parsers.append(self)
        return parse_args(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse_args)
    with pytest.raises(SystemExit) as exit_:
        _load_example(script, monkeypatch).parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "%%" not in text and "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default:") >= 3, text
    (parser,) = parsers
    unexplained = [a.option_strings for a in parser._actions if not a.help]
    assert not unexplained, unexplained


def test_a_missing_data_set_ends_in_one_line_not_a_traceback(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "concrete.py"),
            "--quick",
            "--data",
            str(tmp_path / "none.csv"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Concrete data not found" in errors[0] and "--data" in errors[0]
    assert "FutureWarning" not in result.stderr
