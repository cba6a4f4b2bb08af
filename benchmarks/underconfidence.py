"""Where a whole-network Laplace posterior's in-distribution under-confidence comes from.

On the networks of ``value.py``'s ``wine`` (13-32-32-3 tanh MLP, D = 1,603) and
``digits`` (two-convolution CNN, D = 1,898) tasks, the GGN is formed explicitly,
``G = sum_n J_n^T Lambda_n J_n`` with ``J_n`` the ``C x D`` Jacobian of the logits at
training input ``n``, and the posterior ``N(theta*, (G + tau I)^{-1})`` is taken
without any approximation of the matrix (laplace-torch's ``full``). Three suspects are
measured separately, each with the other two held at the standard choice:

1. **The link.** The 'glm' predictive is the Gaussian ``f ~ N(f(x; theta*), J Sigma
   J^T)`` pushed through the softmax. ``mc`` integrates it by 2,000 samples (the
   reference); ``probit`` is laplace-torch's ``softmax(f / sqrt(1 + pi/8 diag(V)))``;
   ``zero-sum probit`` the same on the projection ``P f`` onto the logits that sum to
   zero (``P = I - 11^T / C``; the softmax is blind to ``1^T f``, so ``softmax(P f)``
   has exactly the distribution of ``softmax(f)``, and the probit no longer counts
   variance common to all logits); ``pairwise`` is the mean-field approximation
   ``p_k ∝ 1 / sum_j exp(-(f_k - f_j) / sqrt(1 + pi/8 Var(f_k - f_j)))``, which also
   sees only differences of logits and is the binary probit for two classes.
2. **The prior.** The scalar ``tau`` maximising the Laplace evidence
   ``-L(theta*) - tau/2 ||theta*||^2 + D/2 log tau - 1/2 sum_i log(lambda_i + tau)``
   (the objective of laplace-torch's ``optimize_prior_precision()``, maximised here on
   a grid instead of by gradient steps), and the same times 3 and 10: if a
   larger scalar prior alone reached the network's confidence in-distribution while
   keeping the OOD AUROC, the evidence's choice would be the fault.
3. **The curvature.** ``Lambda_n = diag(p_n) - p_n p_n^T`` at the MAP's probabilities
   (the standard GGN) vanishes as ``p_n`` saturates on the training data, so directions
   that move a confidently fitted training point's logits carry no curvature and keep
   the prior's variance, although the likelihood rises steeply as soon as the margin
   shrinks. ``posterior`` replaces ``Lambda_n`` by its average under the posterior's
   own predictive at ``x_n``, ``E_{f ~ N(f_n, J_n Sigma J_n^T)}[diag(p(f)) - p(f) p(f)^T]``
   (256 samples), to the fixed point ``Sigma^{-1} = sum_n J_n^T E_q[Lambda_n] J_n + tau
   I``: the stationarity condition of the Gaussian variational objective of the
   linearised network in its covariance, with the mean held at ``theta*``. The fixed
   point is found by damped iteration (the first step replaces the MAP's GGN, each of
   the 7 further steps averages the new GGN with the last one; the relative change is
   at the Monte Carlo noise by then), ``tau`` by the evidence at every step.

Metrics on the test split: NLL, ECE (15 bins), the rotated digits' NLL (shift), OOD
AUROC (1 - max prob, against value.py's OOD inputs). Cells: mean ± sd over seeds.
Needs scikit-learn (the ``bench`` extra). About 10 s (wine) and 1-2 minutes (digits) a
seed on 2 cores. Example::

    python benchmarks/underconfidence.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
import warnings

import torch
from machine import machine_description  # benchmarks/machine.py
from torch import Tensor
from torch.func import functional_call, jacrev, vmap
from value import DTYPE, auroc, ece, sklearn_problem  # benchmarks/value.py

LINKS = ("probit", "zero-sum probit", "pairwise", "mc")
MC_LINK_SAMPLES = 2000
MC_CURVATURE_SAMPLES = 256
FIXED_POINT_STEPS = 8


def logit_jacobians(model: torch.nn.Module, X: Tensor, chunk: int = 200) -> Tensor:
    """``(N, C, D)`` Jacobians of the logits in the flattened weights."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    names = list(params)
    shapes = [params[name].shape for name in names]
    theta = torch.cat([params[name].flatten() for name in names])

    def logits(flat: Tensor, x: Tensor) -> Tensor:
        pieces = torch.split(flat, [s.numel() for s in shapes])
        weights = {n: p.reshape(s) for n, p, s in zip(names, pieces, shapes)}
        return functional_call(model, weights, (x.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(logits), (None, 0))
    return torch.cat([jac(theta, X[i : i + chunk]) for i in range(0, len(X), chunk)])


def softmax_hessian(p: Tensor) -> Tensor:
    """``diag(p) - p p^T`` over the last axis."""
    return torch.diag_embed(p) - p[..., :, None] * p[..., None, :]


def logit_covariance(J: Tensor, Sigma: Tensor) -> Tensor:
    """``J_n Sigma J_n^T`` for every row ``n``: ``(N, C, C)``."""
    return torch.einsum("nci,ij,ndj->ncd", J, Sigma, J)


def gaussian_logits(f: Tensor, V: Tensor, n: int, g: torch.Generator) -> Tensor:
    """``n`` draws ``(n, N, C)`` of ``N(f_n, V_n)`` (a 1e-10 jitter for the Cholesky)."""
    L = torch.linalg.cholesky(V + 1e-10 * torch.eye(V.shape[-1], dtype=V.dtype))
    eps = torch.randn(n, *f.shape, generator=g, dtype=f.dtype)
    return f + torch.einsum("nij,snj->sni", L, eps)


def link(name: str, f: Tensor, V: Tensor, g: torch.Generator) -> Tensor:
    """Class probabilities of ``softmax(N(f, V))`` by the link ``name``."""
    if name == "probit":
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * V.diagonal(dim1=1, dim2=2))
        return torch.softmax(kappa * f, -1)
    if name == "zero-sum probit":
        C = f.shape[-1]
        P = torch.eye(C, dtype=f.dtype) - 1 / C  # onto the logits that sum to zero
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * (P @ V @ P).diagonal(dim1=1, dim2=2))
        return torch.softmax(kappa * (f @ P), -1)
    if name == "pairwise":
        var = V.diagonal(dim1=1, dim2=2)
        var_diff = (var[:, :, None] + var[:, None, :] - 2 * V).clamp(min=0)
        z = -(f[:, :, None] - f[:, None, :]) / torch.sqrt(1 + math.pi / 8 * var_diff)
        p = 1 / torch.exp(z).sum(-1)
        return p / p.sum(-1, keepdim=True)
    return torch.softmax(gaussian_logits(f, V, MC_LINK_SAMPLES, g), -1).mean(0)


