"""The dual (Gram) eigen-solve of the factored mean-loss GGN.

With ``S`` the ``M x D`` matrix of scaled per-example Jacobian rows
(:mod:`laplace_glas.curvature.operators.factored`, ``M = N R``), ``G_1 = S^T S`` and the Gram
(empirical NTK) matrix ``K = S S^T`` share their non-zero eigenvalues:

.. math::

    K w_j = \\lambda_j w_j \\;\\Longrightarrow\\;
    G_1 u_j = \\lambda_j u_j, \\qquad u_j = S^\\top w_j / \\sqrt{\\lambda_j},

with ``u_j`` orthonormal when the ``w_j`` are. ``K`` is built layer by layer from the
factors: for a weight applied once per example (``T = 1``) its block is the Hadamard
product ``(G G^T) o (A A^T)`` of the output-side and input-side Gram matrices
(``M^2 d_out + N^2 d_in`` multiply-adds instead of ``M^2 d_out d_in``); for a weight
applied at ``T > 1`` positions the per-example Jacobian ``sum_t g_t a_t^T`` is formed in
chunks of output channels; explicit Jacobians (biases, normalisation affines) add
``J J^T``; embeddings go through ``S (S^T E)`` with unit blocks ``E``.

The residual of each pair needs no product in ``D`` dimensions:
``G_1 u - lambda u = S^T (K w - lambda w) / sqrt(lambda)``, so
``||G_1 u - lambda u||^2 = e^T K e / lambda`` with ``e = K w - lambda w``.

Memory: ``K`` in the factors' precision plus its build's temporaries (on the CPU three
chunks of at most ``2^20`` numbers: the upper triangle is built a column chunk at a time;
elsewhere a layer's block and its Hadamard factor), and the ``(D, k)`` eigenvectors;
the planner counts them in the dual strategy's estimate (:func:`gram_fits` is the rule
for a solve called on an operator directly).
"""

from __future__ import annotations

import queue
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.linalg import blas
from scipy.sparse.linalg import LinearOperator, eigsh

from laplace_glas.curvature.memory.budget import GRAM_CHUNK_ELEMENTS, gram_build_numbers
from laplace_glas.curvature.operators.factored import (
    EmbeddingFactor,
    ExplicitFactor,
    FactoredGGN,
    OuterFactor,
)
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.solvers.block_krylov import block_krylov_eigenpairs
from laplace_glas.curvature.solvers.threads import single_threaded_openblas

__all__ = [
    "choose_solver",
    "dual_eigenpairs",
    "factored_solver",
    "gram_bytes",
    "gram_fits",
    "gram_flops",
    "gram_matrix",
    "gram_workers",
    "lanczos_products",
]

GRAM_MIN_BUDGET = 768 * 2**20
"""Bytes the Gram matrix may always take (see :func:`gram_fits`)."""
CHUNK_ELEMENTS = 2**25
_ARPACK_MAX_K = 16  # above, block Krylov on K (k columns per read of K) is faster

GramTerm = tuple[torch.Tensor, "torch.Tensor | None"]
"""``(X, A)``: the Gram block ``(X X^T) o (A A^T)``, or ``X X^T`` where ``A`` is ``None``."""


def gram_workers() -> int:
    """Threads of the CPU Gram build: torch's intra-op thread count."""
    return max(1, torch.get_num_threads())


def _itemsize(op: FactoredGGN) -> int:
    return torch.finfo(op.torch_dtype).bits // 8


def gram_bytes(op: FactoredGGN) -> int:
    """Peak bytes of :func:`gram_matrix` in the factors' precision: ``K`` and its
    build's temporaries (:func:`~laplace_glas.curvature.memory.budget.gram_build_numbers`).
    """
    return gram_build_numbers(op.n_examples * op.n_rows, op.device) * _itemsize(op)


