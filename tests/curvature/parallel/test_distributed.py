"""Data-parallel fits on torch.distributed (gloo, 2 processes) against one process.

Two ranks spawned with ``torch.multiprocessing`` (rendezvous through a temporary file,
no port) each fit on their shard of the data; every quantity must equal a single-process
fit on all the data (rel. 1e-5, float64): eigenvalues, eigenvectors up to sign, N, the
loss at the MAP, the evidence, the empirical-Bayes prior precision, the calibration
table and the replica check. Both ranks must hold bit-identical eigenpairs. The
single-process fits are themselves checked against the dense GGN from ``torch.func``
Jacobians (tests/test_subspace.py and here for the eigenvalues).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import loader
from laplace import Laplace
from scipy.sparse.linalg import LinearOperator
from torch import nn

import laplace_glas  # noqa: F401
import laplace_glas.curvature.memory.planner as dispatch
from laplace_glas import SubnetActiveSubspaceLaplace
from laplace_glas.curvature.parallel import distributed as glas_dist
from laplace_glas.curvature.parallel.distributed import data_parallel
from laplace_glas.diagnostics.calibration import coverage, select_dimension
from laplace_glas.diagnostics.convergence import replica_check

WORLD = 2
N_TRAIN = 40
N_CALIB = 30
K = 4
TAU = 0.7
SPLITS = {"even": 20, "uneven": 13}  # rank 0 holds the first n points, rank 1 the rest
CASES = [
    (likelihood, solver, split)
    for likelihood in ("regression", "classification")
    for solver in ("lanczos", "block", "auto")
    for split in SPLITS
]


def _problem(likelihood: str):
    """A 3-6-2 (regression) or 3-6-3 (classification) tanh MLP in float64 (D = 38 / 45)
    and its training and calibration data; deterministic in every process.
    """
    g = torch.Generator().manual_seed(11)
    n_out = 2 if likelihood == "regression" else 3
    X = torch.randn(N_TRAIN + N_CALIB, 3, generator=g, dtype=torch.float64)
    if likelihood == "regression":
        y = torch.stack([torch.sin(X.sum(1)), torch.cos(X[:, 0])], 1)
        y = y + 0.1 * torch.randn(y.shape, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, n_out, (len(X),), generator=g)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, n_out)).double().eval()
    return model, X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]


class _OutputScale(nn.Module):
    """The MLP times a learnt scalar: a parameter outside any layer, so the factored
    operator refuses the model and 'auto' solves on the linearised operator."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.scale * self.net(x)


def _fit(model, likelihood, solver, train, **fit_kwargs):
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="all",
        hessian_structure="glas",
        n_components=K,
        solver=solver,
        block_size=3,
        prior_precision=TAU,
        sigma_noise=0.5 if likelihood == "regression" else 1.0,
        loss_scaling="mean",  # the eigenpairs' machinery (the complements: _complement_fit)
        complement="zero",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(train, **fit_kwargs)
    return la


def _summary(la, calib, train) -> dict:
    info = la.lanczos_info
    out = {
        "values": la.eigenvalues.clone(),
        "vectors": la.eigenvectors.clone(),
        "n_data": la.n_data,
        "loss": float(la.loss),
        "evidence": float(la.log_marginal_likelihood()),
        "solver": info.solver,
        "operator": info.operator,
    }
    la.optimize_prior_precision()
    out["tau_eb"] = float(la.prior_precision)
    if la.likelihood == "classification" and la.solver == "lanczos":
        # laplace-torch's grid search: validation NLL of all shards, weighted by size
        with warnings.catch_warnings():  # laplace-torch's reminder of the link_approx
            warnings.simplefilter("ignore", UserWarning)
            la.optimize_prior_precision(
                method="gridsearch",
                val_loader=calib,
                grid_size=9,
                log_prior_prec_min=-2,
                link_approx="probit",
            )
        out["tau_grid"] = float(la.prior_precision)
    la.prior_precision = TAU
    # the posterior does not depend on the eigenvectors' signs, one shared draw of z
    # does: both fits sample along sign-canonical vectors (largest entry positive)
    U = la.H[0]
    signs = torch.sign(U.gather(0, U.abs().argmax(0, keepdim=True)))
    la.H = (U * signs, la.H[1])
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        selection = select_dimension(la, calib, coverage=0.8, n_samples=50, generator=g)
    out["rows"] = [
        (r.k, r.prior_precision, r.coverage, r.mean_width, r.nll) for r in selection.rows
    ]
    if la.solver == "auto":  # replica_check repeats the solve: once per likelihood
        out["replica"] = replica_check(la, train, n_replicas=1).best_overlap.clone()
    return out


