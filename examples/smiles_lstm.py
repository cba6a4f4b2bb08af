"""SMILES LSTM language model: GLAS on a 1.6M-weight REINVENT-style LSTM.

The paper's third experiment. A character-level SMILES language model (Embedding ->
3 x 256 LSTM -> Linear, about 1.6 M weights, as in REINVENT) is trained briefly on
MOSES SMILES; GLAS then finds the top-k eigenpairs of the per-token mean-loss GGN on a
random subsample of the training sequences (``subsample_size``, fixed generator).
The script prints

* the eigen-solve's cost (wall time, GGN products, peak RSS) and residuals;
* activity scores: the fraction of weights carrying 95% of the sensitivity (paper:
  7.6% on the 1.6M LSTM) and per-layer totals; the cumulative curve as a PNG (--out);
* a replica check of the eigenvectors recomputed on two other data subsamples;
* per-token calibration on held-out SMILES: coverage of the true next token by the
  90% credible set, for k in {1, 5, 20}, mean-loss vs standard (summed-loss) scaling;
* free-running generation from posterior weight samples for k in {1, 5, 20}, both
  scalings: validity (RDKit, if installed) and the length distribution.

The eigenpairs do not depend on the loss scaling: the solve runs once (mean scaling)
and the standard-scaling posterior reuses it (same eigenpairs, s = N).

Data: ``--data PATH`` (default ``../shared/data/smiles/moses_train_20k.smi`` beside the
repository): the first 20,000 SMILES of the MOSES training split (MIT licence).
Use ``--threads`` to pin the torch threads; timings on a loaded machine are noisy.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

from _cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/smiles/moses_train_20k.smi"
GEN_KS = (1, 5, 20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMILES file")
    parser.add_argument(
        "--quick", action="store_true", help="small model (1 x 32 LSTM), 500 SMILES, k <= 5"
    )
    parser.add_argument(
        "--n-train",
        type=int,
        default=None,
        help="training SMILES (default: 19000; 500 with --quick)",
    )
    parser.add_argument(
        "--n-heldout",
        type=int,
        default=None,
        help="held-out SMILES (default: 200; 60 with --quick)",
    )
    parser.add_argument(
        "--embed", type=int, default=None, help="embedding width (default: 256; 32 with --quick)"
    )
    parser.add_argument(
        "--hidden", type=int, default=None, help="LSTM hidden size (default: 256; 32 with --quick)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="LSTM layers (default: 3; 1 with --quick)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="Adam steps (default: 300; 60 with --quick)"
    )
    parser.add_argument("--train-batch", type=int, default=64, help="sequences per Adam step")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="trained model file: loaded if it exists (no training; --embed/--hidden/"
        "--layers/--steps ignored), else written after training",
    )
    parser.add_argument(
        "--subsample",
        type=int,
        default=None,
        help="SMILES in the eigen-solve subsample (default: 2000; 100 with --quick)",
    )
    parser.add_argument(
        "--k", type=int, default=None, help="eigenpairs (default: 20; at most 5 with --quick)"
    )
    parser.add_argument(
        "--solver",
        choices=("lanczos", "block"),
        default="lanczos",
        help="eigen-solver: ARPACK Lanczos, one GGN column per data pass, or block Krylov, "
        "--block-size columns per pass (faster for LSTMs)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block solver columns per data pass (default: max(k, 8))",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=0.0,
        help="relative solver tolerance (0: float32 precision for Lanczos, 1e-5 for block)",
    )
    parser.add_argument(
        "--maxiter",
        type=int,
        default=None,
        help="Lanczos restarts / block passes (default: the solver's own limit)",
    )
    parser.add_argument("--batch-size", type=int, default=100, help="sequences per GGN batch")
    parser.add_argument(
        "--replicas", type=int, default=2, help="replica solves on other subsamples (0: skip)"
    )
    parser.add_argument(
        "--pred-type", choices=("glm", "nn"), default="glm", help="predictive for calibration"
    )
    parser.add_argument(
        "--n-samples",
        type=int,
        default=None,
        help="posterior samples of the calibration predictive (default: 50; 30 with --quick)",
    )
    parser.add_argument(
        "--n-gen",
        type=int,
        default=None,
        help="SMILES generated per k (default: 200; 40 with --quick)",
    )
    parser.add_argument(
        "--n-posterior",
        type=int,
        default=None,
        help="posterior weight samples per k (default: 10; 4 with --quick)",
    )
    parser.add_argument("--level", type=float, default=0.9, help="credible-set level")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of data split, training, subsample and draws"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG of the cumulative activity, or a folder for it (default: no figure)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "n_train": (500, 19000),
        "n_heldout": (60, 200),
        "embed": (32, 256),
        "hidden": (32, 256),
        "layers": (1, 3),
        "steps": (60, 300),
        "subsample": (100, 2000),
        "k": (5, 20),
        "n_samples": (30, 50),
        "n_gen": (40, 200),
        "n_posterior": (4, 10),
    }
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if quick:
        args.k = min(args.k, 5)
    return args


if __name__ == "__main__":
    parse_args()  # --help and argument errors answer before torch and laplace load


# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas import (
    CoverageNotReachedWarning,
    activity_scores,
    per_parameter,
    replica_check,
    residual_report,
    select_dimension,
    weights_for_share,
)
from laplace_glas.applications.cli import run_example
from laplace_glas.applications.smiles import (
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
    validity,
)
from laplace_glas.curvature.data.losses import TokenCrossEntropy


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def length_summary(smiles: list[str]) -> str:
    lengths = token_lengths(smiles)
    sd = statistics.pstdev(lengths) if len(lengths) > 1 else 0.0
    return f"{statistics.mean(lengths):5.1f} +- {sd:4.1f}"


def fmt_validity(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.1%}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch threads: {torch.get_num_threads()}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    # ------------------------------------------------------------------ data
    smiles = load_smiles(args.data, limit=args.n_train + args.n_heldout)
    train_smiles, heldout = smiles[: args.n_train], smiles[args.n_train :]
    checkpoint = args.checkpoint if args.checkpoint and args.checkpoint.is_file() else None
    if checkpoint is not None:
        model, tokenizer, meta = load_language_model(checkpoint)
        known = set(tokenizer.tokens)
        unknown = [s for s in train_smiles if not set(tokenizer.tokenize(s)) <= known]
        if unknown:
            raise ValueError(
                f"{checkpoint} was trained with another vocabulary: {len(unknown)} training "
                f"SMILES hold tokens it lacks (first: {unknown[0]!r})."
            )
    else:
        tokenizer = SmilesTokenizer().fit(train_smiles)
    x, y = encode_batch(tokenizer, train_smiles)
    max_len = x.shape[1]
    heldout = encodable(tokenizer, heldout, max_len)
    xh, yh = encode_batch(tokenizer, heldout, max_len)
    n_tokens = int((y != PAD).sum())
    print(
        f"\n== Data: {args.data.name}: {len(train_smiles)} training SMILES ({n_tokens} tokens), "
        f"{len(heldout)} held-out; vocabulary {tokenizer.vocab_size} tokens "
        f"(PAD, BOS, EOS + {tokenizer.vocab_size - 3}); max length {max_len} steps"
    )

    # ------------------------------------------------------------------ MAP
    if checkpoint is None:
        model = SmilesLSTM(tokenizer.vocab_size, args.embed, args.hidden, args.layers)
    D = model.n_params
    print(
        f"== Model: Embedding({tokenizer.vocab_size}, {model.embed_size}) -> "
        f"LSTM({model.hidden} x {model.layers}) -> Linear: D = {D:,} weights"
        + ("" if args.quick else " (REINVENT-size target: ~1.6M)")
    )
    loss_fn = TokenCrossEntropy("mean", ignore_index=PAD)
    if checkpoint is None:
        start = time.perf_counter()
        losses = train_lm(
            model,
            x,
            y,
            steps=args.steps,
            batch_size=args.train_batch,
            lr=3e-3 if args.quick else 1e-3,
            generator=generator,
            log_every=0 if args.quick else 50,
        )
        train_time = time.perf_counter() - start
        tail = losses[-20:] if losses else [float("nan")]
        meta = {
            "steps": args.steps,
            "train_batch": args.train_batch,
            "first_loss": losses[0] if losses else float("nan"),
            "last20_loss": sum(tail) / len(tail),
            "train_seconds": train_time,
        }
        if args.checkpoint is not None:
            args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
            save_language_model(args.checkpoint, model, tokenizer, meta)
    with torch.no_grad():
        held_loss = float(loss_fn(model(xh), yh))
    nan = float("nan")
    steps, per_step = meta.get("steps", 0), meta.get("train_batch", 0)
    epochs = steps * per_step / len(train_smiles)
    print(
        f"== Training{' (loaded from ' + str(checkpoint) + ')' if checkpoint else ''}: "
        f"{steps} Adam steps x {per_step} SMILES (~{epochs:.1f} epochs), "
        f"{meta.get('train_seconds', nan):.1f} s; per-token loss first "
        f"{meta.get('first_loss', nan):.3f}, last-20 mean {meta.get('last20_loss', nan):.3f}, "
        f"held-out {held_loss:.3f}"
        + (f"; saved to {args.checkpoint}" if checkpoint is None and args.checkpoint else "")
    )

    train_loader = length_sorted_loader(x, y, args.batch_size)
    heldout_loader = DataLoader(TensorDataset(xh, yh), batch_size=args.batch_size)

    # ------------------------------------------------------------------ GLAS fit
    subsample = min(args.subsample, len(train_smiles))
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=args.k,
        loss_scaling="mean",
        complement="zero",  # the subspace alone, as in the paper
        solver=args.solver,
        block_size=args.block_size,
        tol=args.tol,
        maxiter=args.maxiter,
        subsample_size=subsample,
        seed=args.seed,
        ignore_index=PAD,
    )
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la.fit(train_loader)
    fit_time = time.perf_counter() - start
    info = la.lanczos_info
    passes = info.n_products - info.k + 1  # Lanczos: one vector a pass + the residual check
    if args.solver == "block":
        passes = -(-info.n_products // (args.block_size or max(args.k, 8)))
    print(
        f"\n== GLAS fit (mean-loss scaling, solver={args.solver}): k = {info.k} eigenpairs "
        f"on {subsample} subsampled SMILES ({info.n_data} tokens; N = {la.n_data} tokens in "
        f"the loss); eigen-solve {info.wall_time:.1f} s, {info.n_products} GGN products "
        f"(~{passes} data passes); "
        f"fit incl. loss pass {fit_time:.1f} s; peak RSS {peak_rss_mb():.0f} MB "
        f"(before fit {rss_before:.0f} MB); threads {torch.get_num_threads()}"
    )
    print(
        "   standard (summed-loss) scaling: the same eigenpairs with s = N; no second "
        "solve (cost as above)"
    )
    la_sum = copy.copy(la)
    la_sum.loss_scaling = "sum"
    posteriors = {"mean": la, "sum": la_sum}
    print(residual_report(la))

    # ------------------------------------------------------------------ activity
    scores = activity_scores(la, k=info.k)
    count, frac = weights_for_share(scores, 0.95)
    total = float(scores.sum())
    print(f"\n== Activity scores (k = {info.k}, eigenvalue weights)")
    print(
        f"   95% of the activity is carried by {count:,} of {D:,} weights ({frac:.2%}); "
        "paper: 7.6% on the 1.6M LSTM"
    )
    ordered = scores.sort(descending=True).values
    for fraction in (0.001, 0.01, 0.1):
        n_top = max(1, round(fraction * D))
        print(
            f"   top {fraction:.1%} of weights ({n_top:,}): "
            f"{float(ordered[:n_top].sum()) / total:.1%} of the activity"
        )
    print("   per parameter tensor (share of activity / share of weights):")
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    for name, value in per_parameter(la, scores).items():
        print(f"   {name:>20}: {value / total:7.2%} / {sizes[name] / D:7.2%}")
    if args.out is not None:
        path = args.out if args.out.suffix == ".png" else args.out / "smiles_activity.png"
        try:
            from laplace_glas.plotting import plot_cumulative_activity

            path.parent.mkdir(parents=True, exist_ok=True)
            plot_cumulative_activity(
                {f"SMILES LSTM, k = {info.k}": scores},
                path=path,
                title=f"SMILES LSTM, D = {D:,}, {subsample:,} SMILES",
            )
            print(f"   cumulative activity curve written to {path}")
        except ImportError:
            print("   matplotlib is not installed: no figure (pip install 'laplace-glas[plot]')")

    # ------------------------------------------------------------------ replicas
    if args.replicas > 0:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
            check = replica_check(la, train_loader, n_replicas=args.replicas, subsample=subsample)
        print(
            f"\n== Replica check ({args.replicas} solves on other subsamples of {subsample} "
            f"SMILES, {time.perf_counter() - start:.1f} s)"
        )
        print(check)
        print("   eigenvalues fit / replicas (first 5):")
        print("   fit:     " + ", ".join(f"{v:.4g}" for v in info.values[:5].tolist()))
        for r, values in enumerate(check.replica_eigenvalues):
            print(f"   replica {r + 1}: " + ", ".join(f"{v:.4g}" for v in values[:5].tolist()))

    # ------------------------------------------------------------------ calibration
    ks = sorted({min(k, info.k) for k in GEN_KS})
    print(
        f"\n== Per-token calibration on {len(heldout)} held-out SMILES "
        f"({int((yh != PAD).sum())} tokens): coverage of the true next token by the "
        f"{args.level:.0%} credible set, pred_type='{args.pred_type}', "
        f"{args.n_samples} samples"
    )
    with torch.no_grad():
        probs = torch.softmax(model(xh), -1)
    map_row = _map_credible_sets(probs, yh, args.level)
    print(f"   MAP (no posterior): coverage {map_row[0]:.3f}, mean set size {map_row[1]:.2f}")
    for scaling, posterior in posteriors.items():
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CoverageNotReachedWarning)
            selection = select_dimension(
                posterior,
                heldout_loader,
                coverage=args.level,
                ks=ks,
                pred_type=args.pred_type,
                n_samples=args.n_samples,
                generator=torch.Generator().manual_seed(args.seed + 1),
            )
        print(f"   -- {scaling} scaling ({time.perf_counter() - start:.1f} s)")
        print(f"   {'k':>4} {'prior prec':>11} {'coverage':>9} {'set size':>9} {'NLL':>8}")
        for row in selection.rows:
            eb = " (EB)" if row.empirical_bayes else ""
            print(
                f"   {row.k:>4} {row.prior_precision:>11.4g} {row.coverage:>9.3f} "
                f"{row.mean_width:>9.3f} {row.nll:>8.4f}{eb}"
            )
        verdict = "reached" if selection.reached else "NOT reached"
        print(f"   {args.level:.0%} {verdict}; selection k = {selection.k}")

    # ------------------------------------------------------------------ generation
    gen_len = max_len + 10
    per_sample = max(1, args.n_gen // args.n_posterior)
    print(
        f"\n== Free-running generation: {args.n_posterior} posterior weight samples x "
        f"{per_sample} SMILES per (scaling, k), prior precision from empirical Bayes at "
        f"each k; max {gen_len} tokens (a SMILES without EOS by then counts as invalid)"
    )
    valid_note = validity(["C"])
    if valid_note is None:
        print("   RDKit is not installed: validity n/a (pip install rdkit)")
    print(f"   training data length (tokens): {length_summary(train_smiles)}")
    map_smiles = generate(
        model, tokenizer, per_sample * args.n_posterior, gen_len, torch.Generator().manual_seed(7)
    )
    print(
        f"   {'scaling':>7} {'k':>3} {'tau':>9} {'valid':>7} {'length':>14} {'empty':>6}"
        f" {'no EOS':>7}"
    )
    print(_gen_row("MAP", "-", float("nan"), map_smiles, gen_len))
    for scaling, posterior in posteriors.items():
        for k in ks:
            posterior.n_components = k
            posterior.optimize_prior_precision(method="marglik")
            tau = float(posterior.prior_precision)
            thetas = posterior.sample(args.n_posterior, torch.Generator().manual_seed(11 + k))
            gen_generator = torch.Generator().manual_seed(7)
            generated = []
            for theta in thetas:
                generated += generate(
                    model, tokenizer, per_sample, gen_len, gen_generator, params=theta
                )
            print(_gen_row(scaling, str(k), tau, generated, gen_len))
        posterior.n_components = info.k
    print(f"\npeak RSS of the whole run: {peak_rss_mb():.0f} MB")


def _map_credible_sets(probs: torch.Tensor, y: torch.Tensor, level: float) -> tuple[float, float]:
    """Coverage and mean size of the MAP's smallest token sets with mass >= ``level``."""
    keep = y.reshape(-1) != PAD
    probs, y = probs.reshape(-1, probs.shape[-1])[keep], y.reshape(-1)[keep]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    in_set = torch.zeros_like(sorted_p, dtype=torch.bool).scatter(
        -1, order, (torch.cumsum(sorted_p, -1) - sorted_p) < level
    )
    covered = in_set.gather(1, y.reshape(-1, 1)).double().mean()
    return float(covered), float(in_set.sum(-1).double().mean())


def _gen_row(scaling: str, k: str, tau: float, smiles: list[str], gen_len: int) -> str:
    """One table row; a sequence cut at ``gen_len`` without EOS counts as invalid (long
    carbon chains such as 'CCCC...' would otherwise parse).
    """
    empty = sum(1 for s in smiles if not s) / len(smiles)
    terminated = [s if len(SmilesTokenizer.tokenize(s)) < gen_len else "" for s in smiles]
    unterminated = sum(1 for s, t in zip(smiles, terminated) if s and not t) / len(smiles)
    nonempty = [s for s in smiles if s] or [""]
    return (
        f"   {scaling:>7} {k:>3} {tau:>9.3g} {fmt_validity(validity(terminated)):>7} "
        f"{length_summary(nonempty):>14} {empty:>6.1%} {unterminated:>7.1%}"
    )


if __name__ == "__main__":
    run_example(main)
