"""Out-of-distribution detection with GLAS's alignment scores, next to laplace-torch's.

Data: UCI Concrete (1030 x 8). The rows with the largest cement content (the top
``--holdout`` share, default 15%) are held out as a *shifted* set; the other rows are
split into train / validation / test (70 / 15 / 15%), all standardised with the
training statistics. Two tasks on the same rows:

* regression of the compressive strength (MLP, MSE; sigma = the MAP's validation RMSE);
* classification of the strength into three classes (tertiles of the training targets;
  MLP, cross-entropy).

For each task the in-distribution test rows (label 0) are told apart from the shifted
rows (label 1) by a score; the table gives its AUROC (0.5 = chance). GLAS scores at
k = 2, 10, 50 (:func:`laplace_glas.alignment` / :func:`laplace_glas.ood_scores`): the
'glm' variance with ``complement='zero'`` and ``'prior'`` (= variance + residual / tau),
the residual ``||J (I - U U^T)||_F^2`` and ``1 - captured``. Baselines: the trace of
the 'glm' covariance of laplace-torch's KronLaplace and DiagLaplace (all weights) and
of a full last-layer Laplace, each with its prior precision tuned by marginal
likelihood, and ``1 - max softmax`` of the MAP (classification only). The script also
prints the median share of ``||J(x)||_F^2`` that the kept subspace captures, and saves
the captured-share-vs-variance figure with ``--out``.

Data: ``--data PATH`` (default ``../shared/data/concrete/Concrete_Data.csv`` beside the
repository); the public source is the UCI ML repository, data set 165 (CC BY 4.0).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from _cli import HelpFormatter

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/concrete/Concrete_Data.csv"
BASELINES = {
    "KronLaplace (all weights)": {"subset_of_weights": "all", "hessian_structure": "kron"},
    "DiagLaplace (all weights)": {"subset_of_weights": "all", "hessian_structure": "diag"},
    "last-layer FullLaplace": {"subset_of_weights": "last_layer", "hessian_structure": "full"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=HelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Concrete_Data.csv")
    parser.add_argument("--quick", action="store_true", help="small models, k in (2, 5)")
    parser.add_argument("--width", type=int, default=None, help="hidden width (50; 16 --quick)")
    parser.add_argument(
        "--steps", type=int, default=None, help="Adam steps (3000; 300 with --quick)"
    )
    parser.add_argument(
        "--ks", type=int, nargs="+", default=None, help="GLAS k values (2 10 50; 2 5 --quick)"
    )
    parser.add_argument("--holdout", type=float, default=0.15, help="shifted share of rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of split, models, draws")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None, help="folder for the figure")
    args = parser.parse_args(argv)
    args.width = args.width or (16 if args.quick else 50)
    args.steps = args.steps or (300 if args.quick else 3000)
    args.ks = sorted(args.ks or ((2, 5) if args.quick else (2, 10, 50)))
    if not 0 < args.holdout < 1:
        parser.error(f"--holdout must be in (0, 1), got {args.holdout}")
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
from laplace_glas.applications.data import load_concrete, make_mlp, split, standardize, train_map


def auroc(scores_in: torch.Tensor, scores_out: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores_out > scores_in`` (Mann-Whitney U / (m n)),
    ties counted one half (average ranks).
    """
    scores = torch.cat([scores_in, scores_out]).double().cpu()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    for value in scores.unique():  # average ranks of ties
        tied = scores == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    m, n = len(scores_in), len(scores_out)
    u = ranks[m:].sum() - n * (n + 1) / 2
    return float(u / (m * n))


def shifted_concrete(path: Path, holdout: float, generator: torch.Generator) -> dict:
    """Train / validation / test rows and the largest-cement rows (the shifted set)."""
    X, y = load_concrete(path)
    order = X[:, 0].argsort(descending=True)
    n_out = round(holdout * len(X))
    shifted, rest = order[:n_out], order[n_out:]
    parts = split(X[rest], y[rest], (0.7, 0.15, 0.15), generator=generator)
    Xs = standardize(*(p[0] for p in parts), X[shifted])
    ys = standardize(*(p[1] for p in parts), y[shifted])
    names = ("train", "val", "test", "shifted")
    data = {name: (Xs[i], ys[i]) for i, name in enumerate(names)}
    edges = torch.quantile(ys[0].reshape(-1), torch.tensor([1 / 3, 2 / 3]))
    labels = {name: torch.bucketize(ys[i].reshape(-1), edges) for i, name in enumerate(names)}
    return {"reg": data, "cls": {n: (data[n][0], labels[n]) for n in names}}


def trace(f_var: torch.Tensor) -> torch.Tensor:
    """``(n,)`` total variance from a ``(n, C, C)`` or ``(n, C)`` covariance."""
    f_var = f_var.detach()
    return f_var.diagonal(dim1=-2, dim2=-1).sum(-1) if f_var.ndim == 3 else f_var.sum(-1)