def gram_fits(op: FactoredGGN, k: int, budget: int | None = None) -> bool:
    """``k < M`` and ``gram_bytes <= budget``; without a budget (a direct call of
    :func:`~laplace_glas.curvature.solvers.solve.compute_eigenpairs`) the rule
    ``gram_bytes <= max(768 MiB, k D itemsize)``. A fit's planner passes what its
    memory budget leaves (:mod:`~laplace_glas.curvature.memory.planner`).
    """
    M = op.n_examples * op.n_rows
    if budget is None:
        budget = max(GRAM_MIN_BUDGET, k * op.shape[0] * _itemsize(op))
    return k < M and gram_bytes(op) <= budget


def gram_flops(op: FactoredGGN) -> int:
    """Flops of building ``K`` from the factors (symmetric rank-k updates)."""
    N, R = op.n_examples, op.n_rows
    M = N * R
    flops = 0
    for f in op.factors:
        if isinstance(f, OuterFactor):
            d_out, d_in = f.shape
            T = f.a.shape[1]
            if T == 1:
                flops += M * M * d_out + N * N * d_in
            else:
                flops += M * M * f.numel + 2 * M * T * f.numel
        elif isinstance(f, ExplicitFactor):
            flops += M * M * f.J.shape[-1]
        else:
            flops += M * f.cost()
    return flops


