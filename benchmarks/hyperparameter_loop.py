"""laplace-torch's hyperparameter loop on GLAS's default posterior and on KronLaplace.

laplace-torch's README tunes the prior precision and the observation noise by Adam on
the evidence::

    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for i in range(n_epochs):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()

Each step is a few small tensor operations and their backward pass, so on a busy
machine the cost is the threads' wake-ups as much as the arithmetic. This script fits
GLAS (``hessian_structure='glas'``, its defaults: summed loss, ``complement='auto'``,
which takes KFAC's factors here) and ``KronLaplace`` on one problem (a ``1-w-...-1`` tanh
MLP on ``sin(3x)``, N = 200), times ``--steps`` steps of the loop for each in the same
process (the median of ``--repeats`` runs) and prints a table of the times and their
ratio. It runs in the environment it is started in: OpenMP's default policy and torch's
default threads unless the caller sets them; ``--busy n`` starts ``n`` CPU-bound
processes beside it for the run (the loaded machine a notebook user often has).
"""

from __future__ import annotations

# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas  # noqa: F401

# isort: split
import argparse
import itertools
import multiprocessing as mp
import statistics
import time
import warnings

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _spin(stop) -> None:  # a CPU-bound neighbour
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


def _problem(widths: list[int]) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    X = torch.linspace(-2, 2, 200).reshape(-1, 1)
    y = torch.sin(3 * X) + 0.1 * torch.randn_like(X)
    return model, DataLoader(TensorDataset(X, y), batch_size=50)


def loop_seconds(la, steps: int) -> float:
    """Wall time of ``steps`` steps of laplace-torch's README loop on ``la``."""
    log_prior = torch.ones(1, requires_grad=True)
    log_sigma = torch.ones(1, requires_grad=True)
    optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        optimizer.step()
    return time.perf_counter() - start


def measure(widths: list[int], steps: int, repeats: int) -> dict[str, float]:
    """Median loop time of GLAS's default and of KronLaplace on one problem."""
    times = {}
    for structure in ("kron", "glas"):
        model, loader = _problem(widths)
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure)
        la.fit(loader)
        loop_seconds(la, 2)  # warm-up (the first step builds what later ones reuse)
        times[structure] = statistics.median(loop_seconds(la, steps) for _ in range(repeats))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside it")
    parser.add_argument("--quick", action="store_true", help="10 steps, 1 repeat")
    args = parser.parse_args(argv)
    steps, repeats = (10, 1) if args.quick else (args.steps, args.repeats)
    warnings.simplefilter("ignore")
    stop, neighbours = mp.Event(), []
    for _ in range(args.busy):
        neighbours.append(mp.Process(target=_spin, args=(stop,), daemon=True))
        neighbours[-1].start()
    try:
        rows = []
        for widths in ([1, 50, 1], [1, 50, 50, 1]):
            D = sum(a * b + b for a, b in itertools.pairwise(widths))
            t = measure(widths, steps, repeats)
            rows.append(
                f"| {D:,} | {t['kron']:.3f} | {t['glas']:.3f} | {t['glas'] / t['kron']:.2f}x |"
            )
    finally:
        stop.set()
        for process in neighbours:
            process.join()
    print("# laplace-torch's hyperparameter loop: GLAS default against KronLaplace\n")
    print(f"machine: {machine_description()}; {args.busy} CPU-bound processes beside it\n")
    print(f"{steps} Adam steps on (prior precision, sigma), median of {repeats} runs\n")
    print("| D | KronLaplace [s] | GLAS default [s] | GLAS / Kron |")
    print("| ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
