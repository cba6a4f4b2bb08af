"""examples/lora_smiles.py: the shift rule, the token metrics and the --quick study."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lora_smiles.py"
DATA = ROOT.parent / "shared" / "data" / "smiles" / "moses_train_20k.smi"
HAS_LLM = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("lora_smiles_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_shift_rule_splits_on_the_sulfonyl_group(study):
    smiles = ["CCS(=O)(=O)N", "CCO", "c1ccccc1S(=O)(=O)C", "CSC"]
    pool, shifted = study.split_by_pattern(smiles)
    assert pool == ["CCO", "CSC"] and shifted == ["CCS(=O)(=O)N", "c1ccccc1S(=O)(=O)C"]


def test_metrics_against_hand_computed_values(study):
    probs = torch.tensor([[0.7, 0.25, 0.05], [0.5, 0.45, 0.05], [0.15, 0.05, 0.8]])
    y = torch.tensor([0, 1, 1])
    m = study.metrics(probs, y)
    assert m["nll"] == pytest.approx(-sum(math.log(p) for p in (0.7, 0.45, 0.05)) / 3)
    # 90% sets (most probable tokens until 90% mass): {0, 1}, {0, 1}, {2, 0}
    assert m["set_size"] == pytest.approx(2.0)
    assert m["coverage"] == pytest.approx(2 / 3)
    # ECE: confidence 0.7 right, 0.5 wrong, 0.8 wrong, each in its own bin
    assert m["ece"] == pytest.approx((0.3 + 0.5 + 0.8) / 3)


@pytest.mark.skipif(not HAS_LLM, reason="transformers/peft not installed (the 'llm' extra)")
@pytest.mark.skipif(not DATA.exists(), reason=f"MOSES SMILES not found at {DATA}")
def test_quick_study_runs_and_prints_the_table(tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--data", str(DATA), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][2:]
    assert [r.split("|")[1].strip() for r in rows] == list(study_methods())
    glas_d = {r.split("|")[2].strip() for r in rows[1:4]}
    assert len(glas_d) == 1  # GLAS and KronLaplace: the same adapters
    assert int(rows[4].split("|")[2]) < int(glas_d.pop())  # last layer: the head only
    assert "GGN products" in rows[1]


def study_methods():
    return ("MAP", "GLAS mean", "GLAS standard", "KronLaplace", "last-layer")


def test_metrics_refuse_logits(study):
    with pytest.raises(ValueError, match="probabilities"):
        study.metrics(torch.tensor([[2.0, -1.0, 0.5]]), torch.tensor([0]))


@pytest.mark.skipif(not HAS_LLM, reason="transformers/peft not installed (the 'llm' extra)")
def test_base_checkpoint_is_written_once_and_loaded_after(study, tmp_path):
    transformers, _ = study.require_llm()
    smiles = ["CCO", "CCN", "c1ccccc1", "CC(=O)O", "CCCl", "OCC(N)C"] * 4
    tokenizer = study.SmilesTokenizer().fit(smiles)
    base = tmp_path / "base.pt"
    args = study.parse_args(["--quick", "--pretrain-steps", "3", "--base", str(base)])
    trained = study.load_or_pretrain(
        transformers, tokenizer, smiles, args, torch.Generator().manual_seed(0)
    )
    assert base.exists()
    loaded = study.load_or_pretrain(
        transformers, tokenizer, smiles, args, torch.Generator().manual_seed(1)
    )
    for (name, a), (_, b) in zip(
        trained.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    other = study.parse_args(["--quick", "--n-embd", "16", "--base", str(base)])
    with pytest.raises(SystemExit, match="holds a base for"):
        study.load_or_pretrain(transformers, tokenizer, smiles, other, torch.Generator())


def test_pretrain_only_needs_a_base_path(study, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(["--pretrain-only"])
    assert "--pretrain-only needs --base" in capsys.readouterr().err
