"""The prepared device check (benchmarks/lstm_device.py) runs end to end on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "smiles" / "moses_train_20k.smi"


@pytest.mark.skipif(not DATA.exists(), reason=f"MOSES SMILES not found at {DATA}")
def test_lstm_device_check_quick_on_cpu():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "lstm_device.py"),
            "--quick",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--cpu-reference",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "# GLAS on the SMILES LSTM on cpu" in out
    assert "k = 3, solver block" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "fit (loss pass + eigen-solve)" in rows
    for step in ("'glm' predictive", "'nn' predictive", "sample(10)"):
        row = next(line for label, line in rows.items() if label.startswith(step))
        cells = [c.strip() for c in row.split("|")[2:5]]
        assert all(c not in ("", "–") for c in cells), row  # device, reference and ratio
        assert float(cells[0]) > 0 and float(cells[1]) > 0
