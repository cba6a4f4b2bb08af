"""SMILES helpers (laplace_glas.applications.smiles) and the examples/smiles_lstm.py --quick run."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401  (registers 'glas')
from laplace_glas.applications.smiles import (
    BOS,
    EOS,
    PAD,
    SmilesLSTM,
    SmilesTokenizer,
    encodable,
    encode_batch,
    generate,
    length_sorted_loader,
    load_language_model,
    load_smiles,
    save_language_model,
    token_lengths,
    train_lm,
    trim_padding,
    validity,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "smiles" / "moses_train_20k.smi"
EXAMPLE = ROOT / "examples" / "smiles_lstm.py"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"MOSES SMILES not found at {DATA}")

HAND = ["CC(Cl)c1cc[nH]c1Br", "C[C@@H](N)C(=O)O", "c1ccc2c(c1)CC%10CC2", "O=[N+]([O-])c1ccccc1"]


def fitted_tokenizer() -> SmilesTokenizer:
    return SmilesTokenizer().fit([*HAND, "CCOc1ccccc1", "C#N", "CS(=O)(=O)F"])


@needs_data
def test_round_trip_on_moses_smiles():
    smiles = load_smiles(DATA, limit=2000)
    assert len(smiles) == 2000
    tok = SmilesTokenizer().fit(smiles)
    assert 10 < tok.vocab_size < 60
    for s in smiles:
        ids = tok.encode(s)
        assert ids[0] == BOS and ids[-1] == EOS
        assert PAD not in ids and BOS not in ids[1:-1] and EOS not in ids[1:-1]
        assert tok.decode(ids) == s
        assert "".join(tok.tokenize(s)) == s
    assert "Cl" in tok.tokens and "[nH]" in tok.tokens and "l" not in tok.tokens


def test_multi_character_tokens():
    tokenize = SmilesTokenizer.tokenize
    assert tokenize("CC(Cl)c1cc[nH]c1Br") == [
        "C", "C", "(", "Cl", ")", "c", "1", "c", "c", "[nH]", "c", "1", "Br",
    ]  # fmt: skip
    assert tokenize("C[C@@H](N)C") == ["C", "[C@@H]", "(", "N", ")", "C"]
    assert tokenize("O=[N+]([O-])C") == ["O", "=", "[N+]", "(", "[O-]", ")", "C"]
    assert tokenize("C%10CC%10") == ["C", "%10", "C", "C", "%10"]
    assert tokenize("CS") == ["C", "S"] and tokenize("Sc1") == ["S", "c", "1"]
    tok = fitted_tokenizer()
    assert tok.tokens[:3] == ["<pad>", "<bos>", "<eos>"]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD, BOS, EOS) == (0, 1, 2)
    for s in HAND:
        assert tok.decode(tok.encode(s)) == s
        assert len(tok.encode(s, add_special=False)) == len(tokenize(s))
    assert len(tok.encode("CCl", add_special=False)) == 2
    # decode stops at EOS and skips PAD/BOS
    ids = tok.encode("CCO")
    assert tok.decode([BOS, *ids[1:], *tok.encode("Br", add_special=False), PAD]) == "CCO"
    with pytest.raises(ValueError, match="Unknown SMILES token"):
        tok.encode("C[Se]C")
    # deterministic vocabulary
    assert fitted_tokenizer().tokens == tok.tokens


def test_load_smiles_errors_and_header(tmp_path):
    with pytest.raises(FileNotFoundError, match="MOSES") as err:
        load_smiles(tmp_path / "missing.smi")
    assert "MIT" in str(err.value)
    path = tmp_path / "some.csv"
    path.write_text("SMILES,SPLIT\nCCO,train\n\nc1ccccc1,train\nCCN,test\n")
    assert load_smiles(path) == ["CCO", "c1ccccc1", "CCN"]
    assert load_smiles(path, limit=2) == ["CCO", "c1ccccc1"]
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="limit must be a positive int"):
            load_smiles(path, limit=bad)  # limit=0 used to return one SMILES


def test_encode_batch_padding_and_targets():
    tok = fitted_tokenizer()
    smiles = ["CCO", "CC(Cl)c1cc[nH]c1Br", "C"]
    x, y = encode_batch(tok, smiles)
    lengths = [len(tok.tokenize(s)) + 1 for s in smiles]
    assert x.shape == y.shape == (3, max(lengths)) and x.dtype == torch.long
    for i, (s, n) in enumerate(zip(smiles, lengths)):
        assert x[i, 0] == BOS and y[i, n - 1] == EOS
        assert torch.equal(x[i, 1:n], y[i, : n - 1])  # y is x shifted by one
        assert (x[i, n:] == PAD).all() and (y[i, n:] == PAD).all()
        assert tok.decode(y[i].tolist()) == s
    assert int((y != PAD).sum()) == sum(lengths)
    x10, y10 = encode_batch(tok, smiles, max_len=20)
    assert x10.shape == (3, 20) and torch.equal(x10[:, : x.shape[1]], x)
    with pytest.raises(ValueError, match="max_len"):
        encode_batch(tok, smiles, max_len=5)
    xt, yt = trim_padding(list(zip(x10[[0, 2]], y10[[0, 2]])))
    assert xt.shape == (2, lengths[0]) and torch.equal(yt, y[[0, 2], : lengths[0]])
    assert token_lengths(smiles) == [n - 1 for n in lengths]


def test_full_size_model_has_about_1_6m_weights():
    model = SmilesLSTM(25)  # the MOSES vocabulary: 22 tokens + PAD, BOS, EOS
    assert model.n_params == 1_591_833
    assert sum(p.numel() for p in model.parameters()) == model.n_params
    assert model.lstm.num_layers == 3 and model.lstm.hidden_size == 256
    logits = model(torch.zeros(2, 7, dtype=torch.long))
    assert logits.shape == (2, 7, 25)


def small_trained(n_steps: int = 40):
    tok = fitted_tokenizer()
    x, y = encode_batch(tok, HAND * 10)
    torch.manual_seed(0)
    model = SmilesLSTM(tok.vocab_size, embed=8, hidden=8, layers=1)
    losses = train_lm(
        model, x, y, steps=n_steps, batch_size=16, lr=1e-2, generator=torch.Generator()
    )
    return tok, model, x, y, losses


def test_train_lm_reduces_loss():
    _, model, _, _, losses = small_trained(60)
    assert len(losses) == 60 and not model.training
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:5]) / 5


def test_generate_shapes_and_reproducibility():
    tok, model, _, _, _ = small_trained()
    a = generate(model, tok, 6, 30, torch.Generator().manual_seed(1))
    b = generate(model, tok, 6, 30, torch.Generator().manual_seed(1))
    c = generate(model, tok, 6, 30, torch.Generator().manual_seed(2))
    assert len(a) == 6 and all(isinstance(s, str) for s in a)
    assert a == b and a != c
    assert all(len(tok.tokenize(s)) <= 30 for s in a)
    # the model's own weights as a flat vector (and as a dict) give the same draw
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert generate(model, tok, 6, 30, torch.Generator().manual_seed(1), params=theta) == a
    named = {n: p.detach() for n, p in model.named_parameters()}
    assert generate(model, tok, 6, 30, torch.Generator().manual_seed(1), params=named) == a
    # other weights change the draw; the module itself is untouched
    before = theta.clone()
    other = generate(model, tok, 6, 30, torch.Generator().manual_seed(1), params=theta * 0)
    assert len(other) == 6
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), before)
    with pytest.raises(ValueError, match="flat weight vector"):
        generate(model, tok, 2, 5, params=theta[:-1])


def test_validity_optional():
    value = validity(["CCO", "C(", ""])
    try:
        import rdkit  # noqa: F401
    except ImportError:
        assert value is None
    else:
        assert value == pytest.approx(1 / 3)


def test_trimmed_batches_leave_the_glas_eigenpairs_unchanged():
    """trim_padding drops only trailing PAD steps: a causal model's GGN is unchanged."""
    _, model, x, y, _ = small_trained()
    dataset = TensorDataset(x[:24], y[:24])
    eig = {}
    for name, collate in (("padded", None), ("trimmed", trim_padding)):
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="glas",
            n_components=3,
            ignore_index=PAD,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.fit(DataLoader(dataset, batch_size=8, collate_fn=collate))
        eig[name] = la.eigenvalues
        assert la.n_data == int((y[:24] != PAD).sum())
    torch.testing.assert_close(eig["trimmed"], eig["padded"], rtol=1e-4, atol=1e-7)


