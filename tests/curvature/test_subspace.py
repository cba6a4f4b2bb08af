"""The matrix-free mean-loss GGN and its Lanczos eigenpairs vs an explicit GGN."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import explicit_jacobian, loader, mlp, regression_data
from scipy.sparse.linalg import LinearOperator
from torch import nn

from laplace_glas.curvature.operators.curvlinops import mean_ggn_operator
from laplace_glas.curvature.solvers.eigenpairs import LanczosConvergenceWarning
from laplace_glas.curvature.solvers.solve import compute_eigenpairs


def explicit_mean_ggn(model, X, sigma=1.0):
    """G = (1/N) sum_n J_n^T J_n / sigma^2 for the Gaussian likelihood."""
    J = explicit_jacobian(model, X)
    return J.T @ J / (X.shape[0] * sigma**2)


def operator_matmat(model, X, y, V, batch_size=32):
    C = y.shape[1]
    op = mean_ggn_operator(
        model, nn.MSELoss(), list(model.parameters()), loader(X, y, batch_size), X.shape[0]
    )
    return (op @ V) * (C / 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_matrix_free_product_matches_explicit_ggn_figure1(toy_regression, dtype, tol):
    """Paper's Figure 1: matrix-free G v equals the explicitly formed G v (D = 2701)."""
    model, X, y = toy_regression
    model = mlp([1, 50, 50, 1], dtype=dtype)
    model.load_state_dict(toy_regression[0].state_dict())
    X, y = X.to(dtype), y.to(dtype)
    G = explicit_mean_ggn(model.double(), X.double()).to(dtype)
    model = model.to(dtype)
    assert G.shape == (2701, 2701)
    V = torch.randn(2701, 5, generator=torch.Generator().manual_seed(0), dtype=dtype)
    GV = operator_matmat(model, X, y, V)
    err = (GV.double() - G.double() @ V.double()).abs().max() / (
        G.double() @ V.double()
    ).abs().max()
    assert err < tol, f"relative error {err:.2e}"


def test_multi_output_rescaling_matches_gaussian_ggn():
    """MSELoss(mean) averages over outputs too; the C/2 rescaling restores (1/N) sum J^T J."""
    X, y = regression_data(40, d_in=2, d_out=3, dtype=torch.float64)
    model = mlp([2, 6, 3], dtype=torch.float64)
    G = explicit_mean_ggn(model, X)
    V = torch.randn(G.shape[0], 4, dtype=torch.float64)
    GV = operator_matmat(model, X, y, V, batch_size=7)
    torch.testing.assert_close(GV, G @ V, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "dtype, val_tol, vec_tol", [(torch.float32, 1e-4, 1e-3), (torch.float64, 1e-9, 1e-8)]
)
def test_eigenpairs_match_eigh_of_explicit_ggn(toy_regression, dtype, val_tol, vec_tol):
    model32, X, y = toy_regression
    model = mlp([1, 50, 50, 1], dtype=dtype)
    model.load_state_dict(model32.state_dict())
    X, y = X.to(dtype), y.to(dtype)
    G = explicit_mean_ggn(model.double(), X.double())
    model = model.to(dtype)
    ref_vals, ref_vecs = torch.linalg.eigh(G)
    ref_vals, ref_vecs = ref_vals.flip(0)[:6], ref_vecs.flip(1)[:, :6]
    op = mean_ggn_operator(model, nn.MSELoss(), list(model.parameters()), loader(X, y), 100)
    eig = compute_eigenpairs(
        op, 6, scale=0.5, dtype=dtype, generator=torch.Generator().manual_seed(0)
    )
    assert eig.values.dtype == dtype and eig.vectors.shape == (2701, 6)
    assert torch.all(eig.values[:-1] >= eig.values[1:]), "eigenvalues must be descending"
    torch.testing.assert_close(eig.values.double(), ref_vals, rtol=val_tol, atol=0)
    gram = eig.vectors.double().T @ eig.vectors.double()
    torch.testing.assert_close(gram, torch.eye(6, dtype=torch.float64), atol=vec_tol, rtol=0)
    overlap = (eig.vectors.double().T @ ref_vecs).abs().diagonal()
    assert torch.all(overlap > 1 - vec_tol), overlap
    assert eig.n_products > 6 and eig.wall_time > 0
    assert eig.n_passes == eig.n_products - 6 + 1  # single products + one 6-column check
    assert torch.all(eig.residuals < 1e-3)


