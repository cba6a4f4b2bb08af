"""Known-noise scalar regression: GLAS with mean-loss vs standard (summed) scaling.

The paper's first experiment. A 1-50-50-1 tanh MLP (D = 2701 weights) is trained on
the mean squared error of ``y = sin(3x) + 0.1 eps``, ``x ~ U(-2, 2)``, with the noise
level sigma = 0.1 known. GLAS then puts a Gaussian posterior on the span of the top-k
eigenvectors of the GGN of the mean loss, once with mean-loss ("generalized", s = 1)
and once with the standard Bayesian (summed loss, s = N) scaling. On held-out points
the script reports how often the central 90% predictive interval contains the
observation, for k = 1, 2, 5, 10, 20 and both the linearised ('glm') and the sampled
network ('nn') predictive, like against like:

- interval of f (no observation noise) against the true f = sin(3x): mean-loss scaling
  covers from k = 1 (and over-covers); the standard scaling stays below 90% up to
  k = 20;
- interval of y = f + noise (sigma^2 added) against the observed y: the standard
  scaling covers 90% from k = 1, as the noise dominates; the mean-loss scaling
  over-covers;
- ``la.calibrate(coverage=0.9)`` (the prior precision tuned on the calibration points)
  and the held-out coverage it gives, for both kinds of interval.

Run ``python examples/known_noise_regression.py --help`` for the options; ``--quick``
finishes in seconds (it runs in the test suite).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from statistics import NormalDist

from _cli import HelpFormatter

SIGMA = 0.1  # known observation noise
PRIOR_PRECISION = 1.0
LEVEL = 0.90  # nominal coverage of the central interval
SCALINGS = ("mean", "sum")
PRED_TYPES = ("glm", "nn")
GRID = (-2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "GLAS on the paper's known-noise regression (1-50-50-1 tanh MLP, "
            "y = sin(3x) + 0.1 eps): coverage of 90% intervals vs the number of "
            "directions k, for mean-loss and summed-loss scaling."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="small, fast run (N = 200, k up to 5; a few seconds)"
    )
    parser.add_argument(
        "--n-train",
        type=int,
        default=None,
        help="training points N (default: 2000; 200 with --quick)",
    )
    parser.add_argument(
        "--n-test",
        type=int,
        default=None,
        help="held-out points for each of the calibration and the test set "
        "(default: 1000; 300 with --quick)",
    )
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=None,
        help="numbers of directions to evaluate; GLAS is fitted once with the largest "
        "(default: 1 2 5 10 20; 1 2 5 with --quick)",
    )
    parser.add_argument(
        "--table-k", type=int, default=2, help="k used for the table of intervals on a grid"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="Adam steps of the MAP training (default: 3000; 1500 with --quick)",
    )
    parser.add_argument(
        "--n-samples",
        type=int,
        default=None,
        help="weight samples for the 'nn' predictive (default: 1000; 300 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads: the tensors here are small, and on a 2-core machine "
        "more threads mostly add contention",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for a PNG figure (needs matplotlib; default: no figure)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "n_train": 200 if quick else 2000,
        "n_test": 300 if quick else 1000,
        "k": [1, 2, 5] if quick else [1, 2, 5, 10, 20],
        "steps": 1500 if quick else 3000,
        "n_samples": 300 if quick else 1000,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.k = sorted(set(args.k))
    if args.k[0] < 1:
        parser.error("--k values must be >= 1")
    if args.table_k not in args.k:
        args.table_k = args.k[0] if args.table_k < args.k[0] else max(args.k)
    for name in ("n_train", "n_test", "steps", "n_samples", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


if __name__ == "__main__":
    parse_args()  # --help and argument errors answer before torch and laplace load


# first: registers hessian_structure='glas' and imports laplace-torch quietly
import laplace_glas  # noqa: F401

# isort: split
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.cli import run_example
from laplace_glas.applications.data import known_noise_regression, make_mlp, train_map
from laplace_glas.diagnostics.calibration import coverage


def heading(title: str) -> None:
    print(f"\n== {title} ==")


def fit_glas(model, loader, k_max: int, scaling: str, seed: int):
    """Fit GLAS once with the largest k; warnings are printed as notes."""
    la = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="glas",
        sigma_noise=SIGMA,
        prior_precision=PRIOR_PRECISION,
        n_components=k_max,
        loss_scaling=scaling,
        complement="zero",  # the subspace alone, as in the paper
        generator=torch.Generator().manual_seed(seed),
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.fit(loader)
    elapsed = time.perf_counter() - start
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, FutureWarning)):
            continue  # the libraries' own deprecation notices, not about the fit
        print(f"  note ({scaling} scaling): {w.category.__name__}: {w.message}")
    return la, elapsed


def interval_bounds(la, X: torch.Tensor, pred_type: str, n_samples: int, seed: int):
    """Central LEVEL intervals of f and of y = f + noise at X: four (n,) tensors.

    'glm' is Gaussian: mean +- z sqrt(var) (+ sigma^2 for y). 'nn' uses the empirical
    quantiles of the sampled network outputs (and of the outputs plus noise draws).
    """
    alpha = 1.0 - LEVEL
    if pred_type == "glm":
        mean, var = la(X, pred_type="glm")
        mean, var = mean.reshape(-1), var.reshape(-1)
        z = NormalDist().inv_cdf(1 - alpha / 2)
        half_f, half_y = z * var.sqrt(), z * (var + SIGMA**2).sqrt()
        return mean - half_f, mean + half_f, mean - half_y, mean + half_y
    generator = torch.Generator().manual_seed(seed)
    fs = la.predictive_samples(X, pred_type="nn", n_samples=n_samples, generator=generator)
    fs = fs.reshape(n_samples, -1)
    ys = fs + SIGMA * torch.randn(fs.shape, generator=generator, dtype=fs.dtype)
    probs = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=fs.dtype)
    qf, qy = torch.quantile(fs, probs, dim=0), torch.quantile(ys, probs, dim=0)
    return qf[0], qf[1], qy[0], qy[1]


def coverage_sweep(las, X_cal, y_cal, X_test, y_test, ks, n_samples, seed):
    """Coverage and width of the intervals on the calibration and test sets.

    Returns ``{(scaling, pred, noise, split): {k: (coverage, mean width)}}`` with
    ``noise`` in {'f', 'y'} and ``split`` in {'cal', 'test'}. Like is scored with like:
    intervals of f against the true f = sin(3x), intervals of y against the observed y.
    """
    X = torch.cat([X_cal, X_test])
    targets = {
        ("y", "cal"): y_cal.reshape(-1),
        ("y", "test"): y_test.reshape(-1),
        ("f", "cal"): torch.sin(3 * X_cal).reshape(-1),
        ("f", "test"): torch.sin(3 * X_test).reshape(-1),
    }
    n_cal = X_cal.shape[0]
    results: dict = {}
    for scaling, la in las.items():
        for pred in PRED_TYPES:
            for k in ks:
                la.n_components = k  # truncates the fitted eigenpairs, no refit
                lo_f, hi_f, lo_y, hi_y = interval_bounds(la, X, pred, n_samples, seed + k)
                for noise, lo, hi in (("f", lo_f, hi_f), ("y", lo_y, hi_y)):
                    for name, part in (("cal", slice(0, n_cal)), ("test", slice(n_cal, None))):
                        y = targets[(noise, name)]
                        inside = (y >= lo[part]) & (y <= hi[part])
                        width = (hi[part] - lo[part]).mean()
                        key = (scaling, pred, noise, name)
                        results.setdefault(key, {})[k] = (
                            float(inside.float().mean()),
                            float(width),
                        )
            la.n_components = max(ks)
    return results


def print_coverage_table(results, ks, noise: str, n_test: int) -> None:
    columns = [(s, p) for s in SCALINGS for p in PRED_TYPES]
    header = "   k | " + " | ".join(f"{s + ' / ' + p:>16}" for s, p in columns)
    print(f"  coverage on {n_test} test points (mean interval width in brackets)")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for k in ks:
        cells = []
        for s, p in columns:
            cov, width = results[(s, p, noise, "test")][k]
            cells.append(f"{cov:6.1%} ({width:7.4f})")
        print(f"{k:4d} | " + " | ".join(f"{c:>16}" for c in cells))


def select_k(results, ks) -> None:
    """Smallest k whose calibration coverage reaches LEVEL; its test coverage."""
    print(
        f"  smallest k whose calibration coverage of the interval of f (against the true f) "
        f"is >= {LEVEL:.0%}, at tau = {PRIOR_PRECISION}:"
    )
    for s in SCALINGS:
        for p in PRED_TYPES:
            cal = results[(s, p, "f", "cal")]
            test = results[(s, p, "f", "test")]
            chosen = next((k for k in ks if cal[k][0] >= LEVEL), None)
            label = f"{s} / {p}"
            if chosen is None:
                best = max(ks, key=lambda k: cal[k][0])
                print(
                    f"  {label:>11}: none of k <= {max(ks)} reaches {LEVEL:.0%} (best: "
                    f"{cal[best][0]:.1%} at k = {best}) -- a result, not an error"
                )
            else:
                print(
                    f"  {label:>11}: k = {chosen:2d} (calibration {cal[chosen][0]:.1%}, "
                    f"test {test[chosen][0]:.1%})"
                )


def calibrated(las, X_cal, y_cal, X_test, y_test) -> None:
    """``la.calibrate(coverage=LEVEL)`` (prior precision tuned on the calibration set,
    k by the narrowest calibrated intervals) and the held-out coverage, for intervals of
    y against y and of f against the true f.
    """
    print(
        f"\n  la.calibrate(coverage={LEVEL}) on the calibration set (tau tuned for each k, k "
        "by the narrowest calibrated intervals), then the held-out coverage:"
    )
    f_cal, f_test = torch.sin(3 * X_cal), torch.sin(3 * X_test)
    for scaling, la in las.items():
        for noise, cal, test in (("y", y_cal, y_test), ("f", f_cal, f_test)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                selection = la.calibrate(
                    DataLoader(TensorDataset(X_cal, cal), batch_size=500), LEVEL,
                    ks=list(range(1, la.posterior.n_computed + 1)),
                    include_noise=noise == "y",
                )  # fmt: skip
            held_out = coverage(
                la, DataLoader(TensorDataset(X_test, test), batch_size=500), LEVEL,
                include_noise=noise == "y",
            )  # fmt: skip
            status = "" if selection.reached else " (level NOT reached on calibration)"
            print(
                f"  {scaling:>5} / {noise} vs {noise}: k = {selection.k:2d}, tau = "
                f"{selection.prior_precision:.3g}, test coverage {held_out:.1%}{status}"
            )
        la.n_components, la.prior_precision = la.posterior.n_computed, PRIOR_PRECISION


def grid_table(las, k: int) -> dict:
    """The 'glm' mean and 90% intervals of f (and y) on GRID at k directions."""
    x = torch.tensor(GRID, dtype=torch.float32).reshape(-1, 1)
    rows = {}
    for scaling, la in las.items():
        la.n_components = k
        rows[scaling] = interval_bounds(la, x, "glm", 1, 0)
        mean, _ = la(x, pred_type="glm")
        rows["f*"] = mean.reshape(-1)
    print(f"  'glm' predictive at k = {k}; x outside [-2, 2] is extrapolation")
    header = (
        f"{'x':>6} | {'sin(3x)':>8} | {'f*(x)':>8} | {'mean: 90% interval of f':>24} | "
        f"{'sum: 90% interval of f':>24}"
    )
    print(header)
    print("-" * len(header))
    for i, xi in enumerate(GRID):
        cells = []
        for scaling in SCALINGS:
            lo, hi = rows[scaling][0][i], rows[scaling][1][i]
            cells.append(f"[{float(lo):+.3f}, {float(hi):+.3f}]")
        print(
            f"{xi:6.2f} | {float(torch.sin(torch.tensor(3 * xi))):+8.3f} | "
            f"{float(rows['f*'][i]):+8.3f} | {cells[0]:>24} | {cells[1]:>24}"
        )
    return rows


def plot(args, las, model, X_train, y_train, results, ks) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  matplotlib is not installed: no figure (pip install 'laplace-glas[plot]').")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    x = torch.linspace(-2.5, 2.5, 300).reshape(-1, 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, scaling in zip(axes[:2], SCALINGS, strict=True):
        la = las[scaling]
        la.n_components = args.table_k
        lo_f, hi_f, lo_y, hi_y = interval_bounds(la, x, "glm", 1, 0)
        with torch.no_grad():
            mean = model(x).reshape(-1)
        xs = x.reshape(-1)
        ax.scatter(X_train[:500, 0], y_train[:500, 0], s=3, c="0.6", label="training data")
        ax.fill_between(xs, lo_y, hi_y, alpha=0.2, color="C1", label="90% interval of y")
        ax.fill_between(xs, lo_f, hi_f, alpha=0.5, color="C0", label="90% interval of f")
        ax.plot(xs, mean, "C0", lw=1, label="f*(x)")
        ax.plot(xs, torch.sin(3 * xs), "k--", lw=1, label="sin(3x)")
        ax.set_title(f"{scaling}-loss scaling, k = {args.table_k} ('glm')")
        ax.set_xlabel("x")
        la.n_components = max(ks)
    axes[0].legend(loc="lower left", fontsize=8)
    ax = axes[2]
    for i, scaling in enumerate(SCALINGS):
        for pred, style in zip(PRED_TYPES, ("-o", "--s"), strict=True):
            cov = [results[(scaling, pred, "f", "test")][k][0] for k in ks]
            ax.plot(ks, cov, style, color=f"C{i}", label=f"{scaling} / {pred}")
    ax.axhline(LEVEL, color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("k")
    ax.set_ylabel("test coverage of the 90% interval of f")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = args.out / "known_noise_regression.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"  figure written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    k_max = max(args.k)

    heading("Known-noise regression with GLAS (generalized Laplace active subspace)")
    print(
        f"  N = {args.n_train}, sigma = {SIGMA} (known), prior precision tau = "
        f"{PRIOR_PRECISION}, k = {args.k}, seed = {args.seed}"
        + (" [--quick]" if args.quick else "")
    )
    print(
        f"  torch {torch.__version__}: torch.set_num_threads({args.threads}); "
        f"OPENBLAS_NUM_THREADS = {os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )

    heading("1. Data: y = sin(3x) + 0.1 eps, x ~ U(-2, 2)")
    gen = torch.Generator().manual_seed(args.seed)
    X_train, y_train = known_noise_regression(args.n_train, SIGMA, generator=gen)
    X_cal, y_cal = known_noise_regression(args.n_test, SIGMA, generator=gen)
    X_test, y_test = known_noise_regression(args.n_test, SIGMA, generator=gen)
    print(f"  {args.n_train} training, {args.n_test} calibration and {args.n_test} test points")

    heading("2. MAP: 1-50-50-1 tanh MLP, Adam on the mean squared error")
    model = make_mlp([1, 50, 50, 1], seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    train_map(model, X_train, y_train, steps=args.steps, lr=1e-2)
    with torch.no_grad():
        rmse_train = float((model(X_train) - y_train).square().mean().sqrt())
        rmse_test = float((model(X_test) - y_test).square().mean().sqrt())
    print(
        f"  D = {n_params} weights, {args.steps} full-batch steps in "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(
        f"  RMSE train {rmse_train:.4f}, test {rmse_test:.4f} (noise sigma = {SIGMA}: an "
        "RMSE near sigma means the fit is good)"
    )

    loader = DataLoader(TensorDataset(X_train, y_train), batch_size=min(args.n_train, 1000))
    las, fit_times = {}, {}
    for scaling in SCALINGS:
        las[scaling], fit_times[scaling] = fit_glas(model, loader, k_max, scaling, args.seed)
    ran = las["mean"].lanczos_info
    heading(
        f"3. GLAS fit: top-{k_max} eigenpairs of the mean-loss GGN "
        f"(solver '{ran.solver}' on the {ran.operator} operator)"
    )
    print(f"  {'scaling':>8} | {'GGN products':>12} | {'converged':>9} | {'solve s':>9} | fit s")
    for scaling, la in las.items():
        info = la.lanczos_info
        print(
            f"  {scaling:>8} | {info.n_products:12d} | {info.n_converged:4d} / {info.k:<2d} | "
            f"{info.wall_time:9.2f} | {fit_times[scaling]:5.2f}"
        )
    lam = las["mean"].eigenvalues
    diff = float((lam - las["sum"].eigenvalues).abs().max() / lam[0])
    print(
        f"  (the eigenpairs do not depend on the scaling; both fits agree to {diff:.1e} relative)"
    )
    info = las["mean"].lanczos_info
    n_show = min(k_max, 10)
    print(f"  leading eigenvalues lambda_j of G = (1/N) sum J^T J / sigma^2 (first {n_show}):")
    print(f"  {'j':>3} | {'lambda_j':>10} | {'lambda_j/lambda_1':>17} | residual")
    for j in range(n_show):
        print(
            f"  {j + 1:3d} | {float(lam[j]):10.4g} | {float(lam[j] / lam[0]):17.3e} | "
            f"{float(info.residuals[j]):.1e}"
        )

    heading("4. Posterior variances v_j = 1 / (s lambda_j + tau) along the eigenvectors")
    n_data = las["sum"].n_data
    print(f"  mean-loss scaling s = 1; summed-loss scaling s = N = {n_data}")
    print(f"  {'j':>3} | {'v_j (s = 1)':>12} | {'v_j (s = N)':>12} | ratio")
    v_mean, v_sum = las["mean"].posterior_variances, las["sum"].posterior_variances
    for j in range(n_show):
        print(
            f"  {j + 1:3d} | {float(v_mean[j]):12.4e} | {float(v_sum[j]):12.4e} | "
            f"{float(v_mean[j] / v_sum[j]):7.1f}"
        )

    heading(f"5. Predictive mean and central {LEVEL:.0%} interval of f on a grid")
    grid_table(las, args.table_k)

    heading("6. Coverage of the central 90% intervals on held-out points")
    start = time.perf_counter()
    results = coverage_sweep(las, X_cal, y_cal, X_test, y_test, args.k, args.n_samples, args.seed)
    print(
        f"  'glm': Gaussian interval; 'nn': quantiles of {args.n_samples} sampled networks "
        f"({time.perf_counter() - start:.1f} s for the sweep)"
    )
    print(
        "\n  (a) Coverage of the 90% interval of f (no observation noise) against the true "
        "f = sin(3x)"
    )
    print_coverage_table(results, args.k, "f", args.n_test)
    print(
        "\n  (b) Coverage of the 90% interval of y = f + noise (sigma^2 added) against the "
        "observed y"
    )
    print_coverage_table(results, args.k, "y", args.n_test)
    print()
    select_k(results, args.k)
    calibrated(las, X_cal, y_cal, X_test, y_test)

    if args.out is not None:
        heading("7. Figure")
        plot(args, las, model, X_train, y_train, results, args.k)

    print(f"\nTotal wall time: {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    run_example(main)
