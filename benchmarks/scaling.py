"""Scaling of GLAS fit and predictive cost with D and N, side by side with laplace-torch.

Sweeps (``--sweeps``, all by default), on tanh MLPs ``10-w-w-1`` trained briefly (Adam,
minibatches) on a synthetic regression ``y = sin(2 a . x) + 0.1 eps``, ``x ~ N(0, I_10)``:

* ``d``: D from ~1e3 to ~1e6 (hidden width sweep) at N = ``--n``. For each D: GLAS
  ``fit`` for k in ``--ks`` and both solvers ('lanczos': ARPACK, one GGN product per
  data pass; 'block': block Krylov, ``block_size`` columns per pass), KronLaplace
  ``fit``, FullLaplace ``fit`` where D <= ``--full-max-params``: seconds, GGN
  products, data passes, peak RSS, and the ratio GLAS / Kron. At D ~ 1e6 only k = 10
  runs (``--large-ks``): k = 50 alone would take most of the time budget there.
* ``pred`` (part of ``d``): predictive cost per 1000 inputs vs D, from the same
  processes: GLAS 'glm' (k forward-mode JVPs, no Jacobian, one call of ``--n-predict``
  inputs) for k in {10, 20, 50} (truncations of one fit), vs KronLaplace / FullLaplace
  'glm', which build the ``(n, C, D)`` Jacobian with ``jacrev`` of the batch output
  (O(batch^2 D)): called in chunks of ``--pred-chunk`` inputs, on
  ``--large-pred-inputs`` inputs above ``--large-d`` (scaled to 1000).
* ``n``: N sweep at fixed D (width ``--n-width``): GLAS k = 10 (both solvers, and
  Lanczos on a ``--subsample``-point subsample of the data for the eigen-solve) vs
  KronLaplace; the subsample's subspace overlap ``||U_ref^T U||_F^2 / k`` and largest
  relative eigenvalue error against the full-data Lanczos solve.
* ``target``: the headline ratios at D = ``--target-width``'s D (93,901 by default):
  'glm' on ``--n-predict`` inputs in ONE call each (KronLaplace vs GLAS k = 10, 20), and
  GLAS's k = 10 fit vs KronLaplace's for solver variants (tolerance, ``ncv``, block
  width, loader batch, subsamples) with their accuracy against the reference (Lanczos,
  tol = 0, all data).

Every configuration runs in a fresh child process (``multiprocessing`` forkserver with
torch/laplace preloaded, so a child starts in milliseconds; spawn where forkserver is
missing) so that peak-RSS high-water marks never mix; inside the child the mark is also
reset (``/proc/self/clear_refs``) between the fit and the predictive phase. Peak RSS is
reported as the increase over the child's RSS after loading model and data.

Prints Markdown tables, the machine, the threads and the command; ``--out`` also
writes them to a file, ``--json`` dumps the raw measurements.
"""

from __future__ import annotations

import laplace_glas  # noqa: F401 (first: registers 'glas', imports laplace-torch quietly)

# isort: split
# The environment the caller runs in is measured (OpenMP's default wait policy and
# thread counts unless set): machine_description reports it. A tuned setting
# (OMP_WAIT_POLICY=PASSIVE) is the caller's, measured beside the default, never instead.
import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import pickle
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from laplace import Laplace
from machine import machine_description  # benchmarks/machine.py
from torch.utils.data import DataLoader, TensorDataset

from laplace_glas.applications.compare import PeakMemory
from laplace_glas.applications.data import make_mlp, train_map

SIGMA = 0.1
D_IN = 10


# ---------------------------------------------------------------------- set-up
def n_params(width: int) -> int:
    return D_IN * width + width + width * width + width + width + 1


def make_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D_IN, generator=g)
    a = torch.randn(D_IN, generator=torch.Generator().manual_seed(123)) / math.sqrt(D_IN)
    y = torch.sin(2 * X @ a).unsqueeze(1) + SIGMA * torch.randn(n, 1, generator=g)
    return X, y


def trained_state(
    width: int, X: torch.Tensor, y: torch.Tensor, steps: int
) -> dict[str, torch.Tensor]:
    model = make_mlp([D_IN, width, width, 1], seed=0)
    g = torch.Generator().manual_seed(1)
    train_map(model, X, y, steps=steps, lr=1e-3, batch_size=256, generator=g)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- child side
