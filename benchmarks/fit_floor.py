"""The arithmetic floor of a GLAS fit against KronLaplace's fit, on this machine.

For the fit-cost problems of ``benchmarks/fit_cost.py`` (10-300-300-C tanh MLPs,
N = 2000): the floating-point operations a fit of GLAS's kind cannot avoid, divided by
the float32 GEMM rate measured here, against the measured fits (median of
``--repeats`` in one process, after one unmeasured fit each):

* the factor pass: the forward pass and the backward pass of each of the ``R`` rows
  of ``Lambda^{1/2}`` (R = 1 for regression, C - 1 for classification),
  ``2 N D (1 + R)``;
* the dual solve (``R = 1``): the Gram matrix
  ``K = sum_l (A_l A_l^T) o (G_l G_l^T)``, ``N^2 sum_l (d_in + 1 + d_out)`` (its upper
  triangle), and the eigenvectors ``U = S^T W``, ``2 k N D``;
* Lanczos on the factored products (``R > 1``): ``2k + 1`` products (one Lanczos cycle
  with no restart: fewer than any run of ARPACK needs), each
  ``4 N D + 4 N R sum_l d_out``.

A floor ratio above the issue's target means no implementation of that algorithm
reaches the target on this machine; below it, the gap between the measured fit and the
floor is overhead (loader, Python, BLAS efficiency on small calls, the solver's own
vector work, extra products).

The peak GEMM rate flatters the floor: the phases' own shapes run slower. The **kernel
floor** times those phases' kernels themselves on the problem's own factors, each the
fastest of ``--repeats + 2`` calls and of the implementations listed, nothing else in
between:

* the loader: one pass over it (KronLaplace's fit reads it too);
* the pass: the model's forward pass on all ``N`` inputs at once and one backward pass
  (the least a pass that collects every layer's inputs and output gradients does);
* ``C = 1``: the Gram matrix (the library's build; ``torch.mm`` products of both
  factors of each layer with an in-place Hadamard product; BLAS ``syrk`` on OpenBLAS's
  own threads, as NumPy's in-place products), its top-``k`` eigen-solve
  (the library's, ARPACK up to 16 pairs and block Krylov above), and the eigenvectors
  ``S^T W`` (the library's product, and ``k`` products ``g^T (a o w_j)`` a layer);
* ``C > 1``: ``2k + 1`` factored GGN products (one column at a time, and all in one
  block).

Left out: the loss, the checks, the residuals and the solver's own vector work. The
eigen-solve on ``K`` is the fastest implementation found, not a proven bound; every
other phase is a kernel any exact fit of this kind runs. Example::

    python benchmarks/fit_floor.py
"""

from __future__ import annotations

import laplace_glas  # noqa: F401 (first: registers 'glas', imports laplace-torch quietly)

# isort: split
import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from fit_cost import problem  # benchmarks/fit_cost.py
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from scipy.linalg import blas

from laplace_glas.curvature.operators.factored import FactoredGGN, OuterFactor, build_factored_ggn
from laplace_glas.curvature.solvers.gram import _outer_term, _top_eigenpairs, gram_matrix
from laplace_glas.curvature.solvers.threads import single_threaded_openblas

CASES = [("c1-k10", 1, 10, 1.0), ("c1-k50", 1, 50, 1.5), ("c10-k10", 10, 10, 2.5)]


def fastest(call, repeats: int) -> float:
    """Seconds of the fastest of ``repeats + 2`` calls of ``call()``."""
    best = float("inf")
    for _ in range(repeats + 2):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_rate(repeats: int = 10) -> float:
    """Float32 GEMM rate (flop/s) of a 3000 x 301 by 301 x 2000 product, best of ``repeats``."""
    a, b = torch.randn(3000, 301), torch.randn(301, 2000)
    return 2 * 3000 * 301 * 2000 / fastest(lambda: a @ b, repeats)


def floor_flops(C: int, k: int, model: torch.nn.Module, N: int) -> dict[str, float]:
    """The unavoidable flops of each phase of a fit on ``N`` examples (see the module)."""
    D = sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    R = max(1, C - 1)  # rows of Lambda^{1/2}: 1 for unit-noise regression, C - 1 for the softmax
    out = {"factor pass": 2 * N * D * (1 + R)}
    if C == 1:
        out["Gram matrix"] = N**2 * sum(m.in_features + 1 + m.out_features for m in layers)
        out["eigenvectors"] = 2 * k * N * D
    else:
        per_product = 4 * N * D + 4 * N * R * sum(m.out_features for m in layers)
        out[f"{2 * k + 1} products"] = (2 * k + 1) * per_product
    return out


def _gram_by_mm(op: FactoredGGN) -> torch.Tensor:
    """``K = sum_l (G_l G_l^T) o (A_l A_l^T)`` by full ``torch.mm`` products (``R = 1``)."""
    M = op.n_examples
    K, left, right = (torch.zeros(M, M, dtype=op.torch_dtype) for _ in range(3))
    for f in op.factors:
        X, A = _outer_term(f, M, 1)
        if A is None:
            K.addmm_(X, X.T)
        else:
            torch.mm(X, X.T, out=left)
            K.addcmul_(left, torch.mm(A, A.T, out=right))
    return K