def _diag_operator(values: np.ndarray) -> LinearOperator:
    return LinearOperator(
        (len(values), len(values)), matvec=lambda v: values * v.ravel(), dtype=np.float64
    )


def test_unconverged_lanczos_warns_with_count_and_keeps_converged_pairs():
    # three separated eigenvalues converge at once; the cluster near 1 does not
    values = np.concatenate([[10.0, 9.0, 8.0], np.linspace(1.0, 1.001, 397)])
    with pytest.warns(LanczosConvergenceWarning, match="did not converge for 3 of the 6"):
        eig = compute_eigenpairs(
            _diag_operator(values),
            6,
            dtype=torch.float64,
            maxiter=2,
            ncv=8,
            generator=torch.Generator().manual_seed(0),
        )
    assert eig.n_converged == 3 and eig.k == 3 and eig.n_requested == 6
    torch.testing.assert_close(eig.values, torch.tensor([10.0, 9.0, 8.0], dtype=torch.float64))


def test_no_converged_pair_is_a_clear_error():
    values = np.linspace(1.0, 1.001, 400)
    with pytest.raises(RuntimeError, match="did not converge for any"):
        compute_eigenpairs(
            _diag_operator(values),
            6,
            dtype=torch.float64,
            maxiter=1,
            ncv=8,
            generator=torch.Generator().manual_seed(0),
        )


def test_non_finite_product_raises():
    op = LinearOperator((10, 10), matvec=lambda v: np.full(10, np.nan), dtype=np.float64)
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        compute_eigenpairs(op, 2, dtype=torch.float64)


@pytest.mark.parametrize("k", [0, 10, 11])
def test_k_outside_eigsh_limit_raises(k):
    with pytest.raises(ValueError, match="1 <= k < D"):
        compute_eigenpairs(_diag_operator(np.arange(10.0)), k, dtype=torch.float64)