def baseline_scores(model, likelihood, train, X_in, X_out, sigma) -> dict:
    out = {}
    kwargs = {"sigma_noise": sigma} if likelihood == "regression" else {}
    loader = DataLoader(TensorDataset(*train), batch_size=128)
    for name, structure in BASELINES.items():
        start = time.perf_counter()
        la = Laplace(model, likelihood, **structure, **kwargs)
        la.fit(loader)
        la.optimize_prior_precision(method="marglik", pred_type="glm")
        scores = [trace(la._glm_predictive_distribution(X)[1]) for X in (X_in, X_out)]
        out[name] = (auroc(*scores), time.perf_counter() - start)
    if likelihood == "classification":
        with torch.no_grad():
            soft = [1 - torch.softmax(model(X), -1).max(-1).values for X in (X_in, X_out)]
        out["MAP 1 - max softmax"] = (auroc(*soft), 0.0)
    return out


def glas_scores(model, likelihood, train, X_in, X_out, sigma, ks, figure=None) -> tuple:
    kwargs = {"sigma_noise": sigma} if likelihood == "regression" else {}
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=max(ks),
        loss_scaling="mean",  # the alignment scores' subspace posterior (not the defaults)
        complement="zero",
        **kwargs,
    )
    la.fit(DataLoader(TensorDataset(*train), batch_size=128))
    rows, shares = {}, {}
    for k in ks:
        la.n_components = k  # the leading k of the computed pairs: no refit
        la.optimize_prior_precision()  # closed-form evidence maximisation
        a_in, a_out = laplace_glas.alignment(la, X_in), laplace_glas.alignment(la, X_out)
        s_in, s_out = laplace_glas.ood_scores(a_in), laplace_glas.ood_scores(a_out)
        for name in s_in:
            rows[f"GLAS k = {k}: {name}"] = (auroc(s_in[name], s_out[name]), 0.0)
        shares[k] = (float(a_in.captured.median()), float(a_out.captured.median()))
        if figure is not None and k == sorted(ks)[len(ks) // 2]:
            from laplace_glas.plotting import plot_alignment

            plot_alignment(
                {"in-distribution test": a_in, "largest cement (shifted)": a_out},
                path=figure,
                title=f"Concrete {likelihood}, GLAS k = {k}",
            )
    return rows, shares, la.n_params


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=laplace_glas.NumericalRankWarning)
    generator = torch.Generator().manual_seed(args.seed)
    data = shifted_concrete(args.data, args.holdout, generator)
    sizes = {name: len(X) for name, (X, _) in data["reg"].items()}
    print(f"== Data: {sizes} (shifted = the {args.holdout:.0%} largest-cement rows)")
    table, captured = {}, {}
    for task, likelihood, n_out, loss in (
        ("reg", "regression", 1, "mse"),
        ("cls", "classification", 3, "ce"),
    ):
        part = data[task]
        model = make_mlp([8, args.width, args.width, n_out], seed=args.seed)
        train_map(model, *part["train"], steps=args.steps, lr=3e-3, weight_decay=1e-4, loss=loss)
        with torch.no_grad():
            if likelihood == "regression":
                sigma = float((model(part["val"][0]) - part["val"][1]).square().mean().sqrt())
                print(f"== {likelihood}: validation RMSE (sigma) {sigma:.3f}")
            else:
                sigma = 1.0
                acc = float((model(part["test"][0]).argmax(-1) == part["test"][1]).double().mean())
                print(f"== {likelihood}: test accuracy {acc:.1%}")
        X_in, X_out = part["test"][0], part["shifted"][0]
        figure = None if args.out is None else args.out / f"ood_alignment_{likelihood}.png"
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        rows, shares, n_params = glas_scores(
            model, likelihood, part["train"], X_in, X_out, sigma, args.ks, figure
        )
        rows.update(baseline_scores(model, likelihood, part["train"], X_in, X_out, sigma))
        table[likelihood], captured[likelihood] = rows, (shares, n_params)

    print("\n## AUROC, in-distribution test rows vs largest-cement rows\n")
    print("| score | regression | classification |")
    print("| --- | ---: | ---: |")
    names = list(dict.fromkeys([*table["regression"], *table["classification"]]))
    for name in names:
        cells = [
            f"{table[t][name][0]:.3f}" if name in table[t] else "-"
            for t in ("regression", "classification")
        ]
        print(f"| {name} | {' | '.join(cells)} |")
    print("\n## Median captured share ||J U||_F^2 / ||J||_F^2\n")
    print("| model | D | k | in-distribution test | shifted |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for likelihood, (shares, n_params) in captured.items():
        for k, (a, b) in shares.items():
            print(f"| concrete {likelihood} | {n_params} | {k} | {a:.3f} | {b:.3f} |")
    if args.out is not None:
        print(f"\nfigures in {args.out}")


if __name__ == "__main__":
    run_example(main)