class SymmetricGram:
    """``K`` built as its upper triangle (CPU: a Fortran array for BLAS ``syrk``, half
    the flops of a GEMM) or as a full tensor (other devices). On the CPU
    :meth:`complete` fills the lower half, and :meth:`matmat` multiplies by the full
    matrix with torch's threaded GEMM: on the 2-core CPU at ``M = 2,000`` one column took
    0.33 ms against 2.3 ms by single-threaded ``symv`` on the triangle, 10 columns 0.9
    against 2.9 ms, 62 columns 3.4 against 5.5 ms.
    """

    def __init__(self, M: int, dtype: torch.dtype, device: torch.device):
        self.cpu = torch.device(device).type == "cpu"
        self.M, self.dtype, self.device = M, dtype, device
        self.full: torch.Tensor | None = None  # the completed CPU matrix
        self._lower_current = True  # the CPU array's lower triangle is K's too
        if self.cpu:
            self.K = np.zeros((M, M), dtype=NUMPY_DTYPES[dtype], order="F")
            self._syrk = blas.get_blas_funcs("syrk", (self.K,))
        else:
            self.K = torch.zeros(M, M, dtype=dtype, device=device)

    def rank_update(self, X: torch.Tensor) -> None:
        """``K += X X^T`` (on the CPU its upper triangle; :meth:`complete` mirrors it)."""
        if not self.cpu:
            self.K += X @ X.T
            return
        self._lower_current = False
        # X^T is Fortran-ordered when X is C-ordered: trans=1 reads it without a copy
        Xn = X.detach().cpu().numpy()
        self.K = self._syrk(1.0, Xn.T, beta=1.0, c=self.K, trans=1, overwrite_c=1)

    def add_products(self, terms: list[GramTerm], R: int = 1) -> None:
        """``K += sum_i (X_i X_i^T) o (A_i A_i^T expanded over the R x R blocks)``
        (``X_i X_i^T`` alone where ``A_i`` is ``None``).

        Each ``X_i`` is ``(N R, d)`` (rows example-major), each ``A_i`` ``(N, d')``. On the
        CPU the upper triangle is built in column chunks of ``c`` examples, all terms of a
        chunk together: ``K[:j1, j0:j1] += sum_i (X_i[:j1] X_i[j0:j1]^T) o
        (A_i[:n1] A_i[n0:n1]^T)`` (one ``gemm`` per factor), by :func:`gram_workers`
        threads. That is about the flops of two ``syrk`` calls per term, but the chunk's
        blocks and their running sum stay in cache (the sum is written to ``K`` once, not
        once per layer: 27 against 33 ms at ``N = 2,000`` for a 10-300-300-1 MLP), and no
        ``M x M`` temporary is allocated (fresh ``M x M`` arrays cost a page fault per
        4 KiB on first touch, half the build's time in a new process). While the lower
        triangle is current (no ``syrk`` update came first), each chunk also adds its
        rows left of the diagonal, from cache, so that :meth:`complete` has nothing to do.
        """
        if not terms:
            return
        N = self.M // R
        if not self.cpu:
            for X, A in terms:
                block = X @ X.T
                if A is not None:
                    block = block.view(N, R, N, R) * (A @ A.T)[:, None, :, None]
                self.K += block.view(self.M, self.M)
            return
        # single-threaded BLAS calls from a pool of threads taking chunks from a queue: threaded
        # GEMMs on small chunks stall when another process holds a core, a queue does not
        dtype = self.K.dtype

        def fortran(t: torch.Tensor | None) -> np.ndarray | None:
            # t^T is Fortran-ordered when t is C-ordered: no copy
            return None if t is None else t.detach().cpu().numpy().T.astype(dtype, copy=False)

        pairs = [(fortran(X), fortran(A)) for X, A in terms]
        mirror = self._lower_current
        workers = gram_workers()
        chunk = GRAM_CHUNK_ELEMENTS // (self.M * R * workers)
        chunk = max(1, min(chunk, -(-N // (4 * workers))))  # >= 4 chunks a worker
        buffers: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):  # reused: no page faults after the first chunk
            size = self.M * chunk * R
            buffers.put((np.empty(size, dtype), np.empty(size, dtype), np.empty(N * chunk, dtype)))

        def update(n0: int) -> None:
            n1 = min(N, n0 + chunk)
            j0, j1 = n0 * R, n1 * R
            sums, blocks, hadamards = buffers.get()
            try:  # the buffers go back even on an error: no other chunk waits forever
                # NumPy's matmul releases the GIL (SciPy's BLAS wrappers do not); the
                # transposed products fill C-ordered buffers, i.e. Fortran-ordered blocks
                total = sums[: j1 * (j1 - j0)].reshape(j1 - j0, j1)
                for i, (Xt, At) in enumerate(pairs):
                    block = total if i == 0 else blocks[: j1 * (j1 - j0)].reshape(j1 - j0, j1)
                    np.matmul(Xt[:, j0:j1].T, Xt[:, :j1], out=block)
                    if At is not None:
                        H = hadamards[: n1 * (n1 - n0)].reshape(n1 - n0, n1)
                        np.matmul(At[:, n0:n1].T, At[:, :n1], out=H)
                        if R == 1:
                            block *= H
                        else:  # (n, R, n1, R) view of the C-ordered block
                            block.reshape(n1 - n0, R, n1, R)[...] *= H[:, None, :, None]
                    if i:
                        total += block
                self.K[:j1, j0:j1] += total.T  # chunks write disjoint columns
                if mirror:  # and rows, left of the diagonal block, while in cache
                    self.K[j0:j1, :j0] += total[:, :j0]
            finally:
                buffers.put((sums, blocks, hadamards))

        starts = range(0, N, chunk)[::-1]  # the largest (rightmost) chunks first
        if workers == 1:
            for n0 in starts:
                update(n0)
            return
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(update, starts))  # re-raises a worker's exception

    def add(self, block: torch.Tensor) -> None:
        """``K += block`` for a full symmetric ``block``."""
        if self.cpu:
            self.K += block.cpu().numpy()
        else:
            self.K += block

    def complete(self) -> None:
        """Mirror the upper triangle into the lower where a ``syrk`` update left it behind
        (CPU), so that :meth:`matmat` reads the full matrix. No update may follow.
        """
        if not self.cpu:
            self.full = self.K
            return
        if self._lower_current:
            self.full = torch.from_numpy(self.K.T)
            return
        chunk = max(1, GRAM_CHUNK_ELEMENTS // self.M)
        for j0 in range(0, self.M, chunk):  # rows left of the diagonal block, then it
            j1 = min(self.M, j0 + chunk)
            self.K[j0:j1, :j0] = self.K[:j0, j0:j1].T
            block = self.K[j0:j1, j0:j1]
            block[...] = np.triu(block) + np.triu(block, 1).T
        self.full = torch.from_numpy(self.K.T)  # C-ordered; K^T = K

    def matmat(self, W: np.ndarray) -> np.ndarray:
        """``K W`` in float64 NumPy (``W`` of shape ``(M,)`` or ``(M, p)``); completes
        ``K`` first where it is not yet (:meth:`complete`).
        """
        if self.full is None:
            self.complete()
        Wt = torch.as_tensor(W, dtype=self.dtype, device=self.device)
        return (self.full @ Wt).double().cpu().numpy()


def _outer_term(f: OuterFactor, N: int, R: int) -> GramTerm | None:
    """The :meth:`SymmetricGram.add_products` term of a weight applied once per example
    (``None`` for one applied at ``T > 1`` positions, see :func:`_positions_update`).

    One output (``R = 1``, ``d_out = 1``) or one input makes the Hadamard product a
    single Gram matrix: ``(g g^T) o (A A^T) = (g o A)(g o A)^T``.
    """
    if f.a.shape[1] != 1:
        return None
    a = f.a[:, 0]
    if f.bias_offset is not None:  # the bias: a constant input 1
        a = torch.cat([a, a.new_ones(N, 1)], -1)
    X = f.g[:, :, 0].reshape(N * R, -1)
    if a.shape[1] == 1:
        return X * a.repeat_interleave(R, 0), None
    if R == 1 and X.shape[1] == 1:
        return a * X, None
    return X, a


def _positions_update(K: SymmetricGram, f: OuterFactor, N: int, R: int) -> None:
    """``K += S_f S_f^T`` for a weight applied at ``T > 1`` positions: the per-example
    Jacobians ``sum_t g_t a_t^T``, formed in chunks of output channels.
    """
    d_out, d_in = f.shape
    M = N * R
    a = f.a
    if f.bias_offset is not None:  # the bias: a constant input 1
        a = torch.cat([a, a.new_ones(*a.shape[:2], 1)], -1)
    chunk = max(1, CHUNK_ELEMENTS // max(1, M * (d_in + 1)))
    for o in range(0, d_out, chunk):
        K.rank_update(torch.einsum("nrto,nti->nroi", f.g[..., o : o + chunk], a).reshape(M, -1))


def _product_block(op: FactoredGGN, f: EmbeddingFactor) -> torch.Tensor:
    """``S_f S_f^T`` through products with unit blocks (any factor type)."""
    N, R = op.n_examples, op.n_rows
    M = N * R
    K = torch.empty(M, M, dtype=op.torch_dtype, device=op.device)
    block = max(1, min(M, CHUNK_ELEMENTS // max(1, op.shape[0])))
    for start in range(0, M, block):
        stop = min(M, start + block)
        E = torch.zeros(stop - start, M, dtype=op.torch_dtype, device=op.device)
        E[:, start:stop].fill_diagonal_(1.0)
        out = torch.zeros(stop - start, op.shape[0], dtype=op.torch_dtype, device=op.device)
        f.apply_transpose(E.view(-1, N, R), out)
        K[:, start:stop] = f.apply(out).reshape(stop - start, M).T
    return K


def gram_matrix(op: FactoredGGN) -> SymmetricGram:
    """``K = S S^T`` (``(N R) x (N R)``, rows ordered example-major)."""
    N, R = op.n_examples, op.n_rows
    K = SymmetricGram(N * R, op.torch_dtype, op.device)
    terms: list[GramTerm] = []
    later = []  # factors without a term: added after the terms
    for f in op.factors:
        if isinstance(f, ExplicitFactor):
            terms.append((f.J.reshape(N * R, -1), None))
        elif isinstance(f, OuterFactor) and (term := _outer_term(f, N, R)) is not None:
            terms.append(term)
        else:
            later.append(f)
    K.add_products(terms, R)  # first: both triangles built while K is zero
    for f in later:
        if isinstance(f, OuterFactor):
            _positions_update(K, f, N, R)
        else:
            K.add(_product_block(op, f))
    K.complete()
    return K


def _top_eigenpairs(K: SymmetricGram, k: int, tol: float, generator, rank_threshold: float):
    """Top-``k`` eigenpairs of ``K``: ARPACK for small ``k``, block Krylov (one
    product per pass reads ``K`` once for the whole block) for larger ``k``.

    The block basis is float64 also for a float32 ``K``: a float32 basis was 25% faster
    at ``M = 2,000``, ``k = 50`` but left the small pairs' true residuals twice and their
    reported ones four times as large.
    """
    M = K.M
    if k <= _ARPACK_MAX_K:
        v0 = torch.randn(M, generator=generator, dtype=torch.float64).numpy()
        operator = LinearOperator((M, M), matvec=K.matmat, matmat=K.matmat, dtype=np.float64)
        values, W = eigsh(operator, k=k, which="LA", tol=tol, v0=v0)
        return values, W, k
    eps = torch.finfo(K.dtype).eps
    result = block_krylov_eigenpairs(
        lambda V: torch.from_numpy(K.matmat(V.cpu().numpy())),
        M,
        k,
        block_size=k + max(8, k // 4),
        tol=tol if tol > 0 else (1e-5 if K.dtype == torch.float32 else 1e-8),
        max_passes=100,
        rank_threshold=max(rank_threshold, 100 * eps),
        generator=generator,
    )
    values = result.values.numpy()
    W = result.vectors.numpy()
    if values.size < k:  # rank below k: complete with zero pairs
        extra = np.linalg.qr(np.random.default_rng(0).standard_normal((M, k - values.size)))[0]
        W = np.linalg.qr(np.concatenate([W, extra], 1))[0]
        values = np.concatenate([values, np.zeros(k - values.size)])
    return values, W, int(result.converged.sum())


def dual_eigenpairs(
    op: FactoredGGN,
    k: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    tol: float = 0.0,
    generator: torch.Generator | None = None,
    rank_threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Top-``k`` eigenpairs of ``G_1 = S^T S`` through ``K = S S^T``.

    Parameters
    ----------
    op : FactoredGGN
        The factored operator (``M = N R`` rows, ``k < M``).
    k : int
        Number of eigenpairs.
    dtype, device : torch.dtype, torch.device
        Precision and device of the returned tensors.
    tol : float
        Relative accuracy of the eigen-solve on ``K`` (``0``: machine precision for
        ARPACK, used up to 16 pairs; ``1e-5`` in float32 and ``1e-8`` in float64 for the
        block Krylov solver above). ``K`` is never diagonalised densely: on one thread
        LAPACK's partial ``syevx``/``syevr`` took as long as block Krylov at
        ``M = 2,000``, ``k = 50``.
    generator : torch.Generator, optional
        Source of the Lanczos start vector.
    rank_threshold : float
        Eigenvectors of eigenvalues below ``rank_threshold * lambda_1`` cannot be
        recovered as ``S^T w / sqrt(lambda)``; they are completed to an orthonormal
        set by QR instead (their eigenvalues are reported as zero by the caller).

    Returns
    -------
    tuple
        ``values (k,)`` descending, ``vectors (D, k)``, residual norms
        ``||G_1 u - lambda u|| (k,)``, products (``k``: one ``S^T`` pass with ``k``
        columns), converged count and operator calls (1).

    """
    M = op.n_examples * op.n_rows
    if not 1 <= k < M:
        raise ValueError(
            f"The dual solve finds at most {M - 1} eigenpairs (N R = {M} Jacobian rows); "
            f"k={k} was asked for: use solver='lanczos'."
        )
    with single_threaded_openblas():
        K = gram_matrix(op)
        values, W, n_converged = _top_eigenpairs(K, k, tol, generator, rank_threshold)
        order = np.argsort(values)[::-1]
        values, W = values[order], np.ascontiguousarray(W[:, order])
        E = K.matmat(W) - W * values
        res_sq = np.maximum((E * K.matmat(E)).sum(0), 0.0)
    top = max(values[0], 0.0)
    good = values > max(rank_threshold * top, np.finfo(np.float64).tiny)

    residual_norms = torch.from_numpy(
        np.where(good, np.sqrt(res_sq / np.where(good, values, 1.0)), np.inf)
    )

    scale = np.where(good, 1.0 / np.sqrt(np.where(good, values, 1.0)), 1.0)
    Y = (W * scale).T.reshape(k, op.n_examples, op.n_rows)
    U = op.apply_transpose(
        torch.from_numpy(np.ascontiguousarray(Y)).to(op.device, op.torch_dtype)
    ).T
    if not good.all():  # complete the unrecoverable directions to an orthonormal set
        n_good = int(good.sum())
        gen = torch.Generator().manual_seed(0) if generator is None else generator
        U = U.to(torch.float64)
        U[:, n_good:] = torch.randn(U.shape[0], k - n_good, generator=gen, dtype=torch.float64).to(
            U.device
        )
        Q, Rf = torch.linalg.qr(U)
        U = Q * torch.sign(torch.diagonal(Rf))
    return (
        torch.from_numpy(values).to(device=device, dtype=dtype),
        U.to(device=device, dtype=dtype),
        residual_norms.to(device=device, dtype=dtype),
        k,
        n_converged,
        1,
    )


def lanczos_products(k: int) -> int:
    """Products ARPACK typically spends on ``k`` pairs to machine precision."""
    return 3 * max(2 * k + 1, 20) + k


def choose_solver(operator, k: int, gram_budget: int | None = None) -> str:
    """``'dual'`` or ``'lanczos'`` for ``solver='auto'``.

    Dual when the operator is factored, ``K`` fits :func:`gram_fits` (within
    ``gram_budget`` bytes where given) and building and solving it (``gram_flops + k``
    columns of ``S^T``) costs less than :func:`lanczos_products` factored products.
    """
    if not isinstance(operator, FactoredGGN) or not gram_fits(operator, k, gram_budget):
        return "lanczos"
    M = operator.n_examples * operator.n_rows
    dual = gram_flops(operator) + 6 * M * M * max(2 * k + 1, 20) + k * operator.column_cost // 2
    primal = lanczos_products(k) * operator.column_cost
    return "dual" if dual <= primal else "lanczos"


def factored_solver(op: FactoredGGN, solver: str, k: int, lanczos: bool, dual: bool) -> str:
    """The solver on the factored operator ``op`` for ``solver`` and ``k`` pairs: the
    requested one where it fits (``lanczos`` / ``dual``: whether Lanczos's basis / the
    Gram matrix fit the budget), else the one that fits (a warning where a requested
    dual solve does not); ``'auto'``: the cheaper of those that fit
    (:func:`choose_solver`).
    """
    if solver == "block":
        return "block"
    if solver == "dual" and not dual:
        warnings.warn(
            "solver='dual': the Gram matrix does not fit the memory budget; using Lanczos "
            "on the factored operator.",
            UserWarning,
            stacklevel=4,
        )
        return "lanczos"
    if solver == "dual" or not lanczos:
        return "dual"
    if solver == "factored" or not dual:
        return "lanczos"
    # the rule of a direct solve caps K too: beyond it, reading K for each of ARPACK's
    # products is bound by memory bandwidth, which the flop count does not see
    return choose_solver(op, k)
