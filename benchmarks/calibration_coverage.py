"""Held-out coverage after ``la.calibrate(coverage=c)``, for both routes and both kinds of
interval.

On ``y = sin(3x) + 0.2 eps``, ``x ~ U(-2, 2)`` (300 training, 1,000 calibration and
2,000 test points; a float64 1-32-32-1 tanh MLP trained by 2,000 full-batch Adam steps on
the mean squared error), a GLAS posterior with ``n_components=10`` and the known
``sigma_noise=0.2`` is fitted afresh for each nominal level ``c`` and calibrated on the
calibration points (``calibrate``'s default: the prior precision tuned for each k, k by
its rule); the table gives the coverage of its central ``c`` intervals on the test
points:

* ``y vs y``: intervals of y (with the noise) against the observed targets (the
  default, ``include_noise=True``);
* ``f vs f``: intervals of f against the true ``sin(3x)`` (``include_noise=False``).

Routes: the default posterior (``loss_scaling='sum'``, ``complement='auto'``, which
resolves to ``'kron'`` here) and GLAS's own (``loss_scaling='mean',
complement='zero'``). ``--quick`` (one seed, 100 / 300 / 300 points, nominal 0.9
only) is a smoke test of seconds. Example::

    python benchmarks/calibration_coverage.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_glas  # noqa: F401  (registers hessian_structure='glas')
from laplace_glas.diagnostics.calibration import coverage

LEVELS = (0.5, 0.68, 0.8, 0.9, 0.95)
ROUTES = {
    "default (sum, auto)": {},
    "mean, zero": {"loss_scaling": "mean", "complement": "zero"},
}
SIGMA = 0.2


def sine(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, f, y)``: inputs, the true function and noisy observations."""
    X = torch.rand(n, 1, generator=g, dtype=torch.float64) * 4 - 2
    f = torch.sin(3 * X)
    return X, f, f + SIGMA * torch.randn(n, 1, generator=g, dtype=torch.float64)


def loader(X: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(X, y), batch_size=250)


def run_seed(
    seed: int, levels: tuple[float, ...], sizes: tuple[int, int, int]
) -> dict[tuple[str, str], list[tuple[float, int]]]:
    """``{(route, mode): [(held-out coverage, k) per level]}`` at one seed, with
    ``sizes`` training, calibration and test points.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    (Xtr, _, ytr), (Xc, fc, yc), (Xt, ft, yt) = (sine(n, g) for n in sizes)
    model = nn.Sequential(
        nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    ).double()
    optimiser = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(2000):
        optimiser.zero_grad()
        (model(Xtr) - ytr).square().mean().backward()
        optimiser.step()
    out = {}
    for route, kwargs in ROUTES.items():
        for mode, noise, (calib, test) in (("y vs y", True, (yc, yt)), ("f vs f", False, (fc, ft))):
            cells = []
            for level in levels:
                la = Laplace(model, "regression", subset_of_weights="all",
                             hessian_structure="glas", sigma_noise=SIGMA, n_components=10,
                             **kwargs)  # fmt: skip
                la.fit(loader(Xtr, ytr))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    selection = la.calibrate(loader(Xc, calib), coverage=level,
                                             include_noise=noise)  # fmt: skip
                held_out = coverage(la, loader(Xt, test), level=level, include_noise=noise)
                cells.append((held_out, selection.k))
            out[(route, mode)] = cells
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="[0 1 2; quick 0]")
    parser.add_argument("--quick", action="store_true", help="1 seed, fewer points, 0.9")
    args = parser.parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    levels = (0.9,) if args.quick else LEVELS
    sizes = (100, 300, 300) if args.quick else (300, 1000, 2000)
    start = time.perf_counter()
    runs = []
    for seed in seeds:
        runs.append(run_seed(seed, levels, sizes))
        print(f"seed {seed} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: python benchmarks/calibration_coverage.py {shown}".rstrip())
    print(f"date: {time.strftime('%-d %B %Y, %H:%M UTC', time.gmtime())}\n")
    print("| route | intervals | " + " | ".join(f"nominal {c}" for c in levels) + " |")
    print("| --- | --- |" + " ---: |" * len(levels))
    for route, mode in runs[0]:
        cells = []
        for i in range(len(levels)):
            values = [run[(route, mode)][i][0] for run in runs]
            ks = ",".join(str(run[(route, mode)][i][1]) for run in runs)
            spread = f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""
            cells.append(f"{statistics.fmean(values):.3f}{spread} k={ks}")
        print(f"| {route} | {mode} | " + " | ".join(cells) + " |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
