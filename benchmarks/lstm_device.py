"""Time GLAS fit and predict of the SMILES LSTM on one device (a GPU where there is one).

The short device check of the SMILES issue: on ``--device`` (default ``cuda`` when
available, else ``cpu``) it fits GLAS (``k`` eigenpairs of the per-token mean-loss GGN
on ``--subsample`` SMILES) to the REINVENT-size LSTM (3 x 256, D ~ 1.6 M) and times

* the eigen-solve: seconds, GGN products, data passes, seconds per product;
* the 'glm' predictive (k forward-mode JVPs; probit link) on ``--n-predict`` held-out
  SMILES, the 'nn' predictive (``--n-samples`` weight samples, Monte Carlo link) and
  ``sample``;
* peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, peak RSS on the CPU;

and checks that every result lives on the device. With ``--cpu-reference`` the
predictives (not the fit: minutes at full size) are timed on the CPU too, side by side,
for the ratio. Timings are wall-clock with ``torch.cuda.synchronize()`` around each.

The weights come from ``--checkpoint`` (written by ``examples/smiles_lstm.py
--checkpoint``) or, without one, from ``--train-steps`` Adam steps (timings hardly
depend on training; the number of solver passes does a little). ``--quick`` is a
1 x 32 LSTM on 100 SMILES with k = 3 (seconds, CPU-friendly).

    python benchmarks/lstm_device.py --checkpoint runs/smiles_lstm_full.pt
"""

from __future__ import annotations

# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split
import argparse
import resource
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from laplace import Laplace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_description