def evidence_prior(G: Tensor, theta: Tensor, nll: float) -> float:
    """The scalar ``tau`` maximising the Laplace evidence (a grid of 8,001 in 1e-4..1e4,
    0.23% apart; an optimum at either end is refused)."""
    lam = torch.linalg.eigvalsh(G).clamp(min=0)
    taus = torch.logspace(-4, 4, 8001, dtype=G.dtype)
    D, sq = theta.numel(), float(theta @ theta)
    log_det = torch.cat([torch.log(lam + t[:, None]).sum(1) for t in taus.split(500)])
    evidence = -nll - taus / 2 * sq + D / 2 * torch.log(taus) - 0.5 * log_det
    best = int(evidence.argmax())
    if best in (0, len(taus) - 1):
        raise ValueError(f"The evidence's optimum is at the grid's end (tau = {taus[best]:.3g}).")
    return float(taus[best])


def metrics(probs: dict[str, Tensor], y: Tensor) -> dict[str, float]:
    out = {}
    p = probs["test"].clamp(min=1e-12)
    out["nll"] = float(-p.gather(1, y[:, None]).log().mean())
    out["ece"] = ece(p, y)
    if "shift" in probs:
        out["shift"] = float(-probs["shift"].clamp(min=1e-12).gather(1, y[:, None]).log().mean())
    out["auroc"] = auroc(1 - p.max(1).values, 1 - probs["ood"].max(1).values)
    return out


