"""Pool-based active learning on UCI Concrete: acquire by GLAS variance, by KronLaplace
variance, or at random.

Per seed the 1030 rows are split into a pool (80%) and a test set (20%); inputs are
standardised with the pool's statistics (unlabelled inputs are known), targets with
those of the first labelled batch. Every strategy starts from the same ``--start``
(50) random labelled pool rows and, each round, refits the MAP from scratch on the
labelled rows (Adam on the mean MSE, same initial weights), fits GLAS (``k = --k``,
mean-loss scaling, prior precision by its closed-form evidence maximisation, sigma =
the MAP's RMSE on the labelled rows) and then labels ``--batch`` (10) more pool rows:

* ``glas``: the largest 'glm' variances ``sum_j v_j (J(x) u_j)^2`` of GLAS;
* ``kron``: the largest 'glm' variances of laplace-torch's KronLaplace (all weights,
  prior precision by marginal likelihood), fitted on the same MAP;
* ``random``: uniformly at random.

Reported against the number of labels, averaged over ``--seeds``: the MAP's test RMSE
(standardised units) and the coverage of GLAS's central 90% interval of ``y`` (``f``'s
'glm' variance plus sigma^2) on the test set, for every strategy (the strategies differ
only in the rows they labelled). ``--out`` saves one figure with both curves.

Data: ``--data PATH`` (default ``../shared/data/concrete/Concrete_Data.csv`` beside the
repository); the public source is the UCI ML repository, data set 165 (CC BY 4.0).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

from _cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/concrete/Concrete_Data.csv"
STRATEGIES = ("glas", "kron", "random")
Z90 = 1.6448536269514722  # standard normal quantile of 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=HelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Concrete_Data.csv")
    parser.add_argument("--quick", action="store_true", help="1 seed, up to 70 labels, small MLP")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (3; 1 --quick)")
    parser.add_argument("--start", type=int, default=50, help="initial labelled rows")
    parser.add_argument("--batch", type=int, default=10, help="rows labelled per round")
    parser.add_argument(
        "--max-labels", type=int, default=None, help="stop at this many labels (300; 70 --quick)"
    )
    parser.add_argument("--k", type=int, default=10, help="GLAS subspace dimension")
    parser.add_argument("--width", type=int, default=None, help="hidden width (50; 16 --quick)")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps (1000; 200 --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None, help="folder for the figure")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.max_labels = args.max_labels or (70 if args.quick else 300)
    args.width = args.width or (16 if args.quick else 50)
    args.steps = args.steps or (200 if args.quick else 1000)
    if args.start < 2 or args.batch < 1 or args.max_labels < args.start:
        parser.error("need --start >= 2, --batch >= 1 and --max-labels >= --start")
    return args


if __name__ == "__main__":
    parse_args()  # --help and argument errors answer before torch and laplace load


# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas

# isort: split
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.cli import run_example
from laplace_glas.applications.data import load_concrete, make_mlp, split, train_map


def glas_posterior(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, k: int, sigma: float):
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=sigma,
        n_components=k,
        loss_scaling="mean",  # GLAS's mean-loss subspace posterior (not the defaults)
        complement="zero",
    )
    la.fit(DataLoader(TensorDataset(X, y), batch_size=len(X)))
    la.optimize_prior_precision()
    return la


def kron_variance(model, X, y, sigma, X_pool) -> torch.Tensor:
    la = Laplace(model, "regression", "all", "kron", sigma_noise=sigma)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=len(X)))
    la.optimize_prior_precision(method="marglik", pred_type="glm")
    return la(X_pool, pred_type="glm")[1].reshape(len(X_pool)).detach()


def run_strategy(strategy: str, data: dict, labelled: torch.Tensor, seed: int, args) -> list:
    """``[(n_labels, test RMSE, test coverage)]`` for one strategy and seed."""
    X_pool, y_pool, X_test, y_test = data["X_pool"], data["y_pool"], data["X_test"], data["y_test"]
    generator = torch.Generator().manual_seed(1000 + seed)
    labelled = labelled.clone()
    curve = []
    while True:
        X, y = X_pool[labelled], y_pool[labelled]
        model = make_mlp([X.shape[1], args.width, args.width, 1], seed=seed)
        train_map(model, X, y, steps=args.steps, lr=3e-3, weight_decay=1e-4)
        with torch.no_grad():
            sigma = float((model(X) - y).square().mean().sqrt())
            rmse = float((model(X_test) - y_test).square().mean().sqrt())
        la = glas_posterior(model, X, y, min(args.k, len(X) - 1), sigma)
        f_mu, f_var = la(X_test, pred_type="glm")
        half = Z90 * (f_var.reshape(-1, 1) + sigma**2).sqrt()
        covered = float(((y_test - f_mu).abs() <= half).double().mean())
        curve.append((len(labelled), rmse, covered))
        if len(labelled) >= args.max_labels:
            return curve
        mask = torch.ones(len(X_pool), dtype=torch.bool)
        mask[labelled] = False
        candidates = mask.nonzero().reshape(-1)
        n_new = min(args.batch, args.max_labels - len(labelled), len(candidates))
        if strategy == "random":
            pick = candidates[torch.randperm(len(candidates), generator=generator)[:n_new]]
        else:
            if strategy == "glas":
                score = la(X_pool[candidates], pred_type="glm")[1].reshape(-1)
            else:
                score = kron_variance(model, X, y, sigma, X_pool[candidates])
            pick = candidates[score.topk(n_new).indices]
        labelled = torch.cat([labelled, pick])


def seed_data(path: Path, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    X, y = load_concrete(path)
    (X_pool, y_pool), (X_test, y_test) = split(X, y, (0.8, 0.2), generator=generator)
    mean, std = X_pool.mean(0), X_pool.std(0)
    return {
        "X_pool": (X_pool - mean) / std,
        "y_pool": y_pool,
        "X_test": (X_test - mean) / std,
        "y_test": y_test,
        "generator": generator,
    }


def plot_curves(results: dict, path: Path | None) -> Any:
    from laplace_glas.plotting import _finish, _legend_below, _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    n_seeds, lowest = 0, 0.9
    for strategy, curves in results.items():
        stacked = torch.tensor(curves, dtype=torch.float64)  # (seeds, rounds, 3)
        n, n_seeds = stacked[0, :, 0].numpy(), stacked.shape[0]
        for ax, col in zip(axes, (1, 2)):
            mean, std = stacked[:, :, col].mean(0), stacked[:, :, col].std(0, correction=0)
            ax.plot(n, mean.numpy(), label=strategy)
            if n_seeds > 1:  # no band from one seed
                ax.fill_between(n, (mean - std).numpy(), (mean + std).numpy(), alpha=0.2)
            if col == 2:
                lowest = min(lowest, float((mean - std).min()))
    axes[0].set_ylabel("test RMSE (standardised)")
    axes[1].set_ylabel("coverage of GLAS's 90% interval of y")
    axes[1].axhline(0.9, color="k", ls="--", lw=1, label="nominal 90%")
    axes[1].set_ylim(max(lowest - 0.05, 0.0), 1.02)  # the 90% line inside the frame
    for ax in axes:
        ax.set_xlabel("number of labels")
        ax.grid(True, alpha=0.3)
        _legend_below(ax)
    spread = "one seed" if n_seeds == 1 else f"mean +- sd over {n_seeds} seeds"
    fig.suptitle(f"Active learning on Concrete ({spread})")
    return _finish(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=laplace_glas.NumericalRankWarning)
    results: dict[str, list] = {s: [] for s in STRATEGIES}
    start = time.perf_counter()
    for seed in range(args.seeds):
        data = seed_data(args.data, seed)
        first = torch.randperm(len(data["X_pool"]), generator=data["generator"])[: args.start]
        y0 = data["y_pool"][first]
        for key in ("y_pool", "y_test"):  # targets standardised with the first labels
            data[key] = (data[key] - y0.mean()) / y0.std()
        for strategy in STRATEGIES:
            results[strategy].append(run_strategy(strategy, data, first, seed, args))
        print(f"seed {seed} done, {time.perf_counter() - start:.0f} s")
    n_labels = [n for n, _, _ in results["random"][0]]
    marks = [n for n in (100, 200, 300) if n in n_labels] or [n_labels[-1]]
    print(f"\n## Test RMSE and 90% coverage, mean over {args.seeds} seed(s)\n")
    print("| strategy | " + " | ".join(f"RMSE @ {n}" for n in marks) + " | ", end="")
    print(" | ".join(f"coverage @ {n}" for n in marks) + " |")
    print("| --- |" + " ---: |" * (2 * len(marks)))
    for strategy, curves in results.items():
        stacked = torch.tensor(curves, dtype=torch.float64)
        rows = [n_labels.index(n) for n in marks]
        rmse = [f"{float(stacked[:, i, 1].mean()):.3f}" for i in rows]
        cov = [f"{float(stacked[:, i, 2].mean()):.1%}" for i in rows]
        print(f"| {strategy} | " + " | ".join(rmse + cov) + " |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot_curves(results, args.out / "active_learning.png")
        print(f"\nfigure in {args.out / 'active_learning.png'}")


if __name__ == "__main__":
    run_example(main)