def _complement_summary(model, X, y, Xc, yc, complement: str, rank: int | None) -> dict:
    """A default-scaled fit with ``complement`` on all data (``rank`` None) or on the
    rank's uneven shard: what the complement changes (evidence, predictive, draws' norm).
    """
    likelihood = "regression" if y.is_floating_point() else "classification"
    if rank is not None:
        X, y = _shard((X, y), rank, "uneven")
    la = Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure="glas",
        n_components=K, prior_precision=TAU, complement=complement,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader(X, y, batch_size=16))
        out = la(Xc, pred_type="glm", link_approx="probit")
    # regression: the predictive variance; classification: probit probabilities
    predictive = out[1].squeeze(-1) if likelihood == "regression" else out
    return {
        "complement": la.complement,
        "values": la.eigenvalues.clone(),
        "evidence": float(la.log_marginal_likelihood()),
        "predictive": predictive.detach().clone(),
        "trace": float(la.posterior_covariance.to_dense().trace()),
    }


def _shard(tensors, rank: int, split: str):
    n = SPLITS[split]
    return [t[:n] if rank == 0 else t[n:] for t in tensors]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for likelihood, solver, split in CASES:
            model, X, y, Xc, yc = _problem(likelihood)
            X, y = _shard((X, y), rank, split)
            cal_n = 11  # uneven calibration shards for every case
            Xc, yc = (Xc[:cal_n], yc[:cal_n]) if rank == 0 else (Xc[cal_n:], yc[cal_n:])
            train = loader(X, y, batch_size=16)
            la = _fit(model, likelihood, solver, train)
            results[(likelihood, solver, split)] = _summary(la, loader(Xc, yc, 16), train)
        for likelihood in ("regression", "classification"):
            for complement in ("kron", "auto"):
                results[("complement", likelihood, complement)] = _complement_summary(
                    *_problem(likelihood), complement, rank
                )
        # a model the factored operator refuses: the linearised operator on every rank
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X, y), rank, "uneven")
        jacobian, dispatch._jacobian = dispatch._jacobian, lambda *args: "not tried here"
        la = _fit(_OutputScale(model), "regression", "auto", loader(X, y, batch_size=16))
        results["linearised"] = {
            "values": la.eigenvalues.clone(),
            "operator": la.lanczos_info.operator,
        }
        dispatch._jacobian = jacobian  # the same model from stored Jacobians
        la = _fit(_OutputScale(model), "regression", "auto", loader(X, y, batch_size=16))
        results["jacobian"] = {
            "values": la.eigenvalues.clone(),
            "operator": la.lanczos_info.operator,
        }
        # the factored operator built on rank 0 only: every rank falls back to curvlinops
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X, y), rank, "uneven")
        if rank == 1:  # the factored and linearised operators are refused on this rank
            dispatch.build_factored_ggn = lambda *args, **kwargs: "refused on rank 1"
            dispatch.build_linearized_ggn = lambda *args, **kwargs: "refused on rank 1"
        la = _fit(model, "regression", "auto", loader(X, y, batch_size=16))
        results["fallback"] = {
            "values": la.eigenvalues.clone(),
            "operator": la.lanczos_info.operator,
        }
        # fit(override=False): the stored curvature plus the all-reduced new data
        model, X, y, _, _ = _problem("regression")
        first = (X[:10], y[:10]) if rank == 0 else (X[10:20], y[10:20])
        second = (X[20:27], y[20:27]) if rank == 0 else (X[27:], y[27:])
        la = _fit(model, "regression", "lanczos", loader(*first, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.fit(loader(*second, 16), override=False)
        results["update"] = {"values": la.eigenvalues.clone(), "n_data": la.n_data}
        results["update"]["loss"] = float(la.loss)
        # float32 (the default precision): NumPy/torch round trips of the products
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X.float(), y.float()), rank, "uneven")
        la = _fit(model.float(), "regression", "lanczos", loader(X, y, 16))
        results["float32"] = {"values": la.eigenvalues.clone(), "dtype": la.eigenvectors.dtype}
        # a group of one rank: a local fit on the local shard
        local = dist.new_group([0]), dist.new_group([1])
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X, y), rank, "uneven")
        la = _fit(model, "regression", "lanczos", loader(X, y, 16), process_group=local[rank])
        results["local"] = {"values": la.eigenvalues.clone(), "n_data": la.n_data}
        try:
            data_parallel("world")
        except TypeError as err:
            results["type_error"] = str(err)
        try:
            data_parallel(local[1 - rank])
        except ValueError as err:
            results["not_member"] = str(err)
        # a subnetwork: its restricted products all-reduced like the whole network's
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X, y), rank, "uneven")
        la = _subnetwork_fit(model, loader(X, y, 16))
        results["subnetwork"] = {"values": la.eigenvalues.clone(), "n_data": la.n_data}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _subnetwork_fit(model, train):
    D = sum(p.numel() for p in model.parameters())
    la = SubnetActiveSubspaceLaplace(
        model, "regression", torch.arange(0, D, 3), n_components=K, complement="prior"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(train)
    return la


def test_a_subnetwork_fits_on_two_ranks_as_in_one_process(ranks):
    model, X, y, _, _ = _problem("regression")
    one = _subnetwork_fit(model, loader(X, y, 16))
    for rank in ranks:
        assert rank["subnetwork"]["n_data"] == one.n_data
        _close(rank["subnetwork"]["values"], one.eigenvalues)


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # fork: the ranks inherit the imported modules (a spawned rank spends seconds
        # importing torch and laplace-torch); they run single-threaded
        mp.start_processes(
            _worker, args=(init_file, tmp), nprocs=WORLD, join=True, start_method="fork"
        )
        yield [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _single(likelihood: str, solver: str) -> dict:
    model, X, y, Xc, yc = _problem(likelihood)
    train = loader(X, y, batch_size=16)
    la = _fit(model, likelihood, solver, train)
    return _summary(la, loader(Xc, yc, 16), train), la, model, X


def _close(a, b, rtol=1e-5):
    a = torch.as_tensor(a, dtype=torch.float64).detach()
    b = torch.as_tensor(b, dtype=torch.float64).detach()
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


def _dense_eigenvalues(model, X, likelihood, sigma):
    """Top-K eigenvalues of G = (1/N) sum_n J_n^T Lambda_n J_n from torch.func Jacobians."""
    params = dict(model.named_parameters())
    names = list(params)

    def f(*ps):
        return torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (X,))

    jac = torch.func.jacrev(f, argnums=tuple(range(len(names))))(*params.values())
    J = torch.cat([j.reshape(*j.shape[:2], -1) for j in jac], -1)  # (N, C, D)
    if likelihood == "regression":
        Lam = torch.eye(J.shape[1], dtype=J.dtype).expand(len(X), -1, -1) / sigma**2
    else:
        with torch.no_grad():
            p = torch.softmax(model(X), -1)
        Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    G = torch.einsum("ncd,nce,nef->df", J, Lam, J) / len(X)
    return torch.linalg.eigvalsh(G).flip(0)[:K]


@pytest.mark.parametrize(("likelihood", "solver", "split"), CASES)
def test_two_ranks_equal_one_process(ranks, likelihood, solver, split):
    case = (likelihood, solver, split)
    one, la, model, X = _single(likelihood, solver)
    _close(one["values"], _dense_eigenvalues(model, X, likelihood, float(la.sigma_noise)), 1e-8)
    for rank in ranks:
        got = rank[case]
        assert got["n_data"] == one["n_data"] == N_TRAIN
        _close(got["values"], one["values"])
        signs = torch.sign((got["vectors"] * one["vectors"]).sum(0))
        _close(got["vectors"] * signs, one["vectors"])
        for key in ("loss", "evidence", "tau_eb"):
            _close(got[key], one[key])
        assert [r[0] for r in got["rows"]] == [r[0] for r in one["rows"]]
        _close([r[1] for r in got["rows"]], [r[1] for r in one["rows"]])
        _close([r[2:] for r in got["rows"]], [r[2:] for r in one["rows"]], 1e-10)
        if solver == "auto":
            _close(got["replica"], one["replica"])
        if "tau_grid" in one:
            _close(got["tau_grid"], one["tau_grid"])
        assert got["solver"] == ("block" if solver == "block" else "lanczos")
        assert "all-reduced over 2 ranks" in got["operator"]
    if solver == "auto":  # the MLP is factored; a planned dual solve becomes Lanczos
        name = ranks[0][case]["operator"]
        assert name.startswith(("factored (dual solve not distributed", "factored, all-reduced"))
    a, b = ranks[0][case], ranks[1][case]
    assert torch.equal(a["values"], b["values"]) and torch.equal(a["vectors"], b["vectors"])


def test_factored_on_one_rank_only_falls_back_everywhere(ranks):
    one, *_ = _single("regression", "lanczos")
    for rank in ranks:
        assert rank["fallback"]["operator"].startswith("curvlinops (not factored")
        _close(rank["fallback"]["values"], one["values"])


def test_linearised_and_jacobian_operators_on_every_rank_equal_one_process(ranks):
    model, X, y, _, _ = _problem("regression")
    one = _fit(_OutputScale(model), "regression", "lanczos", loader(X, y, 16))
    for rank in ranks:
        operator = rank["linearised"]["operator"]
        assert operator.startswith("linearised (not factored") and "all-reduced over 2" in operator
        _close(rank["linearised"]["values"], one.eigenvalues)
        operator = rank["jacobian"]["operator"]
        assert operator.startswith("jacobian (dual solve not distributed: Lanczos")
        assert "all-reduced over 2" in operator
        _close(rank["jacobian"]["values"], one.eigenvalues)


def test_group_of_one_rank_fits_the_local_shard(ranks):
    model, X, y, _, _ = _problem("regression")
    for rank, (lo, hi) in enumerate([(0, 13), (13, N_TRAIN)]):
        local = _fit(model, "regression", "lanczos", loader(X[lo:hi], y[lo:hi], 16))
        assert ranks[rank]["local"]["n_data"] == hi - lo
        _close(ranks[rank]["local"]["values"], local.eigenvalues)


def test_a_process_group_that_is_not_one_is_refused(ranks):
    for rank in ranks:
        assert rank["type_error"].startswith("process_group must be a torch.distributed")
        assert rank["not_member"] == "This process is not a member of the given process_group."


def test_process_group_without_init_is_refused():
    assert not dist.is_initialized()
    assert data_parallel(None) is None
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised"):
        data_parallel(object())
    model, X, y, _, _ = _problem("regression")
    with pytest.raises(ValueError, match="process_group was given"):
        _fit(model, "regression", "lanczos", loader(X, y), process_group=object())
    assert glas_dist.sum_count(7, None) == 7


def test_float32_fit(ranks):
    model, X, y, _, _ = _problem("regression")
    one = _fit(model.float(), "regression", "lanczos", loader(X.float(), y.float(), 16))
    for rank in ranks:
        assert rank["float32"]["dtype"] == torch.float32
        _close(rank["float32"]["values"], one.eigenvalues, 1e-4)


def test_update_with_override_false(ranks):
    model, X, y, _, _ = _problem("regression")
    one = _fit(model, "regression", "lanczos", loader(X[:20], y[:20], 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one.fit(loader(X[20:], y[20:], 16), override=False)
    for rank in ranks:
        assert rank["update"]["n_data"] == one.n_data == N_TRAIN
        _close(rank["update"]["values"], one.eigenvalues)
        _close(rank["update"]["loss"], one.loss)


# ---------------------------------------------------------------- faults on one rank
class _BreakingLoader:
    """A DataLoader whose ``fail_at``-th pass raises (counting every ``iter``)."""

    def __init__(self, inner, fail_at: int, exit: bool = False):
        self.inner, self.fail_at, self.passes, self.exit = inner, fail_at, 0, exit

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        self.passes += 1
        if self.passes >= self.fail_at:
            if self.exit:  # the process dies (no clean-up, no exception)
                os._exit(3)
            raise OSError(f"the loader broke on pass {self.passes}")
        return iter(self.inner)


def _break_solver(fault: str) -> None:
    """Make the eigen-solver's own arithmetic (not a product) fail on this rank: ARPACK
    before its 3rd product, the block solver's 2nd orthonormalisation, or the step
    after the solve's last product (``'after'``).
    """
    import laplace_glas.curvature.fit as fit_module
    import laplace_glas.curvature.solvers.block_krylov as block_module
    import laplace_glas.curvature.solvers.lanczos as lanczos_module

    if fault == "arpack":
        eigsh = lanczos_module.eigsh

        def broken_eigsh(A, **kwargs):
            calls = [0]

            def matvec(x):
                calls[0] += 1
                if calls[0] == 3:
                    raise MemoryError("ARPACK's workspace could not be allocated")
                return A.matvec(x)

            return eigsh(LinearOperator(A.shape, matvec=matvec, dtype=A.dtype), **kwargs)

        lanczos_module.eigsh = broken_eigsh
    if fault == "block":
        orthonormalize, calls = block_module._orthonormalize, [0]

        def broken(*args):
            calls[0] += 1
            if calls[0] == 2:
                raise FloatingPointError("the block's QR failed")
            return orthonormalize(*args)

        block_module._orthonormalize = broken
    if fault == "diag":
        import laplace_glas.curvature.complement.diagonal as diagonal_module

        def broken_diagonal(*args):
            raise RuntimeError("BackPACK ran out of memory")

        diagonal_module._batch_diagonal = broken_diagonal
    if fault in ("kron", "auto_kron_refused"):
        import laplace_glas.curvature.complement.kron as kron_module

        def broken_factors(*args, **kwargs):
            if fault == "auto_kron_refused":  # a data-time refusal, as for NaN factors
                raise ValueError("KFAC's factors hold NaN or inf")
            raise RuntimeError("KFAC ran out of memory")

        kron_module._local_factors = broken_factors
    if fault == "after":
        compute = fit_module.compute_eigenpairs

        def broken_compute(*args, **kwargs):
            compute(*args, **kwargs)
            raise ValueError("the residual check failed")

        fit_module.compute_eigenpairs = broken_compute


AFTER_FIT = ("calibrate", "gridsearch", "coverage")


def _after_fit(la, fault: str, rank: int, X, y) -> str:
    """A collective method after a successful fit, whose held-out loader breaks on rank
    1 (the targets of the training shard serve as held-out data); the prior precision
    must be unchanged after the failure.
    """
    held_out = loader(X, y, 8)
    if rank == 1:
        held_out = _BreakingLoader(held_out, 1)
    la.prior_precision = TAU
    before = la.prior_precision.clone()
    try:
        if fault == "calibrate":
            la.calibrate(held_out, coverage=0.8, ks=[2, K], n_samples=20)
        elif fault == "gridsearch":
            la.optimize_prior_precision(
                method="gridsearch", val_loader=held_out, grid_size=3, pred_type="glm"
            )
        else:
            coverage(la, held_out, level=0.8, n_samples=20)
        return "no error"
    except Exception as err:
        unchanged = bool(torch.equal(la.prior_precision, before))
        return f"{type(err).__name__}: {err} (prior unchanged: {unchanged})"


def _fault_worker(rank: int, init_file: str, out_dir: str, fault: str, subset: str) -> None:
    """One rank of a fit where ``fault`` makes rank 1 differ; records what fit did."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, X, y, _, _ = _problem("regression")
        X, y = _shard((X, y), rank, "uneven")
        k, solver = K, "lanczos"
        if rank == 1 and fault == "solver":
            solver = "block"
        if rank == 1 and fault == "weights":
            with torch.no_grad():
                model[0].weight[0, 0] += 0.1
        if rank == 1 and fault == "n_components":
            k = K - 1
        if rank == 1 and fault == "empty":
            X, y = X[:0], y[:0]
        if rank == 1 and fault == "nan":  # the pass at the MAP fails on rank 1
            X = X.clone()
            X[3, 0] = float("nan")
        # 'zero' unless the diag pass is the fault: the fit's passes as counted below
        extra = {"complement": "diag" if fault.startswith("diag") else "zero"}
        extra = {"complement": "kron"} if fault == "kron" else extra
        extra = {"complement": "auto"} if fault == "auto_kron_refused" else extra
        if fault == "block":
            solver = "block"
        if rank == 1 and fault == "loss_fn":  # the summed squared error: 2x the GGN
            extra["loss_fn"] = nn.MSELoss(reduction="sum")
        if rank == 1 and fault == "backend":
            from laplace.curvature import CurvlinopsEF

            extra["backend"] = CurvlinopsEF
        if fault == "auto_prior":  # rank 1's per-weight prior: 'auto' takes 'diag' there
            extra = {"complement": "auto"}
            if rank == 1:
                n_params = sum(p.numel() for p in model.parameters())
                extra["prior_precision"] = torch.ones(n_params, dtype=X.dtype)
        la = Laplace(
            model,
            "regression",
            subset_of_weights=subset,
            hessian_structure="glas",
            n_components=k,
            solver=solver,
            loss_scaling="mean",
            **extra,
        )
        train = loader(X, y, 16)
        if rank == 1:
            _break_solver(fault)
        if fault == "diag_pass3":  # the curvature problem fails before the diagonal
            train = _BreakingLoader(train, 3 if rank == 1 else 10**9)
        if fault == "exit":  # rank 1 dies in the middle of the eigen-solve
            dispatch.default_factor_budget = lambda *args: 0
            train = _BreakingLoader(train, 8 if rank == 1 else 10**9, exit=True)
        if fault == "product":  # curvlinops' operator: one loader pass per product
            dispatch.build_factored_ggn = lambda *args, **kwargs: "refused here"
            dispatch.build_linearized_ggn = lambda *args, **kwargs: "refused here"
            train = _BreakingLoader(train, 8 if rank == 1 else 10**9)
        if fault.startswith("pass"):  # the fit's n-th pass fails on rank 1
            train = _BreakingLoader(train, int(fault[4:]) if rank == 1 else 10**9)
        start = time.perf_counter()
        try:
            la.fit(train)
            outcome = f"eigenpairs {la.eigenvalues.tolist()}"
            if fault in AFTER_FIT:
                outcome = _after_fit(la, fault, rank, X, y)
        except Exception as err:
            outcome = f"{type(err).__name__}: {err}"
        fitted = getattr(la, "H", None) is not None
        Path(out_dir, f"rank{rank}.txt").write_text(f"fitted={fitted}\n{outcome}")
        Path(out_dir, f"seconds{rank}.txt").write_text(f"{time.perf_counter() - start}")
    finally:
        dist.destroy_process_group()


def _run_fault(
    fault: str, subset: str = "all", timeout: float = 60.0, exitcodes=(0, 0), seconds=None
) -> list[str]:
    """Both ranks' outcomes (the text each rank wrote); a hang fails after ``timeout``.
    ``seconds``: a list that receives the time each rank's fit took.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_fault_worker, args=(r, init_file, tmp, fault, subset))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} hung on fault {fault!r}"
        assert tuple(p.exitcode for p in procs) == tuple(exitcodes)
        texts = [Path(tmp, f"rank{r}.txt") for r in range(WORLD)]
        if seconds is not None:
            times = [Path(tmp, f"seconds{r}.txt") for r in range(WORLD)]
            seconds.extend(float(t.read_text()) if t.exists() else None for t in times)
        return [t.read_text() if t.exists() else None for t in texts]


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_different_weights_are_refused_on_every_rank(subset):
    for outcome in _run_fault("weights", subset):
        assert outcome.startswith("fitted=False\nValueError: The ranks' model weights differ")
        assert "rank 0: sum" in outcome and "rank 1: sum" in outcome
        assert "needs the same weights on every rank" in outcome


def test_different_n_components_are_refused_on_every_rank():
    for outcome in _run_fault("n_components"):
        assert outcome.startswith("fitted=False\nValueError: The ranks' settings differ")
        assert f"n_components (rank 0: {K}, rank 1: {K - 1})" in outcome
        assert "model weights" not in outcome


def test_a_different_solver_is_refused_on_every_rank():
    for outcome in _run_fault("solver"):
        assert outcome.startswith("fitted=False\nValueError: The ranks' settings differ")
        assert "solver (rank 0: 'lanczos', rank 1: 'block')" in outcome


def test_a_different_loss_fn_is_refused_on_every_rank():
    for outcome in _run_fault("loss_fn"):
        assert outcome.startswith("fitted=False\nValueError: The ranks' settings differ")
        assert "loss_fn (rank 0: None, rank 1: 'torch.nn.modules.l" in outcome
        assert "loss_fn.reduction (rank 0: None, rank 1: 'sum')" in outcome


def test_a_different_backend_is_refused_on_every_rank():
    for outcome in _run_fault("backend"):
        assert outcome.startswith("fitted=False\nValueError: The ranks' settings differ")
        assert "curvature (the backend's matrix) (rank 0: 'ggn', rank 1: 'ef')" in outcome


def test_auto_resolving_differently_is_refused_on_every_rank_within_seconds():
    """A per-weight prior on one rank makes 'auto' run the diagonal's passes there and
    KFAC's on the other: refused before either (it waited in mismatched collectives).
    """
    seconds = []
    for outcome in _run_fault("auto_prior", timeout=60.0, seconds=seconds):
        assert outcome.startswith("fitted=False\nValueError: The ranks' settings differ")
        assert "complement's passes ('auto' before data) (rank 0: 'kron', rank 1: 'diag')" in (
            outcome
        )
        assert "prior precision's shape" in outcome
    assert max(seconds) < 30.0


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_an_empty_shard_is_refused_on_every_rank(subset):
    for outcome in _run_fault("empty", subset):
        assert outcome == (
            "fitted=False\nValueError: The training shard of rank 1 is empty: a "
            "data-parallel fit needs data on every rank (give every rank a non-empty "
            "shard, or fit on a process group of the ranks that have data)."
        )


def test_a_failed_pass_at_the_map_reaches_every_rank():
    rank0, rank1 = _run_fault("nan")
    assert rank1.startswith("fitted=False\nValueError: The training inputs")
    assert rank0 == (
        "fitted=False\nRuntimeError: The pass at the MAP failed on rank(s) 1 (see the error "
        "there): no rank fits."
    )


def test_a_failed_product_in_the_eigen_solve_reaches_every_rank():
    rank0, rank1 = _run_fault("product")
    assert rank1 == "fitted=False\nOSError: the loader broke on pass 8"
    assert rank0.startswith(
        "fitted=False\nRuntimeError: The eigen-solve failed on rank(s) 1 (see the error "
        "there) at GGN product "
    )
    assert rank0.endswith(": no rank returns eigenpairs.")


@pytest.mark.parametrize(
    ("fault", "error", "where"),
    [
        ("arpack", "MemoryError: ARPACK's workspace could not be allocated", "at GGN product 3"),
        ("block", "FloatingPointError: the block's QR failed", "at GGN product 2"),
        ("after", "ValueError: the residual check failed", "after GGN product "),
    ],
)
def test_a_failure_in_the_solvers_arithmetic_reaches_every_rank(fault, error, where):
    # the solver itself (not a product) fails on rank 1 between two products, or after
    # the last one: rank 0 learns it in its next product's status or the closing status
    rank0, rank1 = _run_fault(fault)
    assert rank1 == f"fitted=False\n{error}"
    assert rank0.startswith(
        f"fitted=False\nRuntimeError: The eigen-solve failed on rank(s) 1 (see the error "
        f"there) {where}"
    )
    assert rank0.endswith(": no rank returns eigenpairs.")


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("diag", "RuntimeError: BackPACK ran out of memory"),
        ("diag_pass3", "OSError: the loader broke on pass 3"),  # a step before it
    ],
)
def test_a_failed_diag_complement_pass_reaches_every_rank(fault, error):
    rank0, rank1 = _run_fault(fault)
    assert rank1 == f"fitted=False\n{error}"
    assert rank0 == (
        "fitted=False\nRuntimeError: Rank(s) 1 failed (see the error there) while this rank "
        "was computing the GGN diagonal of complement='diag': no rank fits."
    )


def test_a_rank_that_dies_mid_solve_ends_the_other_at_once():
    seconds = []
    rank0, rank1 = _run_fault("exit", exitcodes=(0, 3), seconds=seconds)
    assert rank1 is None  # it died without writing
    assert rank0.startswith("fitted=False\nRuntimeError: torch.distributed's all-reduce failed (")
    assert "another rank has probably exited or lost its connection" in rank0
    assert seconds[0] < 20  # gloo's own timeout is 30 minutes
    print(f"rank 0 ended {seconds[0]:.2f} s after its fit started: {rank0}")


@pytest.mark.parametrize("fail_at", [3, 4])
def test_a_failure_between_the_map_and_the_solve_reaches_every_rank(fail_at):
    # pass 3: the first batch of the curvature problem; pass 4: the factored operator
    rank0, rank1 = _run_fault(f"pass{fail_at}")
    assert rank1 == f"fitted=False\nOSError: the loader broke on pass {fail_at}"
    assert rank0 == (
        "fitted=False\nRuntimeError: Rank(s) 1 failed (see the error there) while this rank "
        "was agreeing on the GGN operator: no rank returns eigenpairs."
    )


@pytest.mark.parametrize(
    ("fault", "step"),
    [
        ("calibrate", "scoring the calibration's coverage"),
        ("coverage", "scoring the calibration's coverage"),
        ("gridsearch", "scoring the grid search's validation shard"),
    ],
)
def test_a_failure_in_a_collective_after_the_fit_reaches_every_rank(fault, step):
    rank0, rank1 = _run_fault(fault)
    assert rank1 == ("fitted=True\nOSError: the loader broke on pass 1 (prior unchanged: True)")
    assert rank0 == (
        f"fitted=True\nRuntimeError: Rank(s) 1 failed (see the error there) while this rank "
        f"was {step}: no rank returns a result. (prior unchanged: True)"
    )


@pytest.mark.parametrize("complement", ["kron", "auto"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_kron_complement_on_two_ranks_equals_one_process(ranks, likelihood, complement):
    """KFAC's factors summed over the ranks: 'kron' (and 'auto', which resolves to it
    in one process and now also on two ranks) gives the single-process posterior.
    """
    one = _complement_summary(*_problem(likelihood), complement, None)
    assert one["complement"] == "kron"
    for rank in ranks:
        got = rank[("complement", likelihood, complement)]
        assert got["complement"] == "kron"
        _close(got["values"], one["values"])
        for key in ("evidence", "trace"):
            _close(got[key], one[key])
        _close(got["predictive"], one["predictive"])


def test_a_data_time_refusal_under_auto_ends_the_fit_on_every_rank():
    """Rank 1's KFAC pass refuses its data under 'auto': it used to move on to
    'kron_diag' alone and wait in that pass's collectives (gloo's timeout) while rank 0
    had left; now both ranks end at once."""
    seconds = []
    rank0, rank1 = _run_fault("auto_kron_refused", timeout=60.0, seconds=seconds)
    assert rank1 == "fitted=False\nValueError: KFAC's factors hold NaN or inf"
    assert rank0.startswith("fitted=False\nRuntimeError: Rank(s) 1 failed")
    assert max(seconds) < 30.0


def test_a_failed_kron_complement_pass_reaches_every_rank():
    rank0, rank1 = _run_fault("kron")
    assert rank1 == "fitted=False\nRuntimeError: KFAC ran out of memory"
    assert rank0 == (
        "fitted=False\nRuntimeError: Rank(s) 1 failed (see the error there) while this rank "
        "was computing KFAC's factors of complement='kron': no rank fits."
    )
