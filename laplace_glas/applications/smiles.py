"""SMILES language models for GLAS: tokenizer, data, a REINVENT-style LSTM, sampling.

A leaf module (nothing in the core imports it) behind ``examples/smiles_lstm.py``:

* :class:`SmilesTokenizer`: character-level, except that the two-letter halogens
  ``Cl`` and ``Br``, bracket atoms (``[nH]``, ``[C@@H]``, ``[N+]``, ...) and two-digit
  ring closures (``%10``) are single tokens. Special tokens ``PAD = 0``, ``BOS = 1``,
  ``EOS = 2``.
* :func:`load_smiles` reads one SMILES per line (the MOSES benchmark's training
  split, MIT licence, is the intended source).
* :func:`encode_batch` turns SMILES into next-token prediction pairs
  ``x = [BOS, t_1, ..., t_n]``, ``y = [t_1, ..., t_n, EOS]``, padded with ``PAD``
  (an ``ignore_index`` target: padding is not a likelihood term).
* :class:`SmilesLSTM`: ``Embedding -> LSTM (3 x 256) -> Linear``, as in REINVENT;
  with the default sizes and the MOSES vocabulary it has about 1.6 M weights.
* :func:`save_language_model` / :func:`load_language_model`: a trained model with its
  vocabulary in one file (``torch.load(weights_only=True)``-safe).
* :func:`train_lm`, :func:`generate` (free-running sampling, optionally with another
  weight vector, e.g. a posterior sample, through ``torch.func.functional_call``) and
  :func:`validity` (RDKit, optional).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.cli import DataNotFoundError
from laplace_glas.autodiff.functional import module_call
from laplace_glas.curvature.data.losses import TokenCrossEntropy
from laplace_glas.validation import positive_int

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SmilesLSTM",
    "SmilesTokenizer",
    "encodable",
    "encode_batch",
    "generate",
    "length_sorted_loader",
    "load_language_model",
    "load_smiles",
    "save_language_model",
    "token_lengths",
    "train_lm",
    "trim_padding",
    "validity",
]

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = ("<pad>", "<bos>", "<eos>")
# bracket atoms, two-letter halogens, two-digit ring closures, then any single character
_TOKEN_PATTERN = re.compile(r"\[[^\]]+\]|Cl|Br|%\d{2}|.", re.DOTALL)

MOSES_SOURCE = (
    "the MOSES benchmark's training split (Polykovskiy et al. 2020, "
    "https://github.com/molecularsets/moses, MIT licence), one SMILES per line"
)


class SmilesTokenizer:
    """Character-level SMILES tokenizer with multi-character atom tokens.

    ``Cl``, ``Br``, bracket atoms such as ``[nH]`` or ``[C@@H]`` and ring closures
    ``%nn`` are single tokens; every other character is its own token. Ids ``0, 1, 2``
    are ``PAD``, ``BOS`` and ``EOS``; the others are assigned by :meth:`fit` in order of
    decreasing frequency (ties alphabetically), so the vocabulary is deterministic.
    """

    pad_id: int = PAD
    bos_id: int = BOS
    eos_id: int = EOS

    def __init__(self, tokens: Sequence[str] | None = None) -> None:
        self.tokens: list[str] = list(_SPECIALS)
        self._index: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        if tokens is not None:
            for token in tokens:
                self._add(token)

    def _add(self, token: str) -> None:
        if token not in self._index:
            self._index[token] = len(self.tokens)
            self.tokens.append(token)

    @staticmethod
    def tokenize(smiles: str) -> list[str]:
        """Split a SMILES string into tokens (``''.join`` of the result is ``smiles``)."""
        return _TOKEN_PATTERN.findall(smiles)

    def fit(self, smiles_list: Iterable[str]) -> SmilesTokenizer:
        """Add every token seen in ``smiles_list`` to the vocabulary; returns ``self``."""
        counts: dict[str, int] = {}
        for smiles in smiles_list:
            for token in self.tokenize(smiles):
                counts[token] = counts.get(token, 0) + 1
        for token in sorted(counts, key=lambda t: (-counts[t], t)):
            self._add(token)
        return self

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return len(self.tokens)

    def encode(self, smiles: str, add_special: bool = True) -> list[int]:
        """Token ids of ``smiles``, wrapped in ``BOS ... EOS`` when ``add_special``.

        Raises
        ------
        ValueError
            If ``smiles`` contains a token the tokenizer was not fitted on.

        """
        try:
            ids = [self._index[t] for t in self.tokenize(smiles)]
        except KeyError as err:
            raise ValueError(
                f"Unknown SMILES token {err.args[0]!r} in {smiles!r}: fit the tokenizer on "
                "data that contains it."
            ) from None
        return [BOS, *ids, EOS] if add_special else ids

    def decode(self, ids: Iterable[int]) -> str:
        """SMILES string of ``ids``: stops at the first ``EOS``, skips ``PAD``/``BOS``."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            out.append(self.tokens[i])
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"SmilesTokenizer(vocab_size={self.vocab_size})"


