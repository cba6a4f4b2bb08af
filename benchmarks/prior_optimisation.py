"""Cost of a layerwise-prior marglik optimisation: GLAS (k = 20) next to KronLaplace.

Trains a ``10-w-w-1`` tanh MLP (``w = 300``: D = 93,901) briefly on the synthetic
regression ``y = sin(2 a . x) + 0.1 eps``, ``x ~ N(0, I_10)`` (N = 2,000), fits GLAS
(``loss_scaling='sum'``, the standard posterior KronLaplace also approximates) and
KronLaplace, and times, in one run:

* ``fit`` of each;
* ``optimize_prior_precision(method='marglik', prior_structure='layerwise')``:
  laplace-torch's Adam on the log prior precisions (``--steps`` steps, lr 0.1) for
  both; GLAS's evidence costs ``O(k^2 D)`` per step (the ``k x k`` capacitance matrix
  ``I + diag(sqrt a) U^T P_0^{-1} U diag(sqrt a)``), KronLaplace's an eigen-decomposition
  of every Kronecker factor;
* GLAS's scalar closed-form optimum, for reference.

Prints a Markdown table with the ratio Kron / GLAS, the optimised layerwise
precisions and the machine. One run: on a shared machine the times are noisy.
"""

from __future__ import annotations

# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split

# The environment the caller runs in is measured (OpenMP's default wait policy and
# thread counts unless set): machine_description reports it. A tuned setting
# (OMP_WAIT_POLICY=PASSIVE) is the caller's, measured beside the default, never instead.

import argparse
import math
import time
import warnings

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.data import make_mlp, train_map

D_IN = 10
SIGMA = 0.1


def make_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ~ N(0, I_10)``, ``y = sin(2 a . x) + 0.1 eps`` (as ``benchmarks/scaling.py``)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D_IN, generator=g)
    a = torch.randn(D_IN, generator=torch.Generator().manual_seed(123)) / math.sqrt(D_IN)
    y = torch.sin(2 * X @ a).unsqueeze(1) + SIGMA * torch.randn(n, 1, generator=g)
    return X, y


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--width", type=int, default=300)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100, help="Adam steps of the marglik")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="width 20, N 200, 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.n, args.width, args.k, args.steps, args.train_steps = 200, 20, 5, 10, 20
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_description()}")

    X, y = make_data(args.n)
    model = make_mlp([D_IN, args.width, args.width, 1], seed=0)
    g = torch.Generator().manual_seed(1)
    train_map(model, X, y, steps=args.train_steps, lr=1e-3, batch_size=256, generator=g)
    dl = DataLoader(TensorDataset(X, y), batch_size=256)
    D = sum(p.numel() for p in model.parameters())
    print(f"\n### Layerwise-prior marglik optimisation, D = {D:,}, N = {args.n}, k = {args.k}\n")

    glas = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=SIGMA,
        n_components=args.k,
        loss_scaling="sum",
        complement="zero",  # the subspace's closed-form evidence, as reported
    )
    kron = Laplace(
        model, "regression", subset_of_weights="all", hessian_structure="kron", sigma_noise=SIGMA
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", laplace_glas.NumericalRankWarning)
        fit_glas = timed(lambda: glas.fit(dl))
    fit_kron = timed(lambda: kron.fit(dl))

    def layerwise(la) -> None:
        la.optimize_prior_precision(
            method="marglik", prior_structure="layerwise", n_steps=args.steps, lr=0.1
        )

    opt_glas = timed(lambda: layerwise(glas))
    opt_kron = timed(lambda: layerwise(kron))
    prior_glas, prior_kron = glas.prior_precision.clone(), kron.prior_precision.clone()
    evidence_glas = float(glas.log_marginal_likelihood())
    evidence_kron = float(kron.log_marginal_likelihood())
    glas.prior_precision = 1.0
    scalar_glas = timed(lambda: glas.optimize_prior_precision(method="marglik"))

    print(f"| step | GLAS k={args.k} [s] | KronLaplace [s] | Kron / GLAS |")
    print("|---|---|---|---|")
    print(f"| fit | {fit_glas:.2f} | {fit_kron:.2f} | {fit_kron / fit_glas:.2f} |")
    print(
        f"| marglik, layerwise ({args.steps} Adam steps) | {opt_glas:.3f} | {opt_kron:.3f} | "
        f"{opt_kron / opt_glas:.2f} |"
    )
    print(
        f"| per Adam step | {opt_glas / args.steps * 1e3:.2f} ms | "
        f"{opt_kron / args.steps * 1e3:.2f} ms | |"
    )
    print(f"| GLAS marglik, scalar (closed form) | {scalar_glas:.2e} | – | |")
    fmt = ", ".join
    print(f"\nGLAS layerwise prior precisions: {fmt(f'{v:.3g}' for v in prior_glas.tolist())}")
    print(f"Kron layerwise prior precisions: {fmt(f'{v:.3g}' for v in prior_kron.tolist())}")
    print(f"log marglik after the optimisation: GLAS {evidence_glas:.1f}, Kron {evidence_kron:.1f}")
    print("One run on a shared machine: times are noisy.")


if __name__ == "__main__":
    main()
