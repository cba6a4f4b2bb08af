"""How much of a SMILES token's Jacobian the GLAS subspace captures (k = 2, 10, 50).

A small REINVENT-style LSTM (``Embedding -> LSTM -> Linear``, sizes from the command
line) is trained for a few hundred Adam steps on the first ``--n-train`` SMILES of the
MOSES subset; GLAS is fitted at the largest k (mean-loss scaling, padding ignored) and
:func:`laplace_glas.alignment` is evaluated on ``--n-test`` held-out SMILES. Every
non-padding position is one row (``||J||_F^2`` summed over the vocabulary's logits);
the script prints the median and quartiles of the captured share
``||J U||_F^2 / ||J||_F^2`` over tokens at each k.

Data: ``--data PATH`` (default ``../shared/data/smiles/moses_train_20k.smi`` beside the
repository; MOSES, MIT licence).
"""

from __future__ import annotations

# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split
import argparse
import time
import warnings
from pathlib import Path

import torch
from laplace import Laplace

from laplace_glas.applications.cli import HelpFormatter
from laplace_glas.applications.smiles import (
    PAD,
    SmilesLSTM,
    SmilesTokenizer,
    encodable,
    encode_batch,
    length_sorted_loader,
    load_smiles,
    train_lm,
)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/smiles/moses_train_20k.smi"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=HelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMILES file")
    parser.add_argument("--n-train", type=int, default=2000, help="training SMILES")
    parser.add_argument("--n-test", type=int, default=10, help="held-out SMILES evaluated")
    parser.add_argument("--embed", type=int, default=32, help="embedding width")
    parser.add_argument("--hidden", type=int, default=64, help="LSTM hidden size")
    parser.add_argument("--layers", type=int, default=1, help="LSTM layers")
    parser.add_argument("--steps", type=int, default=600, help="Adam steps")
    parser.add_argument("--subsample", type=int, default=200, help="SMILES in the GGN")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 10, 50], help="k values")
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    smiles = load_smiles(args.data, limit=args.n_train + args.n_test)
    train, test = smiles[: args.n_train], smiles[args.n_train :]
    tokenizer = SmilesTokenizer().fit(train)
    x, y = encode_batch(tokenizer, train)
    test = encodable(tokenizer, test, x.shape[1])
    xt, yt = encode_batch(tokenizer, test, x.shape[1])
    model = SmilesLSTM(tokenizer.vocab_size, args.embed, args.hidden, args.layers)
    start = time.perf_counter()
    losses = train_lm(model, x, y, steps=args.steps, batch_size=64, lr=3e-3, generator=generator)
    print(
        f"== SmilesLSTM(vocab {tokenizer.vocab_size}, embed {args.embed}, hidden "
        f"{args.hidden}, layers {args.layers}), D = {model.n_params}; {args.steps} Adam "
        f"steps on {len(train)} SMILES in {time.perf_counter() - start:.0f} s, last-20 "
        f"loss {sum(losses[-20:]) / 20:.3f}"
    )
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=max(args.ks),
        loss_scaling="mean",  # the subspace posterior the alignment scores read
        complement="zero",
        subsample_size=args.subsample,
        ignore_index=PAD,
        seed=args.seed,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la.fit(length_sorted_loader(x, y, 64))
    print(f"== GLAS fit k = {max(args.ks)}: {time.perf_counter() - start:.0f} s")
    la.optimize_prior_precision()
    mask = (yt != PAD).reshape(-1)
    print(f"\n{mask.sum()} tokens of {len(test)} held-out SMILES\n")
    start = time.perf_counter()
    result = laplace_glas.alignment(la, xt, chunk_size=2)
    print(f"alignment at k = {max(args.ks)}: {time.perf_counter() - start:.0f} s\n")
    # ||J u_j||^2 per direction; the leading k' of them give the share at k' < k
    per_direction = result.variance_by_direction[mask] / la.posterior_variances
    cumulative = per_direction.cumsum(dim=-1)
    norm2 = result.jacobian_norm2[mask]
    print("| k | median captured share | quartiles | median squared Frobenius norm of J |")
    print("| ---: | ---: | --- | ---: |")
    for k in sorted(args.ks):
        captured = (cumulative[:, k - 1] / norm2).clamp(0, 1)
        q1, med, q3 = torch.quantile(captured, torch.tensor([0.25, 0.5, 0.75])).tolist()
        print(f"| {k} | {med:.3f} | {q1:.3f} - {q3:.3f} | {float(norm2.median()):.3g} |")


if __name__ == "__main__":
    main()