def _run_task(task: dict[str, Any]) -> dict[str, Any]:
    """One configuration, inside a fresh child process."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(task["threads"])
    width = task["width"]
    model = make_mlp([D_IN, width, width, 1], seed=0)
    model.load_state_dict(task["state"])
    model.eval()
    X, y = task["X"], task["y"]
    loader = DataLoader(TensorDataset(X, y), batch_size=task["batch_size"])
    kind = task["kind"]
    out: dict[str, Any] = {"kind": kind, "D": n_params(width), "N": X.shape[0]}

    if kind == "glas":
        kwargs = {
            "n_components": task["k"],
            "complement": "zero",  # the subspace's own fit and 'glm' cost, as measured
            "solver": task["solver"],
            "tol": task.get("tol", 0.0),
            "subsample_size": task.get("subsample_size"),
        }
        for key in ("block_size", "ncv"):
            if task.get(key):
                kwargs[key] = task[key]
        la = Laplace(model, "regression", "all", "glas", sigma_noise=SIGMA, **kwargs)
    else:
        la = Laplace(model, "regression", "all", kind, sigma_noise=SIGMA)

    with PeakMemory() as probe:
        start = time.perf_counter()
        la.fit(loader)
        out["fit_time"] = time.perf_counter() - start
    out["fit_rss_mb"] = probe.peak_mb
    out["rss_method"] = probe.method

    if kind == "glas":
        info = la.lanczos_info
        k = info.k
        out["products"] = info.n_products
        out["solve_time"] = info.wall_time
        if task["solver"] == "lanczos":  # one product per pass + the k-column residual check
            out["passes"] = info.n_products - k + 1
        else:
            out["passes"] = math.ceil(info.n_products / (task.get("block_size") or max(k, 8)))
        out["n_converged"] = info.n_converged
        out["max_residual"] = float(info.residuals[~info.below_threshold].max())
        out["eigenvalues"] = [float(v) for v in la.eigenvalues]
        if task.get("return_vectors"):
            out["vectors"] = la.eigenvectors.detach().clone()

    Xp = task.get("X_pred")
    if Xp is not None and len(Xp):
        ks = task.get("pred_ks") or [None]
        chunk = task.get("pred_chunk") or len(Xp)
        out["pred"] = {}
        for k_pred in ks:
            if k_pred is not None:
                la.n_components = k_pred  # truncation of the fitted eigenpairs
            with torch.no_grad():
                la(Xp[:4], pred_type="glm")  # warm-up
                with PeakMemory() as probe:
                    start = time.perf_counter()
                    for i in range(0, len(Xp), chunk):
                        la(Xp[i : i + chunk], pred_type="glm")
                    elapsed = time.perf_counter() - start
            out["pred"][str(k_pred)] = {
                "per_1000": elapsed * 1000.0 / len(Xp),
                "n_inputs": len(Xp),
                "chunk": chunk,
                "rss_mb": probe.peak_mb,
            }
    return out


def _child_main(task: dict[str, Any], conn: Any) -> None:
    try:
        result = _run_task(task)
    except BaseException as err:  # report, never hang the parent
        result = {"kind": task["kind"], "error": f"{type(err).__name__}: {err}"[:300]}
    # plain pickle: torch's ForkingPickler would pass tensors as shared-memory handles
    # that die with this process
    conn.send_bytes(pickle.dumps(result))
    conn.close()


class Runner:
    """Runs each task in a fresh process, with a timeout."""

    def __init__(self, threads: int, timeout: float, verbose: bool = True) -> None:
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(
                ["torch", "laplace", "laplace_glas", "curvlinops", "scipy.sparse.linalg"]
            )
        self.threads = threads
        self.timeout = timeout
        self.verbose = verbose

    def __call__(self, label: str, **task: Any) -> dict[str, Any]:
        task.setdefault("threads", self.threads)
        parent, child = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=_child_main, args=(task, child), daemon=True)
        start = time.perf_counter()
        process.start()
        child.close()
        if parent.poll(self.timeout):
            try:
                result = pickle.loads(parent.recv_bytes())
            except EOFError:
                result = {"error": f"child died (exit code {process.exitcode})"}
        else:
            process.kill()
            result = {"error": f"timeout after {self.timeout:.0f} s"}
        process.join()
        parent.close()
        result["label"] = label
        result["wall"] = time.perf_counter() - start
        if self.verbose:
            status = result.get("error") or f"fit {result.get('fit_time', float('nan')):.2f} s"
            print(f"  [{result['wall']:6.1f} s] {label}: {status}", file=sys.stderr, flush=True)
        return result


# ---------------------------------------------------------------------- formatting
def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def overlap(U_ref: torch.Tensor | None, U: torch.Tensor | None) -> float | None:
    """``||U_ref^T U||_F^2 / k``: 1 for the same subspace, ~k/D for unrelated ones."""
    if U_ref is None or U is None:
        return None
    k = min(U_ref.shape[1], U.shape[1])
    M = U_ref[:, :k].double().T @ U[:, :k].double()
    return float(M.square().sum() / k)


def eig_error(ref: dict, res: dict) -> float | None:
    """Largest relative error of the top-k eigenvalues against a reference."""
    a, b = ref.get("eigenvalues"), res.get("eigenvalues")
    if not a or not b:
        return None
    k = min(len(a), len(b))
    return max(abs(x - y) / abs(x) for x, y in zip(a[:k], b[:k]) if x != 0)


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)


# ---------------------------------------------------------------------- sweeps
def sweep_d(args: argparse.Namespace, run: Runner, out: Report, raw: dict) -> None:
    X, y = make_data(args.n)
    Xp = make_data(args.n_predict, seed=99)[0]
    out(f"\n### Fit cost vs D (N = {args.n}, batch size {args.batch_size}, float32)\n")
    out(
        "| D | widths | method | k | solver | fit [s] | GGN products | data passes | "
        "peak RSS [MiB] | fit / Kron fit |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    pred_rows = []
    for width in args.widths:
        D = n_params(width)
        start = time.perf_counter()
        state = trained_state(width, X, y, args.train_steps)
        print(f"D = {D}: trained in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        large = D > args.large_d
        # laplace-torch's Jacobian (jacrev of the batch output) costs O(batch^2 D): it is
        # timed in chunks of --pred-chunk inputs, on fewer inputs where D is large
        m_kron = args.n_predict if D <= args.large_d else args.large_pred_inputs
        common = {"width": width, "state": state, "X": X, "y": y, "batch_size": args.batch_size}
        chunk = {"pred_chunk": args.pred_chunk}
        kron = run(f"D={D} kron", kind="kron", X_pred=Xp[:m_kron], **chunk, **common)
        results = [kron]
        full = None
        if D <= args.full_max_params:
            full = run(f"D={D} full", kind="full", X_pred=Xp, **chunk, **common)
            results.append(full)
        glas = {}
        ks = args.large_ks if large else args.ks
        for k in ks:
            if k >= D:
                continue
            for solver in args.solvers:
                pred_ks = sorted({kk for kk in (10, 20, 50, k) if kk <= k})
                res = run(
                    f"D={D} glas k={k} {solver}",
                    kind="glas",
                    k=k,
                    solver=solver,
                    X_pred=Xp,
                    pred_ks=pred_ks,
                    **common,
                )
                glas[(k, solver)] = res
                results.append(res)
        raw.setdefault("d", []).extend(_strip(r) for r in results)
        widths = f"10-{width}-{width}-1"
        for res in results:
            ratio = None
            if "fit_time" in res and "fit_time" in kron:
                ratio = res["fit_time"] / kron["fit_time"]
            name = {"kron": "KronLaplace", "full": "FullLaplace", "glas": "GLAS"}[res["kind"]]
            k, solver = "–", "–"
            if res["kind"] == "glas":
                k, solver = res["label"].split()[2][2:], res["label"].split()[3]
            if "error" in res:
                out(f"| {D} | {widths} | {name} | {k} | {solver} | {res['error']} ||||| ")
                continue
            out(
                f"| {D} | {widths} | {name} | {k} | {solver} | {fmt(res['fit_time'])} | "
                f"{res.get('products', '–')} | {res.get('passes', 1)} | "
                f"{fmt(res['fit_rss_mb'], '.0f')} | {fmt(ratio, '.2f')} |"
            )
        pred_rows.append((D, kron, full, glas))
    raw["pred_rows"] = [(D,) for D, *_ in pred_rows]
    _pred_table(args, out, pred_rows)
    raw["_pred"] = pred_rows


def _pred_table(args: argparse.Namespace, out: Report, pred_rows: list) -> None:
    out(
        f"\n### Predictive 'glm' cost per 1000 inputs vs D (seconds; laplace-torch in calls "
        f"of {args.pred_chunk} inputs, GLAS in one call; peak RSS in MiB)\n"
    )
    out(
        "| D | Kron [s] (inputs timed) | Full [s] | GLAS k=10 | GLAS k=20 | GLAS k=50 | "
        "Kron / GLAS k=10 | Kron / GLAS k=50 | RSS Kron | RSS GLAS k=50 |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    for D, kron, full, glas in pred_rows:
        best: dict[str, dict] = {}
        for res in glas.values():  # the predictive does not depend on the solver
            for key, p in res.get("pred", {}).items():
                if key not in best or p["per_1000"] < best[key]["per_1000"]:
                    best[key] = p
        kp = kron.get("pred", {}).get("None")
        fp = (full or {}).get("pred", {}).get("None")
        g = {k: best.get(str(k)) for k in (10, 20, 50)}
        t = lambda p: p["per_1000"] if p else None  # noqa: E731
        ratio10 = t(kp) / t(g[10]) if kp and g[10] else None
        ratio50 = t(kp) / t(g[50]) if kp and g[50] else None
        kron_cell = f"{fmt(t(kp))} ({kp['n_inputs']})" if kp else kron.get("error", "–")
        out(
            f"| {D} | {kron_cell} | {fmt(t(fp))} | {fmt(t(g[10]))} | {fmt(t(g[20]))} | "
            f"{fmt(t(g[50]))} | {fmt(ratio10, '.0f')} | {fmt(ratio50, '.0f')} | "
            f"{fmt(kp and kp['rss_mb'], '.0f')} | {fmt(g[50] and g[50]['rss_mb'], '.0f')} |"
        )


def sweep_n(args: argparse.Namespace, run: Runner, out: Report, raw: dict) -> None:
    width = args.n_width
    D = n_params(width)
    X_all, y_all = make_data(max(args.ns))
    state = trained_state(width, X_all[: min(args.ns)], y_all[: min(args.ns)], args.train_steps)
    out(
        f"\n### Fit cost vs N (D = {D}, 10-{width}-{width}-1, k = 10, batch size "
        f"{args.batch_size}; subsample = eigen-solve on {args.subsample} points)\n"
    )
    out(
        "| N | Kron fit [s] | GLAS lanczos [s] | GLAS block [s] | GLAS lanczos + subsample [s] | "
        "lanczos / Kron | block / Kron | subsample / Kron | subsample overlap | "
        "subsample max eig. err. |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.ns:
        X, y = X_all[:n], y_all[:n]
        common = {"width": width, "state": state, "X": X, "y": y, "batch_size": args.batch_size}
        kron = run(f"N={n} kron", kind="kron", **common)
        lan = run(
            f"N={n} lanczos", kind="glas", k=10, solver="lanczos", return_vectors=True, **common
        )
        blk = run(f"N={n} block", kind="glas", k=10, solver="block", **common)
        sub = None
        if args.subsample < n:
            sub = run(
                f"N={n} lanczos sub={args.subsample}",
                kind="glas",
                k=10,
                solver="lanczos",
                subsample_size=args.subsample,
                return_vectors=True,
                **common,
            )
        raw.setdefault("n", []).extend(_strip(r) for r in (kron, lan, blk, sub) if r)
        t = _fit_time
        ratio = functools.partial(_fit_ratio, kron=kron)
        ov = overlap(lan.get("vectors"), sub.get("vectors")) if sub else None
        err = eig_error(lan, sub) if sub else None
        out(
            f"| {n} | {fmt(t(kron))} | {fmt(t(lan))} | {fmt(t(blk))} | {fmt(t(sub))} | "
            f"{fmt(ratio(lan), '.1f')} | {fmt(ratio(blk), '.1f')} | {fmt(ratio(sub), '.1f')} | "
            f"{fmt(ov, '.3f')} | {fmt(err, '.2g')} |"
        )


def sweep_target(args: argparse.Namespace, run: Runner, out: Report, raw: dict) -> None:
    width = args.target_width
    D = n_params(width)
    X, y = make_data(args.n)
    Xp = make_data(args.n_predict, seed=99)[0]
    state = trained_state(width, X, y, args.train_steps)
    common = {"width": width, "state": state, "X": X, "y": y, "batch_size": args.batch_size}

    # --- predictive: one call of n_predict inputs each, as a user would make it
    out(
        f"\n### Predictive target: 'glm' on {args.n_predict} inputs in ONE call, D = {D}, "
        f"N = {args.n}\n"
    )
    kron = run("target kron (one call)", kind="kron", X_pred=Xp, **common)
    glas = run(
        "target glas k=20 (one call)",
        kind="glas",
        k=20,
        solver="lanczos",
        X_pred=Xp,
        pred_ks=[10, 20],
        **common,
    )
    raw["target_pred"] = [_strip(kron), _strip(glas)]
    kp = kron.get("pred", {}).get("None")
    out("| method | seconds per 1000 inputs | peak RSS [MiB] | KronLaplace / method |")
    out("|---|---|---|---|")
    if kp:
        out(f"| KronLaplace 'glm' | {fmt(kp['per_1000'])} | {fmt(kp['rss_mb'], '.0f')} | 1 |")
    else:
        out(f"| KronLaplace 'glm' | {kron.get('error')} | | |")
    for k in (10, 20):
        gp = glas.get("pred", {}).get(str(k))
        if gp:
            ratio = kp["per_1000"] / gp["per_1000"] if kp else None
            out(
                f"| GLAS 'glm' k = {k} | {fmt(gp['per_1000'])} | {fmt(gp['rss_mb'], '.0f')} | "
                f"{fmt(ratio, '.0f')} |"
            )
    if kp and glas.get("pred", {}).get("20"):
        ratio = kp["per_1000"] / glas["pred"]["20"]["per_1000"]
        verdict = "MET" if ratio >= 20 else "MISSED"
        out(
            f"\nTarget GLAS 'glm' >= 20x faster than KronLaplace 'glm' (k = 20): {ratio:.0f}x, "
            f"{verdict}"
        )

    # --- fit: solver variants and their accuracy against the reference
    out(
        f"\n### Fit-time target: GLAS k = 10 vs KronLaplace, D = {D}, N = {args.n} "
        f"(accuracy against Lanczos on all data)\n"
    )
    kron = run("target kron", kind="kron", **common)
    lanczos, block = {"solver": "lanczos"}, {"solver": "block"}
    variants: list[tuple[str, dict]] = [
        ("lanczos (reference: tol = 0, ncv = 21)", lanczos),
        ("lanczos, tol = 1e-3", {**lanczos, "tol": 1e-3}),
        ("lanczos, ncv = 15", {**lanczos, "ncv": 15}),
        (f"lanczos, loader batch {args.n}", {**lanczos, "batch_size": args.n}),
        ("block, p = 10 (default)", block),
        ("block, p = 10, tol = 1e-3", {**block, "tol": 1e-3}),
        ("block, p = 20, tol = 1e-3", {**block, "block_size": 20, "tol": 1e-3}),
    ]
    for sub in args.target_subsamples:
        if sub < args.n:
            variants.append((f"lanczos, subsample {sub}", {**lanczos, "subsample_size": sub}))
    if args.target_subsamples and min(args.target_subsamples) < args.n:
        sub = min(args.target_subsamples)
        variants.append(
            (f"block, tol = 1e-3, subsample {sub}", {**block, "tol": 1e-3, "subsample_size": sub})
        )
    out(f"KronLaplace fit: {fmt(kron.get('fit_time'))} s ({kron.get('error', 'ok')})\n")
    out(
        "| variant | fit [s] | GGN products | data passes | GLAS / Kron | max rel. residual | "
        "overlap with ref. | max eig. err. | peak RSS [MiB] |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    ref = None
    for label, kwargs in variants:
        task = {**common, **kwargs}
        res = run(f"target {label}", kind="glas", k=10, return_vectors=True, **task)
        raw.setdefault("target", []).append(_strip(res))
        if ref is None:
            ref = res
        if "error" in res:
            out(f"| {label} | {res['error']} ||||||||")
            continue
        ratio = res["fit_time"] / kron["fit_time"] if "fit_time" in kron else None
        out(
            f"| {label} | {fmt(res['fit_time'])} | {res['products']} | {res['passes']} | "
            f"{fmt(ratio, '.1f')} | {fmt(res['max_residual'], '.1e')} | "
            f"{fmt(overlap(ref.get('vectors'), res.get('vectors')), '.4f')} | "
            f"{fmt(eig_error(ref, res), '.1e')} | {fmt(res['fit_rss_mb'], '.0f')} |"
        )
    raw["target_kron"] = _strip(kron)


def _fit_time(res: dict | None) -> float | None:
    return res.get("fit_time") if res else None


def _fit_ratio(res: dict | None, kron: dict) -> float | None:
    a, b = _fit_time(res), _fit_time(kron)
    return a / b if a and b else None


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if not isinstance(v, torch.Tensor)}


def _targets(out: Report, raw: dict, args: argparse.Namespace) -> None:
    """Headline ratios at the target width, from the D sweep."""
    rows = raw.get("_pred") or []
    D_t = n_params(args.target_width)
    for D, kron, _full, glas in rows:
        if D != D_t:
            continue
        out(f"\n### Target ratios at D = {D}, N = {args.n}\n")
        kp = kron.get("pred", {}).get("None")
        for k in (10, 20, 50):
            best = [
                r["pred"][str(k)]["per_1000"] for r in glas.values() if str(k) in r.get("pred", {})
            ]
            if kp and best:
                ratio = kp["per_1000"] / min(best)
                verdict = "MET" if ratio >= 20 else "MISSED"
                out(
                    f"- predictive 'glm': KronLaplace (calls of {kp.get('chunk')} inputs) "
                    f"{kp['per_1000']:.3g} s / GLAS k={k} (one call) {min(best):.3g} s per "
                    f"1000 inputs = {ratio:.0f}x (target >= 20x): {verdict}"
                )
        for solver in args.solvers:
            res = glas.get((10, solver))
            if res and "fit_time" in res and "fit_time" in kron:
                ratio = res["fit_time"] / kron["fit_time"]
                verdict = "MET" if ratio <= 2 else "MISSED"
                out(
                    f"- fit k=10 ({solver}): GLAS {res['fit_time']:.3g} s / KronLaplace "
                    f"{kron['fit_time']:.3g} s = {ratio:.1f}x (target <= 2x): {verdict}"
                )


# ---------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument(
        "--sweeps",
        nargs="+",
        default=["d", "n", "target"],
        choices=["d", "n", "target"],
        help="'d' includes the predictive sweep",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per child")
    parser.add_argument("--n", type=int, default=2000, help="N of the D sweep and target")
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[26, 55, 94, 300, 994],
        help="hidden widths (D = 1015, 3741, 10059, 93901, 1000959)",
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 50])
    parser.add_argument(
        "--large-ks", type=int, nargs="+", default=[10], help="k values above --large-d"
    )
    parser.add_argument("--large-d", type=int, default=200_000)
    parser.add_argument("--solvers", nargs="+", default=["lanczos", "block"])
    parser.add_argument("--full-max-params", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--train-steps", type=int, default=200, help="Adam steps, batch 256")
    parser.add_argument("--n-predict", type=int, default=1000, help="inputs of the GLAS call")
    parser.add_argument(
        "--pred-chunk", type=int, default=50, help="inputs per laplace-torch 'glm' call"
    )
    parser.add_argument(
        "--large-pred-inputs",
        type=int,
        default=100,
        help="inputs timed for the laplace-torch 'glm' above --large-d",
    )
    parser.add_argument("--ns", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--n-width", type=int, default=94, help="width of the N sweep")
    parser.add_argument("--subsample", type=int, default=1000)
    parser.add_argument("--target-width", type=int, default=300)
    parser.add_argument("--target-subsamples", type=int, nargs="+", default=[500, 250])
    parser.add_argument("--timeout", type=float, default=420, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    parser.add_argument("--json", type=Path, default=None, help="dump raw measurements here")
    args = parser.parse_args(argv)
    if args.quick:
        args.widths = [26, 94]
        args.n = 500
        args.ks = [10]
        args.n_predict = 200
        args.large_pred_inputs = 50
        args.pred_chunk = 25
        args.ns = [250, 1000]
        args.n_width = 26
        args.subsample = 200
        args.target_width = 94
        args.target_subsamples = [100]
        args.train_steps = 50
        args.batch_size = 250
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["PYTHONWARNINGS"] = "ignore"  # inherited by the forkserver
    torch.set_num_threads(args.threads)
    out = Report()
    out(f"machine: {machine_description(args.threads)}")
    out(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    run = Runner(args.threads, args.timeout)
    out(f"isolation: one fresh '{run.ctx.get_start_method()}' child process per configuration")
    raw: dict[str, Any] = {}
    start = time.perf_counter()
    if "d" in args.sweeps:
        sweep_d(args, run, out, raw)
        _targets(out, raw, args)
    if "n" in args.sweeps:
        sweep_n(args, run, out, raw)
    if "target" in args.sweeps:
        sweep_target(args, run, out, raw)
    out(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    raw.pop("_pred", None)
    if args.out:
        args.out.write_text("\n".join(out.lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1, default=str))


if __name__ == "__main__":
    main()