def load_smiles(path: str | Path, limit: int | None = None) -> list[str]:
    """Read SMILES, one per line (first whitespace-separated field; blank lines skipped).

    Parameters
    ----------
    path : str or Path
        A ``.smi`` / ``.txt`` / ``.csv``-like file; a header line ``SMILES`` is skipped.
    limit : int, optional
        Read at most this many SMILES (the first ones).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist (the message names the MOSES source and licence).

    """
    limit = positive_int("limit", limit)
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(
            f"SMILES file not found: {path}: pass --data PATH. Expected {MOSES_SOURCE}; "
            "e.g. the first 20,000 lines of MOSES' train.csv (SMILES column) saved as "
            "moses_train_20k.smi."
        )
    smiles: list[str] = []
    with path.open() as handle:
        for line in handle:
            fields = line.split()
            if not fields:
                continue
            field = fields[0].split(",")[0]
            if field.upper() == "SMILES":
                continue
            smiles.append(field)
            if limit is not None and len(smiles) >= limit:
                break
    if not smiles:
        raise ValueError(f"No SMILES found in {path}.")
    return smiles


def encode_batch(
    tokenizer: SmilesTokenizer, smiles: Sequence[str], max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token prediction pairs ``(x, y)`` of shape ``(n, max_len)`` (int64).

    For tokens ``t_1..t_m``: ``x = [BOS, t_1, ..., t_m]`` and ``y = [t_1, ..., t_m, EOS]``,
    right-padded with ``PAD`` (in ``x`` and ``y``; use ``ignore_index=PAD``).

    Parameters
    ----------
    tokenizer : SmilesTokenizer
        A fitted tokenizer.
    smiles : sequence of str
        The SMILES strings.
    max_len : int, optional
        Sequence length (``m + 1`` for the longest SMILES by default).

    Raises
    ------
    ValueError
        If a SMILES needs more than ``max_len`` steps (nothing is silently cut).

    """
    encoded = [tokenizer.encode(s) for s in smiles]
    longest = max((len(e) - 1 for e in encoded), default=0)
    max_len = longest if max_len is None else int(max_len)
    if longest > max_len:
        raise ValueError(
            f"A SMILES needs {longest} prediction steps, more than max_len={max_len}; "
            "raise max_len or filter the data."
        )
    x = torch.full((len(encoded), max_len), PAD, dtype=torch.long)
    y = torch.full((len(encoded), max_len), PAD, dtype=torch.long)
    for i, ids in enumerate(encoded):
        steps = len(ids) - 1
        x[i, :steps] = torch.tensor(ids[:-1])
        y[i, :steps] = torch.tensor(ids[1:])
    return x, y


def trim_padding(
    batch: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``collate_fn`` that stacks ``(x, y)`` pairs and drops trailing all-``PAD`` columns.

    For a causal model (the LSTM) the outputs at the kept positions do not depend on the
    dropped ones, so the loss and the GGN are unchanged while the padded steps are no
    longer computed. Do not use it where batches are concatenated afterwards (e.g. a
    calibration loader): their lengths differ.
    """
    x = torch.stack([b[0] for b in batch])
    y = torch.stack([b[1] for b in batch])
    used = (y != PAD).any(0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    return x[:, :length], y[:, :length]


def length_sorted_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> DataLoader:
    """A loader over ``(x, y)`` sorted by sequence length, batches trimmed of padding.

    Batches (also those of a random subsample, which keeps the order) then hold
    sequences of similar length, and :func:`trim_padding` drops their padded tail: for
    the causal LSTM the loss and the GGN are unchanged, the padded steps are not computed.
    """
    order = torch.argsort((y != PAD).sum(1), stable=True)
    return DataLoader(
        TensorDataset(x[order], y[order]), batch_size=batch_size, collate_fn=trim_padding
    )


def encodable(tokenizer: SmilesTokenizer, smiles: Iterable[str], max_len: int) -> list[str]:
    """The SMILES made only of ``tokenizer``'s tokens and shorter than ``max_len`` tokens
    (so that ``encode_batch(tokenizer, result, max_len)`` succeeds).
    """
    known = set(tokenizer.tokens)
    kept = []
    for s in smiles:
        tokens = tokenizer.tokenize(s)
        if set(tokens) <= known and len(tokens) < max_len:
            kept.append(s)
    return kept


def token_lengths(smiles: Iterable[str]) -> list[int]:
    """Number of tokens of each SMILES (``SmilesTokenizer.tokenize``)."""
    return [len(SmilesTokenizer.tokenize(s)) for s in smiles]


class SmilesLSTM(nn.Module):
    """REINVENT-style SMILES language model: ``Embedding -> LSTM -> Linear``.

    Parameters
    ----------
    vocab : int
        Vocabulary size (``SmilesTokenizer.vocab_size``).
    embed : int, default=256
        Embedding width.
    hidden : int, default=256
        LSTM hidden size.
    layers : int, default=3
        Number of stacked LSTM layers.
    dropout : float, default=0.0
        Dropout between LSTM layers (training only).

    Notes
    -----
    ``D = V e + 4 h (e + h + 2) + (L - 1) 4 h (2 h + 2) + (h + 1) V``; with ``V = 25``,
    ``e = h = 256``, ``L = 3``: D = 1,592,601.

    """

    def __init__(
        self, vocab: int, embed: int = 256, hidden: int = 256, layers: int = 3, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.vocab, self.embed_size, self.hidden, self.layers = vocab, embed, hidden, layers
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self,
        tokens: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Logits ``(batch, seq_len, vocab)`` for tokens ``(batch, seq_len)``.

        With ``return_state`` also the LSTM state ``(h, c)``, which ``state`` takes
        back to continue a sequence (free-running generation).
        """
        if isinstance(tokens, Mapping):
            tokens = tokens["input_ids"]
        out, new_state = self.lstm(self.embedding(tokens), state)
        logits = self.head(out)
        return (logits, new_state) if return_state else logits

    @property
    def n_params(self) -> int:
        """Number of weights ``D``."""
        return sum(p.numel() for p in self.parameters())


def save_language_model(
    path: str | Path,
    model: SmilesLSTM,
    tokenizer: SmilesTokenizer,
    metadata: Mapping[str, float | int | str] | None = None,
) -> None:
    """Save a trained :class:`SmilesLSTM` with its vocabulary to ``path``.

    The file holds plain containers and tensors only (architecture sizes, token list,
    ``state_dict`` and optional scalar ``metadata`` such as training steps and losses),
    so :func:`load_language_model` reads it with ``torch.load(weights_only=True)``.
    """
    if not isinstance(model, SmilesLSTM):
        raise TypeError(f"save_language_model expects a SmilesLSTM, got {type(model).__name__}.")
    if model.vocab != tokenizer.vocab_size:
        raise ValueError(
            f"Model vocabulary ({model.vocab}) and tokenizer ({tokenizer.vocab_size} tokens) "
            "differ: save the tokenizer the model was built with."
        )
    torch.save(
        {
            "config": {
                "vocab": model.vocab,
                "embed": model.embed_size,
                "hidden": model.hidden,
                "layers": model.layers,
                "dropout": float(model.lstm.dropout),
            },
            "tokens": list(tokenizer.tokens),
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "metadata": dict(metadata or {}),
        },
        path,
    )


def load_language_model(
    path: str | Path, map_location: str | torch.device | None = None
) -> tuple[SmilesLSTM, SmilesTokenizer, dict[str, float | int | str]]:
    """Load what :func:`save_language_model` wrote: ``(model, tokenizer, metadata)``.

    The model is returned in eval mode (on ``map_location`` if given).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not a SMILES language-model checkpoint.

    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No language-model checkpoint at {path}.")
    blob = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(blob, dict) or not {"config", "tokens", "state_dict"} <= blob.keys():
        raise ValueError(
            f"{path} is not a SMILES language-model checkpoint (expected the keys 'config', "
            "'tokens', 'state_dict' written by save_language_model)."
        )
    specials = list(blob["tokens"][: len(_SPECIALS)])
    if specials != list(_SPECIALS):
        raise ValueError(f"{path}: the vocabulary does not start with {_SPECIALS}.")
    tokenizer = SmilesTokenizer(blob["tokens"][len(_SPECIALS) :])
    model = SmilesLSTM(**blob["config"])
    model.load_state_dict(blob["state_dict"])
    if map_location is not None:
        model.to(map_location)
    model.eval()
    return model, tokenizer, dict(blob.get("metadata", {}))


def train_lm(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int = 500,
    batch_size: int = 128,
    lr: float = 1e-3,
    clip: float = 1.0,
    generator: torch.Generator | None = None,
    log_every: int = 0,
) -> list[float]:
    """Train a language model on ``(x, y)`` by Adam on the mean per-token cross-entropy.

    Mini-batches are drawn with ``generator`` (epochs of a random permutation); each
    batch is trimmed to its longest sequence. Returns the loss of every step; the model
    is left in eval mode.

    Parameters
    ----------
    model : nn.Module
        Maps ``(batch, seq_len)`` tokens to ``(batch, seq_len, vocab)`` logits.
    x, y : torch.Tensor
        From :func:`encode_batch`.
    steps, batch_size, lr : int, int, float
        Adam steps, sequences per step, learning rate.
    clip : float, default=1.0
        Gradient-norm clipping (``0`` to switch off).
    generator : torch.Generator, optional
        Controls the batch order.
    log_every : int, default=0
        Print the running loss every so many steps (``0``: silent).

    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    loss_fn = TokenCrossEntropy("mean", ignore_index=PAD)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    n = x.shape[0]
    batch_size = min(batch_size, n)
    losses: list[float] = []
    model.train()
    order = torch.randperm(n, generator=generator)
    cursor = 0
    for step in range(steps):
        if cursor + batch_size > n:
            order, cursor = torch.randperm(n, generator=generator), 0
        index = order[cursor : cursor + batch_size]
        cursor += batch_size
        xb, yb = trim_padding(list(zip(x[index], y[index])))
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            print(f"  step {step + 1:>5}: loss {sum(recent) / len(recent):.4f}", flush=True)
    model.eval()
    return losses


def _as_param_dict(
    model: nn.Module, params: torch.Tensor | Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from a flat ``(D,)`` weight vector (``model.parameters()`` order)."""
    if isinstance(params, Mapping):
        return dict(params)
    named = list(model.named_parameters())
    D = sum(p.numel() for _, p in named)
    if params.ndim != 1 or params.numel() != D:
        raise ValueError(f"params must be a flat weight vector of length D = {D}.")
    out, offset = {}, 0
    for name, p in named:
        out[name] = params[offset : offset + p.numel()].reshape(p.shape).to(p.dtype)
        offset += p.numel()
    return out


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: SmilesTokenizer,
    n: int,
    max_len: int,
    generator: torch.Generator | None = None,
    params: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    temperature: float = 1.0,
) -> list[str]:
    """Free-running sampling of ``n`` SMILES from a language model.

    Starting from ``BOS``, each next token is drawn from the softmax of the model's
    logits (divided by ``temperature``) and fed back, until ``EOS`` or ``max_len``
    tokens. A sequence that hits ``max_len`` without ``EOS`` is returned as it stands.
    ``PAD`` and ``BOS`` are excluded from the draw (the softmax is renormalised over the
    other tokens): they never follow a token in the data, and ``decode`` would drop them.

    Parameters
    ----------
    model : nn.Module
        A model with ``forward(tokens, state, return_state=True) -> (logits, state)``
        (:class:`SmilesLSTM`).
    tokenizer : SmilesTokenizer
        Decodes the sampled ids.
    n : int
        Number of sequences.
    max_len : int
        Maximum number of generated tokens (``EOS`` excluded).
    generator : torch.Generator, optional
        Makes the draw reproducible (must live on the model's device).
    params : torch.Tensor or mapping, optional
        Weights to sample with instead of the model's own, e.g. a GLAS posterior
        sample ``la.sample(1)[0]``: a flat ``(D,)`` vector in ``model.parameters()``
        order or a ``{name: tensor}`` dict; used through
        ``torch.func.functional_call`` (the module is not modified).
    temperature : float, default=1.0
        Softmax temperature of the sampling distribution.

    Returns
    -------
    list of str
        The decoded SMILES (possibly empty strings).

    """
    if n < 1 or max_len < 1:
        raise ValueError("n and max_len must be >= 1.")
    if temperature <= 0:
        raise ValueError("temperature must be positive.")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    weights = None if params is None else _as_param_dict(model, params)

    def step(tokens: torch.Tensor, state):
        if weights is None:
            return model(tokens, state, return_state=True)
        return module_call(model, weights, (tokens, state), {"return_state": True})

    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=device)
    state = None
    out = torch.full((n, max_len), PAD, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for t in range(max_len):
        logits, state = step(tokens, state)
        probs = torch.softmax(logits[:, -1].double() / temperature, dim=-1)
        # PAD and BOS are never a next token in the data (PAD targets are ignored, BOS
        # is never a target): a sampled one would be dropped by decode and hide a
        # broken sequence, so they are left out of the draw (multinomial renormalises;
        # a row with all its mass there ends the sequence)
        probs[:, [PAD, BOS]] = 0.0
        probs[probs.sum(-1) == 0, EOS] = 1.0
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        out[:, t] = nxt
        done |= nxt == EOS
        if bool(done.all()):
            break
        tokens = nxt.unsqueeze(1)
    model.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in out]


def validity(smiles_list: Sequence[str]) -> float | None:
    """Fraction of SMILES that RDKit parses into a molecule (empty strings are invalid).

    Returns ``None`` when RDKit is not installed (``pip install rdkit``; an optional
    extra, not a dependency of laplace-glas).
    """
    try:
        from rdkit import Chem, RDLogger
    except ImportError:
        return None
    if not smiles_list:
        return math.nan
    RDLogger.DisableLog("rdApp.*")
    valid = sum(1 for s in smiles_list if s and Chem.MolFromSmiles(s) is not None)
    return valid / len(smiles_list)
