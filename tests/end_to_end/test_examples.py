"""End-to-end: the example scripts run in their --quick mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "known_noise_regression.py"


EXAMPLES = sorted((ROOT / "examples").glob("[!_]*.py"))  # examples/_cli.py is a helper
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
        "eigenpairs of the mean-loss GGN (solver '",
        "Posterior variances",
        "90% interval of f on a grid",
        "(a) Coverage of the 90% interval of f (no observation noise) against the true",
        "(b) Coverage of the 90% interval of y = f + noise (sigma^2 added) against the",
        "la.calibrate(coverage=0.9) on the calibration set",
        "smallest k whose calibration coverage",
    ):
        assert section in out, f"missing section {section!r} in:\n{out}"
    assert "Lanczos s" not in out  # the solve's column names no solver that may not have run
    # both coverage tables list every k of the quick run, for both scalings and predictives
    header = "mean / glm |        mean / nn |        sum / glm |         sum / nn"
    assert out.count(header) == 2
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 |", "2 |", "5 |"))]
    assert len([r for r in rows if r.count("%") == 4]) == 6
    # the paper's result in miniature: mean-loss scaling reaches 90% by k = 2 ('glm')
    assert "mean / glm: k =  2" in out or "mean / glm: k =  1" in out
    assert "sum / glm: none of k" in out
    # calibrate: both scalings, intervals of y against y and of f against the true f
    for route in ("mean / y vs y", "mean / f vs f", "sum / y vs y", "sum / f vs f"):
        assert f"{route}: k =" in out, route


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


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
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


def _imported_modules(report: list[str]) -> set[str]:
    """The modules in ``python -X importtime``'s report lines (their last column)."""
    return {line.rsplit("|", 1)[-1].strip() for line in report[1:]}  # [0]: the header


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_help_and_argument_errors_answer_before_torch_is_imported(script):
    """--help and a bad option answer from the standard library alone: neither torch,
    laplace-torch nor laplace_glas is imported (the scripts parse before those imports).
    """
    for args, code in ((["--help"], 0), (["--no-such-option"], 2)):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", str(script), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
        stderr = "\n".join(line for line in result.stderr.splitlines() if line not in report)
        output = result.stdout if code == 0 else stderr
        assert result.returncode == code, stderr[-2000:]
        assert output.startswith(f"usage: {script.name} [-h]"), output
        if code:
            assert output.splitlines()[-1].endswith("unrecognized arguments: --no-such-option")
        imported = _imported_modules(report)
        assert "argparse" in imported  # the import report is read correctly
        assert not {"torch", "laplace", "laplace_glas"} & imported


def test_the_examples_formatter_is_the_packages():
    """examples/_cli.py's stdlib-only formatter prints what the package's prints."""
    import argparse

    import _cli

    from laplace_glas.applications import cli

    texts = []
    for formatter in (_cli.HelpFormatter, cli.HelpFormatter):
        parser = argparse.ArgumentParser(prog="x", formatter_class=formatter)
        parser.add_argument("--a", type=int, default=3, help="shown")
        parser.add_argument("--b", default=None, help="resolved later")
        parser.add_argument("--c", action="store_true", help="a flag")
        parser.add_argument("--d", default=1, help="stated (default: one)")
        texts.append(parser.format_help())
    assert texts[0] == texts[1]
    assert "shown (default: 3)" in texts[0] and "(default: None)" not in texts[0]
    assert "(default: False)" not in texts[0] and "(default: 1)" not in texts[0]


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
