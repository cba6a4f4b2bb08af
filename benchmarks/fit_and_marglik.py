"""GLAS fit cost vs k and prior-precision tuning vs FullLaplace, side by side (D = 2701).

Trains the paper's 1-50-50-1 tanh MLP on the known-noise regression (N points), then
in one run:

* GLAS ``fit`` for k in ``--ks``: wall time, GGN products, Lanczos wall time;
* ``optimize_prior_precision(method='marglik')`` of GLAS (closed form, 1-D) and of
  laplace-torch's FullLaplace (GGN backend, Adam on the log marginal likelihood with
  a D x D log-determinant per step), each from prior precision 1;
* the ratio of the two tuning times.

Prints a Markdown table and the machine/threads used.
"""

from __future__ import annotations

# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split
import argparse
import time
import warnings

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.data import known_noise_regression, make_mlp, train_map


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 10, 50])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="GLAS marglik repeats")
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_description()}")
    g = torch.Generator().manual_seed(0)
    X, y = known_noise_regression(args.n, noise=0.1, generator=g)
    model = make_mlp([1, 50, 50, 1], seed=0)
    train_map(model, X, y, steps=2000, lr=1e-2, generator=g)
    dl = DataLoader(TensorDataset(X, y), batch_size=500)
    D = sum(p.numel() for p in model.parameters())

    print(f"\n### GLAS fit, D = {D}, N = {args.n}\n")
    print("| k | fit [s] | Lanczos [s] | GGN products | lambda_1 | max rel. residual |")
    print("|---|---|---|---|---|---|")
    la = None
    for k in args.ks:
        la = Laplace(
            model,
            "regression",
            subset_of_weights="all",
            hessian_structure="glas",
            sigma_noise=0.1,
            n_components=k,
            complement="zero",  # the eigen-solve alone
        )
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
            la.fit(dl)
        fit_time = time.perf_counter() - start
        info = la.lanczos_info
        converged = info.residuals[~info.below_threshold]
        print(
            f"| {k} | {fit_time:.2f} | {info.wall_time:.2f} | {info.n_products} | "
            f"{float(la.eigenvalues[0]):.4g} | {float(converged.max()):.1e} |"
        )

    # the evidence comparison needs the same posterior: standard (summed-loss) scaling
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=0.1,
        n_components=max(args.ks),
        loss_scaling="sum",
        complement="zero",  # the subspace's closed-form evidence
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        la.fit(dl)
    print("\n### optimize_prior_precision(method='marglik'), same model, summed-loss scaling\n")
    times = []
    for _ in range(args.repeats):
        la.prior_precision = 1.0
        start = time.perf_counter()
        la.optimize_prior_precision(method="marglik")
        times.append(time.perf_counter() - start)
    glas_time = min(times)
    print("| method | time [s] | prior precision | log marglik |")
    print("|---|---|---|---|")
    print(
        f"| GLAS k={la.n_components} (closed form) | {glas_time:.2e} | "
        f"{float(la.prior_precision):.4g} | {float(la.log_marginal_likelihood()):.2f} |"
    )
    if not args.skip_full:
        full = Laplace(
            model, "regression", subset_of_weights="all", hessian_structure="full", sigma_noise=0.1
        )
        start = time.perf_counter()
        full.fit(dl)
        full_fit = time.perf_counter() - start
        start = time.perf_counter()
        full.optimize_prior_precision(method="marglik")
        full_time = time.perf_counter() - start
        print(
            f"| FullLaplace (Adam, 100 steps) | {full_time:.2f} | "
            f"{float(full.prior_precision):.4g} | {float(full.log_marginal_likelihood()):.2f} |"
        )
        print(
            f"\nFullLaplace fit: {full_fit:.2f} s. Tuning ratio Full/GLAS: "
            f"{full_time / glas_time:.0f}x"
        )


if __name__ == "__main__":
    main()