def run_example(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_example_help():
    result = run_example("--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--quick", "--data", "--subsample", "--k", "--solver", "--threads", "--out"):
        assert flag in result.stdout


@needs_data
def test_example_quick(tmp_path):
    # about 50 s on an idle 2-core machine; the timeout allows for a loaded one
    checkpoint = tmp_path / "lm.pt"
    result = run_example(
        "--quick",
        "--threads",
        "2",
        "--out",
        str(tmp_path),
        "--checkpoint",
        str(checkpoint),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"saved to {checkpoint}" in out and checkpoint.is_file()
    for section in (
        "== Model:",
        "== Training:",
        "== GLAS fit (mean-loss scaling",
        "GGN products",
        "peak RSS",
        "95% of the activity is carried by",
        "== Replica check",
        "== Per-token calibration",
        "-- mean scaling",
        "-- sum scaling",
        "== Free-running generation",
    ):
        assert section in out, f"missing {section!r} in:\n{out}"
    for scaling in ("mean", "sum"):
        for k in (1, 5):
            assert any(line.split()[:2] == [scaling, str(k)] for line in out.splitlines()), (
                f"no generation row for {scaling}, k={k}:\n{out}"
            )
    png = tmp_path / "smiles_activity.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert png.exists() and png.stat().st_size > 0

    # a second run reuses the trained model: same held-out loss, no training
    again = run_example(
        "--quick",
        "--threads",
        "2",
        "--checkpoint",
        str(checkpoint),
        "--replicas",
        "0",
        "--n-gen",
        "4",
        "--n-posterior",
        "1",
        timeout=600,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"(loaded from {checkpoint})" in again.stdout

    def held_out(text: str) -> str:
        line = next(x for x in text.splitlines() if x.startswith("== Training"))
        return line.split("held-out")[1].split(";")[0]

    assert held_out(again.stdout) == held_out(out)


def test_language_model_checkpoint_round_trip(tmp_path):
    tokenizer = fitted_tokenizer()
    torch.manual_seed(0)
    model = SmilesLSTM(tokenizer.vocab_size, 8, 6, 2).eval()
    path = tmp_path / "lm.pt"
    save_language_model(path, model, tokenizer, {"steps": 3, "last20_loss": 1.5})
    loaded, tok, meta = load_language_model(path)
    assert tok.tokens == tokenizer.tokens
    assert (loaded.embed_size, loaded.hidden, loaded.layers) == (8, 6, 2)
    assert meta == {"steps": 3, "last20_loss": 1.5}
    assert not loaded.training
    x, _ = encode_batch(tokenizer, HAND)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert tok.encode(HAND[0]) == tokenizer.encode(HAND[0])


def test_language_model_checkpoint_errors(tmp_path):
    tokenizer = fitted_tokenizer()
    model = SmilesLSTM(tokenizer.vocab_size + 1, 4, 4, 1)
    with pytest.raises(ValueError, match="vocabulary"):
        save_language_model(tmp_path / "x.pt", model, tokenizer)
    with pytest.raises(TypeError, match="SmilesLSTM"):
        save_language_model(tmp_path / "x.pt", torch.nn.Linear(2, 2), tokenizer)
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        load_language_model(tmp_path / "missing.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a SMILES language-model checkpoint"):
        load_language_model(tmp_path / "other.pt")


def test_encodable_keeps_what_encode_batch_accepts():
    tokenizer = fitted_tokenizer()
    candidates = [*HAND, "CC[Se]C", "C" * 30]  # an unknown token; one too long
    kept = encodable(tokenizer, candidates, max_len=25)
    assert kept == HAND
    x, _ = encode_batch(tokenizer, kept, 25)
    assert x.shape == (len(HAND), 25)


def test_length_sorted_loader_sorts_and_trims():
    tokenizer = fitted_tokenizer()
    smiles = ["CCCCCCCC", "C", "CCCC", "CC", "CCCCCCCCCCCC", "CCC"]
    x, y = encode_batch(tokenizer, smiles)
    batches = list(length_sorted_loader(x, y, batch_size=2))
    lengths = [int((yb != PAD).sum(1).max()) for _, yb in batches]
    assert lengths == sorted(lengths)
    for xb, yb in batches:
        assert xb.shape == yb.shape and yb.shape[1] == int((yb != PAD).sum(1).max())
    total = sum(int((yb != PAD).sum()) for _, yb in batches)
    assert total == int((y != PAD).sum())  # no target lost by the trimming


def test_checkpoint_keeps_the_dropout_setting(tmp_path):
    tokenizer = fitted_tokenizer()
    model = SmilesLSTM(tokenizer.vocab_size, 8, 8, 2, dropout=0.3)
    save_language_model(tmp_path / "lm.pt", model, tokenizer)
    loaded, _, _ = load_language_model(tmp_path / "lm.pt")
    assert loaded.lstm.dropout == pytest.approx(0.3)


def test_generation_never_samples_pad_or_bos():
    """Even a model that puts almost all its mass on PAD/BOS yields only real tokens."""
    tok = fitted_tokenizer()
    model = SmilesLSTM(tok.vocab_size, 8, 8, 1)
    with torch.no_grad():
        model.head.bias.zero_()
        model.head.bias[PAD] = model.head.bias[BOS] = 30.0
    out = generate(model, tok, 20, 15, torch.Generator().manual_seed(0))
    lengths = [len(SmilesTokenizer.tokenize(s)) for s in out]
    # had PAD/BOS been drawn (and dropped by decode), the strings would be ~empty
    assert sum(lengths) > 100