def test_below_threshold_eigenvalues_are_flagged_and_zeroed():
    values = np.array([1.0, 0.5, 1e-18, 1e-19, 0, 0, 0, 0, 0, 0])
    eig = compute_eigenpairs(
        _diag_operator(values), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    assert eig.below_threshold.tolist() == [False, False, True, True]
    assert eig.values[2:].abs().max() == 0


def test_repr_is_one_short_line_without_tensor_contents():
    values = np.concatenate([np.linspace(5.0, 1.0, 5), np.zeros(495)])
    eig = compute_eigenpairs(
        _diag_operator(values), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    text = repr(eig)
    assert "\n" not in text and len(text) < 250, text
    assert text.startswith("Eigenpairs(k=4, D=500, dtype=torch.float64, solver='lanczos'")
    assert "eigenvalues [2, 5]" in text and f"{eig.n_products} products" in text
    assert "tensor(" not in text
    assert str(eig) == text


def test_repr_max_residual_leaves_out_pairs_below_the_rank_threshold():
    """A rank-3 operator asked for 6 pairs: the 3 round-off pairs have relative
    residuals of order eps * lambda_1 / eps (huge); the repr reports the kept pairs'.
    """
    values = np.concatenate([np.array([5.0, 3.0, 1.0]), np.zeros(197)])
    eig = compute_eigenpairs(
        _diag_operator(values), 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    assert eig.below_threshold.tolist() == [False] * 3 + [True] * 3
    kept = float(eig.residuals[:3].max())
    assert kept < 1e-8
    assert f"max residual {kept:.2g}," in repr(eig)


def test_solve_is_reproducible_with_generator(toy_regression):
    model, X, y = toy_regression
    op = mean_ggn_operator(model, nn.MSELoss(), list(model.parameters()), loader(X, y), 100)
    a = compute_eigenpairs(op, 3, scale=0.5, generator=torch.Generator().manual_seed(3))
    b = compute_eigenpairs(op, 3, scale=0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.values, b.values) and torch.equal(a.vectors, b.vectors)


def test_truncate_keeps_leading_pairs(toy_regression):
    model, X, y = toy_regression
    op = mean_ggn_operator(model, nn.MSELoss(), list(model.parameters()), loader(X, y), 100)
    eig = compute_eigenpairs(op, 4, scale=0.5, generator=torch.Generator().manual_seed(0))
    t = eig.truncate(2)
    assert t.k == 2 and torch.equal(t.vectors, eig.vectors[:, :2])
    with pytest.raises(ValueError):
        eig.truncate(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [3, 10, 40])
def test_block_solver_matches_lanczos(toy_regression, k, dtype):
    """The block Krylov solver finds the same eigenpairs as ARPACK (rank ~20 here, so
    k = 40 also exercises the numerically-zero tail).

    Eigenvalues agree to 1e-4 relative, and in float32 to the products' resolution
    ``10 eps lambda_1`` below that: both solvers see the GGN only through float32
    products, so eigenvalues under ~1e-3 lambda_1 are not determined to 1e-4 relative
    by either (the block basis is orthogonalised in the products' precision).
    """
    model, X, y = toy_regression
    model = copy.deepcopy(model).to(dtype)
    X, y = X.to(dtype), y.to(dtype)
    op = mean_ggn_operator(model, nn.MSELoss(), list(model.parameters()), loader(X, y), 100)
    g = torch.Generator
    kwargs = dict(scale=0.5, dtype=dtype)
    ref = compute_eigenpairs(op, k, generator=g().manual_seed(0), **kwargs)
    blk = compute_eigenpairs(op, k, generator=g().manual_seed(1), solver="block", **kwargs)
    assert blk.solver == "block" and blk.n_converged == k
    assert blk.n_products > blk.n_passes >= 1  # several columns per data pass
    nonzero = ~ref.below_threshold
    resolution = 10 * torch.finfo(dtype).eps * float(ref.values[0]) if dtype == torch.float32 else 0
    torch.testing.assert_close(blk.values[nonzero], ref.values[nonzero], rtol=1e-4, atol=resolution)
    assert torch.equal(blk.below_threshold, ref.below_threshold)
    # eigenvectors of well-separated, resolved eigenvalues agree up to sign
    vals = ref.values.double()
    gaps = torch.minimum(
        torch.cat([vals[:1] * 0 + float("inf"), vals[:-1] - vals[1:]]),
        torch.cat([vals[:-1] - vals[1:], vals[-1:] * 0 + float("inf")]),
    )
    separated = nonzero & (gaps > 1e-2 * vals[0])
    overlap = (blk.vectors.T @ ref.vectors).abs().diagonal()
    assert torch.all(overlap[separated] > 0.999), overlap
    # converged: relative residual 1e-5, or below the products' round-off floor
    absolute = (blk.residuals * blk.raw_values)[nonzero]
    floor = blk.rank_threshold * blk.raw_values[0]
    assert torch.all(absolute <= torch.maximum(1e-5 * blk.raw_values[nonzero], floor) * 1.01)


def test_block_solver_through_laplace_and_reports_passes(toy_regression):
    from laplace import Laplace

    model, X, y = toy_regression
    kw = dict(subset_of_weights="all", hessian_structure="glas", sigma_noise=0.1, n_components=5)
    lanczos = Laplace(model, "regression", **kw)
    block = Laplace(model, "regression", solver="block", **kw)
    lanczos.fit(loader(X, y))
    block.fit(loader(X, y))
    torch.testing.assert_close(block.eigenvalues, lanczos.eigenvalues, rtol=1e-4, atol=0)
    torch.testing.assert_close(
        block.log_marginal_likelihood(), lanczos.log_marginal_likelihood(), rtol=1e-4, atol=1e-3
    )
    assert block.lanczos_info.solver == "block"
    with pytest.raises(ValueError, match="solver must be"):
        Laplace(model, "regression", solver="arnoldi", **kw)


def test_block_solver_warns_when_passes_run_out():
    values = np.concatenate([[10.0, 9.0, 8.0], np.linspace(1.0, 1.001, 397)])
    with pytest.warns(LanczosConvergenceWarning, match="block solver did not converge"):
        eig = compute_eigenpairs(
            _diag_operator(values),
            6,
            dtype=torch.float64,
            solver="block",
            maxiter=2,
            block_size=6,
            generator=torch.Generator().manual_seed(0),
        )
    assert eig.n_converged < 6
    torch.testing.assert_close(
        eig.values[:3], torch.tensor([10.0, 9.0, 8.0], dtype=torch.float64), rtol=1e-6, atol=0
    )


def test_block_solver_says_when_it_returns_fewer_pairs_than_asked():
    """3 passes of 3 columns hold 9 vectors: the warning says 9 of 10 came back."""
    from scipy.sparse.linalg import aslinearoperator

    A = np.diag(np.linspace(10, 1, 200))
    with pytest.warns(LanczosConvergenceWarning, match="found only 9 of the 10"):
        eig = compute_eigenpairs(
            aslinearoperator(A), 10, dtype=torch.float64, solver="block", block_size=3, maxiter=3
        )
    assert eig.k == 9
