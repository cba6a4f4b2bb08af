"""Data-parallel GLAS fit on torch.distributed: every rank holds a shard of UCI Concrete.

Launch with one process per shard, e.g. two on this machine (gloo, CPU):

    torchrun --nproc_per_node=2 examples/distributed_fit.py
    python examples/distributed_fit.py            # the single-process reference

Rank 0 trains the MAP (a tanh MLP on the standardised training split) and broadcasts
its weights; each rank then takes a contiguous shard of the training and calibration
splits (``torch.tensor_split``; ``DistributedSampler`` would pad uneven shards with
repeated points and so count them twice). ``la.fit`` sums the loss, ``N`` and every
GGN product over the ranks with ``all_reduce``; ``optimize_prior_precision`` and the
evidence need no communication; ``la.calibrate`` all-reduces the coverage counts. Rank
0 prints the eigenvalues, the evidence, the selected k, the fit's wall time and the
bytes all-reduced: one ``(D, m)`` all-reduce per data pass, ``m = 1`` for Lanczos and
``block_size`` for the block solver. The printed numbers equal a single-process run
(float64 by default, so that the printed digits agree; in float32 the summation order
of the shards changes the last ~1e-6).

Data: ``--data PATH`` (default ``../shared/data/concrete/Concrete_Data.csv`` beside the
repository); the public source is the UCI ML repository, data set 165 (CC BY 4.0).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

from _cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/concrete/Concrete_Data.csv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=HelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Concrete_Data.csv")
    parser.add_argument("--quick", action="store_true", help="small model, k = 8 (seconds)")
    parser.add_argument("--width", type=int, default=None, help="hidden width (50; 16 quick)")
    parser.add_argument("--k", type=int, default=None, help="n_components (20; 8 quick)")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps (2000; 300 quick)")
    parser.add_argument(
        "--solver", choices=("auto", "lanczos", "block"), default="lanczos", help="eigen-solver"
    )
    parser.add_argument("--block-size", type=int, default=None, help="block solver's columns")
    parser.add_argument(
        "--dtype", choices=("float32", "float64"), default="float64", help="precision"
    )
    parser.add_argument("--level", type=float, default=0.9, help="nominal coverage")
    parser.add_argument("--seed", type=int, default=0, help="seed of split, model and solve")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    args.width = args.width or (16 if args.quick else 50)
    args.k = args.k or (8 if args.quick else 20)
    args.steps = args.steps or (300 if args.quick else 2000)
    return args


if __name__ == "__main__":
    parse_args()  # --help and argument errors answer before torch and laplace load


# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas  # noqa: F401

# isort: split
import torch
import torch.distributed as dist
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas import CoverageNotReachedWarning
from laplace_glas.applications.cli import run_example
from laplace_glas.applications.data import concrete_splits, make_mlp, train_map

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def shard(X: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> DataLoader:
    """This rank's contiguous part of ``(X, y)`` (sizes differ by at most one)."""
    index = torch.tensor_split(torch.arange(len(X)), world)[rank]
    return DataLoader(TensorDataset(X[index], y[index]), batch_size=128)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # torchrun's environment: MASTER_ADDR, RANK, ...
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    dtype = _DTYPES[args.dtype]
    try:
        generator = torch.Generator().manual_seed(args.seed)
        (X, y), (Xc, yc), _ = concrete_splits(args.data, generator=generator)
        X, y, Xc, yc = (t.to(dtype) for t in (X, y, Xc, yc))
        model = make_mlp([X.shape[1], args.width, args.width, 1], dtype=dtype, seed=args.seed)
        if rank == 0:
            train_map(model, X, y, steps=args.steps, generator=generator)
        if distributed:
            for p in model.parameters():  # every rank linearises at rank 0's MAP
                dist.broadcast(p.data, src=0)
        model.eval()
        with torch.no_grad():
            sigma = float((model(Xc) - yc).square().mean().sqrt())  # plug-in noise
        la = Laplace(
            model,
            "regression",
            subset_of_weights="all",
            hessian_structure="glas",
            sigma_noise=sigma,
            n_components=args.k,
            solver=args.solver,
            block_size=args.block_size,
            seed=args.seed,
            loss_scaling="mean",  # GLAS's route: mean scaling, calibrated by coverage
            complement="zero",
        )
        start = time.perf_counter()
        la.fit(shard(X, y, rank, world))
        fit_time = time.perf_counter() - start
        la.optimize_prior_precision()
        evidence = float(la.log_marginal_likelihood())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CoverageNotReachedWarning)
            selection = la.calibrate(shard(Xc, yc, rank, world), coverage=args.level)
        info = la.lanczos_info
        columns = 1 if info.solver == "lanczos" else info.n_products // max(info.n_passes, 1)
        itemsize = torch.finfo(dtype).bits // 8
        result = {
            "world": world,
            "N": la.n_data,
            "D": la.n_params,
            "eigenvalues": info.values / sigma**2,
            "prior_precision": float(la.prior_precision),
            "evidence": evidence,
            "k": selection.k,
            "coverage": selection.coverage,
            "fit_time": fit_time,
            "passes": info.n_passes,
            "bytes_per_pass": la.n_params * columns * itemsize if world > 1 else 0,
        }
        if rank == 0:
            report(result, info)
        return result
    finally:
        if distributed:
            dist.destroy_process_group()


def report(result: dict, info) -> None:
    """Print what every rank holds (rank 0 speaks for all)."""
    torch.set_printoptions(precision=10)
    print(f"processes: {result['world']}   N = {result['N']}   D = {result['D']}")
    print(f"solver: {info.solver}   operator: {info.operator}")
    print("eigenvalues of the mean-loss GGN:")
    print("  " + "  ".join(f"{v:.10g}" for v in result["eigenvalues"].tolist()))
    print(f"prior precision (empirical Bayes): {result['prior_precision']:.10g}")
    print(f"log evidence: {result['evidence']:.10g}")
    print(f"selected k: {result['k']} (calibration coverage {result['coverage']:.4f})")
    print(
        f"fit wall time: {result['fit_time']:.3f} s   data passes: {result['passes']}   "
        f"bytes all-reduced per pass: {result['bytes_per_pass']}   "
        f"per fit: {result['bytes_per_pass'] * result['passes']}"
    )


if __name__ == "__main__":
    run_example(main)
