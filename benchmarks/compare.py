"""GLAS vs laplace-torch's posteriors on UCI Concrete: one table, measured in one run.

Trains an MLP on the standardised UCI Concrete data (70% train, 15% calibration, 15%
test), then runs :func:`laplace_glas.applications.compare.compare_structures`: GLAS with mean-loss
and summed-loss scaling (k chosen by 90% f-coverage on the calibration split), and
laplace-torch's ('all', 'kron'), ('all', 'diag'), ('all', 'full') (if D <=
--full-max-params), ('last_layer', 'kron'), ('last_layer', 'full') and ELLA, all built
by the same ``Laplace(...)`` factory, each prior precision tuned by its own marglik.
sigma is a plug-in estimate, the same for every structure: the MAP's RMSE on the
calibration split (``--sigma-from calib``, the default, as in ``examples/concrete.py``)
or its training RMSE (``--sigma-from train``, the paper's choice; far too small when the
MAP overfits, which favours GLAS, the only structure that looks at the calibration split
to set its width).

Prints the machine, the threads, the command and the Markdown table.
"""

from __future__ import annotations

import laplace_glas  # noqa: F401 (first: registers 'glas', imports laplace-torch quietly)

# isort: split

# The environment the caller runs in is measured (OpenMP's default wait policy and
# thread counts unless set): machine_description reports it. A tuned setting
# (OMP_WAIT_POLICY=PASSIVE) is the caller's, measured beside the default, never instead.

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from machine import machine_description  # benchmarks/machine.py
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.compare import compare_structures, default_structures, format_table
from laplace_glas.applications.data import concrete_splits, make_mlp, train_map

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/concrete/Concrete_Data.csv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Concrete_Data.csv")
    parser.add_argument("--quick", action="store_true", help="small MLP, k <= 10 (~1 min)")
    parser.add_argument("--width", type=int, default=None, help="hidden width [50; quick 16]")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps [3000; quick 500]")
    parser.add_argument("--k-max", type=int, default=None, help="GLAS k_max [50; quick 10]")
    parser.add_argument("--level", type=float, default=0.9, help="nominal coverage")
    parser.add_argument("--full-max-params", type=int, default=5000)
    parser.add_argument("--n-predict", type=int, default=1000, help="inputs timed (tiled test)")
    parser.add_argument("--predict-batch", type=int, default=100, help="inputs per call")
    parser.add_argument("--sigma-from", choices=("train", "calib"), default="calib")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.width = args.width or (16 if args.quick else 50)
    args.steps = args.steps or (500 if args.quick else 3000)
    args.k_max = args.k_max or (10 if args.quick else 50)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_description()}")
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    generator = torch.Generator().manual_seed(args.seed)

    (Xtr, ytr), (Xc, yc), (Xte, yte) = concrete_splits(args.data, generator)
    widths = [Xtr.shape[1], *([args.width] * args.depth), 1]
    model = make_mlp(widths, seed=args.seed)
    start = time.perf_counter()
    train_map(model, Xtr, ytr, steps=args.steps, lr=3e-3, weight_decay=1e-4, generator=generator)
    with torch.no_grad():
        rmse = {
            name: float((model(X_) - y_).square().mean().sqrt())
            for name, X_, y_ in (("train", Xtr, ytr), ("calib", Xc, yc), ("test", Xte, yte))
        }
    sigma = rmse[args.sigma_from]
    D = sum(p.numel() for p in model.parameters())
    print(
        f"data: {len(Xtr) + len(Xc) + len(Xte)} rows; train {len(Xtr)}, "
        f"calibration {len(Xc)}, test {len(Xte)} "
        f"(standardised)\nmodel: tanh MLP {widths}, D = {D}, MAP in "
        f"{time.perf_counter() - start:.1f} s; RMSE train {rmse['train']:.3f}, calibration "
        f"{rmse['calib']:.3f}, test {rmse['test']:.3f}; sigma = {args.sigma_from} RMSE = "
        f"{sigma:.3f}"
    )

    def loader(X_: torch.Tensor, y_: torch.Tensor) -> DataLoader:
        return DataLoader(TensorDataset(X_, y_), batch_size=256)

    structures = default_structures(
        glas_k_max=args.k_max,
        full_max_params=args.full_max_params,
        ella_subsample_size=min(500, len(Xtr)),
        ella_n_eigenvalues=20,
    )
    start = time.perf_counter()
    rows = compare_structures(
        model,
        "regression",
        loader(Xtr, ytr),
        loader(Xc, yc),
        loader(Xte, yte),
        structures=structures,
        sigma_noise=sigma,
        coverage=args.level,
        pred_type="glm",
        n_predict_timing=args.n_predict,
        predict_batch_size=args.predict_batch,
        progress=True,
    )
    print(
        f"\ntotal {time.perf_counter() - start:.0f} s; predictive timed on {args.n_predict} "
        f"inputs in calls of {args.predict_batch}\n"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