def _gram_by_syrk(op: FactoredGGN) -> np.ndarray:
    """The upper triangle of ``K`` by BLAS ``syrk`` (OpenBLAS's threads; ``R = 1``)."""
    M = op.n_examples
    K, left, right = (np.zeros((M, M), op.dtype, order="F") for _ in range(3))
    for f in op.factors:
        X, A = _outer_term(f, M, 1)
        Xt = X.numpy().T  # Fortran-ordered: syrk reads it without a copy
        syrk = blas.get_blas_funcs("syrk", (Xt,))
        if A is None:
            syrk(1.0, Xt, beta=1.0, c=K, trans=1, overwrite_c=1)
            continue
        syrk(1.0, Xt, beta=0.0, c=left, trans=1, overwrite_c=1)
        syrk(1.0, A.numpy().T, beta=0.0, c=right, trans=1, overwrite_c=1)
        np.multiply(left, right, out=left)
        np.add(K, left, out=K)
    return K


def _eigenvectors_by_mm(op: FactoredGGN, W: torch.Tensor) -> None:
    """``S^T W`` as ``k`` products ``g^T (a o w_j)`` for each layer (``R = 1``)."""
    M = op.n_examples
    for f in op.factors:
        X, A = _outer_term(f, M, 1)
        if A is None:  # a single Gram factor: one product for all columns
            torch.mm(X.T, W)
            continue
        scaled = torch.empty_like(A)
        out = torch.empty(X.shape[1], A.shape[1], dtype=A.dtype)
        for j in range(W.shape[1]):
            torch.mm(X.T, torch.mul(A, W[:, j : j + 1], out=scaled), out=out)


def kernel_floor(model, lik: str, loader, C: int, k: int, repeats: int) -> dict[str, float]:
    """Seconds of each phase's kernels on this problem's factors (see the module)."""
    X = torch.cat([x for x, _ in loader])
    params = list(model.parameters())

    def one_pass() -> None:
        model.zero_grad(set_to_none=True)
        model(X).sum().backward()

    out = {"loader": fastest(lambda: list(loader), repeats), "pass": fastest(one_pass, repeats)}
    model.zero_grad(set_to_none=True)
    op = build_factored_ggn(model, params, loader, lik, len(X))
    assert isinstance(op, FactoredGGN), op
    assert all(isinstance(f, OuterFactor) for f in op.factors)
    g = torch.Generator().manual_seed(0)
    if C == 1:
        with single_threaded_openblas():  # as the library's dual solve runs it
            library = fastest(lambda: gram_matrix(op), repeats)
        out["Gram matrix"] = min(
            library,
            fastest(lambda: _gram_by_mm(op), repeats),
            fastest(lambda: _gram_by_syrk(op), repeats),
        )
        with single_threaded_openblas():
            K = gram_matrix(op)
            K.complete()
            out["eigen-solve on K"] = fastest(lambda: _top_eigenpairs(K, k, 0.0, g, 0.0), repeats)
        W = torch.randn(len(X), k, generator=g)
        Y = W.T.reshape(k, len(X), 1).contiguous()
        out["eigenvectors"] = min(
            fastest(lambda: op.apply_transpose(Y), repeats),
            fastest(lambda: _eigenvectors_by_mm(op, W), repeats),
        )
    else:
        n = 2 * k + 1
        V = torch.randn(op.shape[0], n, generator=g)
        one = fastest(lambda: op.matmat_torch(V[:, :1]), repeats) * n
        out[f"{n} products"] = min(one, fastest(lambda: op.matmat_torch(V), repeats))
    return out


def median_fit(make, loader, repeats: int) -> float:
    """Median seconds of ``repeats`` fits after one unmeasured fit."""
    times = []
    for i in range(repeats + 1):
        la = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            la.fit(loader)
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="Adam steps to the MAP")
    parser.add_argument("--quick", action="store_true", help="10-50-50-C, N = 500 (tests)")
    args = parser.parse_args()
    width, N = (50, 500) if args.quick else (300, 2000)
    rate = gemm_rate()
    print(f"machine: {machine_description()}")
    print(f"float32 GEMM rate: {rate / 1e9:.0f} GFLOP/s; in-process medians of {args.repeats}\n")
    print(
        "| case | floor GFLOP (phases) | floor s | GLAS s | Kron s | floor / Kron | "
        "GLAS / Kron | target | GLAS / floor | kernel floor s (phases) | kernels / Kron |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, C, k, target in CASES:
        model, lik, loader = problem(C, width, N, args.steps)
        phases = floor_flops(C, k, model, N)
        floor = sum(phases.values()) / rate
        glas = median_fit(
            lambda model=model, lik=lik, k=k: Laplace(
                model, lik, subset_of_weights="all", hessian_structure="glas", n_components=k
            ),
            loader,
            args.repeats,
        )
        kron = median_fit(
            lambda model=model, lik=lik: Laplace(
                model, lik, subset_of_weights="all", hessian_structure="kron"
            ),
            loader,
            args.repeats,
        )
        kernels = kernel_floor(model, lik, loader, C, k, args.repeats)
        listed = ", ".join(f"{p} {f / 1e9:.2f}" for p, f in phases.items())
        timed = ", ".join(f"{p} {s:.4f}" for p, s in kernels.items())
        floor_s = sum(kernels.values())
        print(
            f"| {name} | {sum(phases.values()) / 1e9:.1f} ({listed}) | {floor:.3g} | "
            f"{glas:.3f} | {kron:.3f} | {floor / kron:.2f}x | {glas / kron:.2f}x | "
            f"<= {target}x | {glas / floor:.1f}x | {floor_s:.4f} ({timed}) | "
            f"{floor_s / kron:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