def run_seed(task: str, seed: int) -> dict[str, dict[str, float]]:
    """Every (curvature, prior, link) cell of one task at one seed."""
    problem = sklearn_problem(task, seed, torch.Generator().manual_seed(seed))
    model = problem.model
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    eye = torch.eye(theta.numel(), dtype=DTYPE)
    J_train = logit_jacobians(model, problem.X_train)
    inputs = {"test": problem.X_test, "ood": problem.X_ood}
    if problem.X_shift is not None:
        inputs["shift"] = problem.X_shift
    with torch.no_grad():
        f_train = model(problem.X_train)
        outputs = {key: model(X) for key, X in inputs.items()}
        nll = float(torch.nn.functional.cross_entropy(f_train, problem.y_train, reduction="sum"))
    jacobians = {key: logit_jacobians(model, X) for key, X in inputs.items()}
    g = torch.Generator().manual_seed(seed)
    results = {"MAP": metrics({k: f.softmax(-1) for k, f in outputs.items()}, problem.y_test)}

    def ggn(Lambda: Tensor) -> Tensor:
        return torch.einsum("nci,ncd,ndj->ij", J_train, Lambda, J_train)

    def evaluate(label: str, G: Tensor, tau: float) -> None:
        Sigma = torch.linalg.inv(G + tau * eye)
        V = {key: logit_covariance(J, Sigma) for key, J in jacobians.items()}
        for name in LINKS:
            probs = {key: link(name, outputs[key], V[key], g) for key in inputs}
            results[f"{label} | {name}"] = {**metrics(probs, problem.y_test), "tau": tau}

    G_map = ggn(softmax_hessian(f_train.softmax(-1)))
    tau = evidence_prior(G_map, theta, nll)
    for factor in (1, 3, 10):
        tag = "evidence" if factor == 1 else f"evidence x{factor}"
        evaluate(f"MAP curvature, {tag}", G_map, factor * tau)

    G = G_map
    for step in range(FIXED_POINT_STEPS):
        Sigma = torch.linalg.inv(G + tau * eye)
        draws = gaussian_logits(f_train, logit_covariance(J_train, Sigma), MC_CURVATURE_SAMPLES, g)
        G_new = ggn(softmax_hessian(draws.softmax(-1)).mean(0))
        G = G_new if step == 0 else 0.5 * (G + G_new)
        tau = evidence_prior(G, theta, nll)
    evaluate("posterior curvature, evidence", G, tau)
    return results


def table(rows: dict[str, list[dict[str, float]]], shift: bool) -> str:
    keys = [("nll", "test NLL"), ("ece", "ECE")]
    keys += [("shift", "rotated NLL")] if shift else []
    keys += [("auroc", "OOD AUROC"), ("tau", "prior prec.")]
    lines = [
        "| curvature, prior | link | " + " | ".join(t for _, t in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for label, results in rows.items():
        method, _, name = label.partition(" | ")
        cells = []
        for key, _ in keys:
            values = [r[key] for r in results if key in r]
            if not values:
                cells.append("–")
            elif len(values) == 1:
                cells.append(f"{values[0]:.3f}")
            else:
                cells.append(f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}")
        lines.append(f"| {method} | {name or '–'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    tasks = ("wine", "digits")
    parser.add_argument("--tasks", nargs="+", choices=tasks, default=list(tasks))
    args = parser.parse_args(argv)
    argv_shown = sys.argv[1:] if argv is None else argv
    print("# In-distribution under-confidence of whole-network Laplace: link, prior or curvature")
    print(f"\nmachine: {machine_description()}\n")
    print(f"date: {time.strftime('%-d %B %Y, %H:%M UTC', time.gmtime())}\n")
    print(f"command: `{shlex.join(['python', 'benchmarks/underconfidence.py', *argv_shown])}`")
    for task in args.tasks:
        rows: dict[str, list[dict[str, float]]] = {}
        for seed in args.seeds:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for label, result in run_seed(task, seed).items():
                    rows.setdefault(label, []).append(result)
            print(f"[{task} seed {seed}] {time.perf_counter() - start:.0f} s", file=sys.stderr)
        print(f"\n## {task} (seeds {' '.join(map(str, args.seeds))})\n")
        print(table(rows, shift=task == "digits"), flush=True)


if __name__ == "__main__":
    main()