from laplace_glas.applications.smiles import (
    PAD,
    SmilesLSTM,
    SmilesTokenizer,
    encodable,
    encode_batch,
    length_sorted_loader,
    load_language_model,
    load_smiles,
    train_lm,
)

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/smiles/moses_train_20k.smi"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMILES file")
    parser.add_argument("--checkpoint", type=Path, default=None, help="trained LSTM file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="1 x 32 LSTM, 100 SMILES, k = 3")
    parser.add_argument("--n-train", type=int, default=None, help="SMILES to draw from [19000]")
    parser.add_argument("--train-steps", type=int, default=50, help="without --checkpoint")
    parser.add_argument("--subsample", type=int, default=None, help="eigen-solve SMILES [2000]")
    parser.add_argument("--k", type=int, default=None, help="eigenpairs [20]")
    parser.add_argument("--solver", choices=("lanczos", "block"), default="block")
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument(
        "--block-size", type=int, default=None, help="block solver columns per pass [max(k, 8)]"
    )
    parser.add_argument(
        "--maxiter", type=int, default=None, help="cap on data passes (block) / restarts"
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="sequences per GGN batch [200]"
    )
    parser.add_argument("--n-predict", type=int, default=None, help="held-out SMILES [200]")
    parser.add_argument("--n-samples", type=int, default=10, help="'nn' weight samples")
    parser.add_argument("--cpu-reference", action="store_true", help="predictives on CPU too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--progress-bar", action="store_true", help="tqdm bars of the fit")
    args = parser.parse_args(argv)
    quick = {"n_train": 300, "subsample": 100, "k": 3, "n_predict": 20, "batch_size": 50}
    full = {"n_train": 19000, "subsample": 2000, "k": 20, "n_predict": 200, "batch_size": 200}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:  # explicit values win over --quick
            setattr(args, name, value)
    return args


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()`` and its wall time, synchronising the device before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak RSS of the process (CPU), in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def predictive_timings(la, xh: torch.Tensor, device: torch.device, n_samples: int, seed: int):
    """Seconds of the 'glm' and 'nn' predictives and of ``sample`` on ``device`` (each
    after one untimed warm-up call on two inputs: kernel selection, the 'nn' path's
    vmap probe).
    """
    xh = xh.to(device)
    warm = torch.Generator(device).manual_seed(seed)
    la(xh[:2], pred_type="glm")
    la(xh[:2], pred_type="nn", link_approx="mc", n_samples=2, generator=warm)
    probs, glm = timed(lambda: la(xh, pred_type="glm"), device)
    generator = torch.Generator(device).manual_seed(seed)
    nn_probs, nn = timed(
        lambda: la(xh, pred_type="nn", link_approx="mc", n_samples=n_samples, generator=generator),
        device,
    )
    thetas, draw = timed(lambda: la.sample(n_samples, generator=generator), device)
    for name, tensor in (("glm", probs), ("nn", nn_probs), ("sample", thetas)):
        if tensor.device.type != device.type:
            raise RuntimeError(f"{name} result is on {tensor.device}, not on {device}.")
    return {"glm": glm, "nn": nn, "sample": draw}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    smiles = load_smiles(args.data, limit=args.n_train + args.n_predict)
    train_smiles, heldout = smiles[: args.n_train], smiles[args.n_train :]
    if args.checkpoint is not None:
        model, tokenizer, _ = load_language_model(args.checkpoint)
        source = f"checkpoint {args.checkpoint}"
    else:
        tokenizer = SmilesTokenizer().fit(smiles)
        sizes = (32, 32, 1) if args.quick else (256, 256, 3)
        model = SmilesLSTM(tokenizer.vocab_size, *sizes)
        x, y = encode_batch(tokenizer, train_smiles)
        train_lm(model, x, y, steps=args.train_steps, generator=torch.Generator().manual_seed(0))
        source = f"{args.train_steps} Adam steps"
    x, y = encode_batch(tokenizer, train_smiles)
    heldout = encodable(tokenizer, heldout, x.shape[1])
    xh, _ = encode_batch(tokenizer, heldout, x.shape[1])
    train_loader = length_sorted_loader(x, y, args.batch_size)
    model = model.to(device)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=args.k,
        solver=args.solver,
        block_size=args.block_size,
        tol=args.tol,
        maxiter=args.maxiter,
        subsample_size=min(args.subsample, len(train_smiles)),
        seed=args.seed,
        ignore_index=PAD,
        progress_bar=args.progress_bar,
        loss_scaling="mean",  # the settings the reported timings were measured with
        complement="zero",
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    memory_before = peak_memory_mb(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        _, fit_time = timed(lambda: la.fit(train_loader), device)
    info = la.lanczos_info
    if la.eigenvectors.device.type != device.type:
        raise RuntimeError(f"eigenvectors on {la.eigenvectors.device}, not on {device}.")
    fit_memory = peak_memory_mb(device)
    timings = predictive_timings(la, xh, device, args.n_samples, args.seed)
    rows = [
        ("fit (loss pass + eigen-solve)", fit_time, None),
        ("  eigen-solve", info.wall_time, None),
        ("  per GGN product", info.wall_time / info.n_products, None),
    ]
    reference = {}
    if args.cpu_reference:
        la_cpu = Laplace(
            model.cpu(),
            "classification",
            subset_of_weights="all",
            hessian_structure="glas",
            n_components=args.k,
            ignore_index=PAD,
            loss_scaling="mean",
            complement="zero",
        )
        la_cpu.load_state_dict({k: _to_cpu(v) for k, v in la.state_dict().items()})
        reference = predictive_timings(la_cpu, xh, torch.device("cpu"), args.n_samples, args.seed)
        model.to(device)
    for name in ("glm", "nn", "sample"):
        label = {
            "glm": f"'glm' predictive, {len(xh)} SMILES",
            "nn": f"'nn' predictive, {len(xh)} SMILES x {args.n_samples} samples",
            "sample": f"sample({args.n_samples})",
        }[name]
        rows.append((label, timings[name], reference.get(name)))

    n_subsample = min(args.subsample, len(train_smiles))
    print(f"# GLAS on the SMILES LSTM on {device}")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    print(f"Machine: {machine_description()}")
    print(
        f"Model: D = {model.n_params:,} ({source}); k = {info.k}, solver {args.solver} "
        f"(tol {args.tol:g}, block size {args.block_size or max(args.k, 8)}), "
        f"{info.n_data} tokens of {n_subsample} subsampled SMILES; "
        f"{info.n_products} GGN products in {info.n_passes} data passes; "
        f"max rel. residual {float(info.residuals.max()):.2e}; eigenvalues "
        f"{float(info.values[0]):.5g} ... {float(info.values[-1]):.5g}; "
        f"peak memory after fit {fit_memory:.0f} MB (before {memory_before:.0f} MB; "
        f"{'CUDA allocated' if device.type == 'cuda' else 'RSS'})"
    )
    print(f"Command: python {' '.join(sys.argv)}\n")
    print(f"| step | {device.type} [s] | CPU reference [s] | CPU / {device.type} |")
    print("|---|---|---|---|")
    for label, seconds, cpu in rows:
        ratio = f"{cpu / seconds:.1f}" if cpu else "–"
        print(f"| {label} | {seconds:.3g} | {f'{cpu:.3g}' if cpu else '–'} | {ratio} |")
    print(f"\npeak memory of the run: {peak_memory_mb(device):.0f} MB")


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_to_cpu(v) for v in value)
    return value


if __name__ == "__main__":
    main()
