"""Thread counts during solver phases (curvature.solvers.threads)."""

from __future__ import annotations

import pytest
import torch

from laplace_glas.curvature.solvers import block_krylov, threads
from laplace_glas.curvature.solvers.block_krylov import block_krylov_eigenpairs


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_single_threaded_torch_restores_the_count_also_after_an_error(two_torch_threads):
    with threads.single_threaded_torch():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"):
        with threads.single_threaded_torch():
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_block_krylov_factorises_on_one_thread_and_multiplies_on_all(
    two_torch_threads, monkeypatch
):
    """The thin QRs and the Rayleigh-Ritz eigh run on one torch thread; the operator's
    products (the user's work) on the caller's count, which is restored afterwards."""
    seen = {"qr": set(), "eigh": set(), "matmat": set()}
    qr, eigh = torch.linalg.qr, torch.linalg.eigh

    def counting_qr(*args, **kwargs):
        seen["qr"].add(torch.get_num_threads())
        return qr(*args, **kwargs)

    def counting_eigh(*args, **kwargs):
        seen["eigh"].add(torch.get_num_threads())
        return eigh(*args, **kwargs)

    monkeypatch.setattr(block_krylov.torch.linalg, "qr", counting_qr)
    monkeypatch.setattr(block_krylov.torch.linalg, "eigh", counting_eigh)
    g = torch.Generator().manual_seed(0)
    Q, _ = qr(torch.randn(80, 80, generator=g, dtype=torch.float64))
    values = torch.logspace(0, -4, 80, dtype=torch.float64)
    A = (Q * values) @ Q.T

    def matmat(V):
        seen["matmat"].add(torch.get_num_threads())
        return A @ V

    result = block_krylov_eigenpairs(matmat, 80, 5, block_size=6, tol=1e-10, generator=g)
    torch.testing.assert_close(result.values, values[:5], rtol=1e-8, atol=0)
    assert seen == {"qr": {1}, "eigh": {1}, "matmat": {2}}
    assert torch.get_num_threads() == 2


def test_eigh_threads_serves_small_problems_on_one_thread(two_torch_threads):
    with threads.eigh_threads(threads.SMALL_EIGH):
        assert torch.get_num_threads() == 1
    with threads.eigh_threads(threads.SMALL_EIGH + 1):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_kfac_factors_are_decomposed_on_one_thread(two_torch_threads, monkeypatch):
    from laplace.utils.matrix import Kron

    from laplace_glas.posterior import kron_complement

    seen = []
    eigh = torch.linalg.eigh

    def counting_eigh(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return eigh(*args, **kwargs)

    monkeypatch.setattr(kron_complement.torch.linalg, "eigh", counting_eigh)
    g = torch.Generator().manual_seed(0)
    B, A = torch.randn(4, 4, generator=g), torch.randn(3, 3, generator=g)
    kron = Kron([[B @ B.T, A @ A.T]])
    blocks = kron_complement.KronCurvature.decompose(kron, torch.float64, torch.device("cpu"))
    assert seen == [1, 1] and torch.get_num_threads() == 2
    (QB, QA), (lB, lA) = blocks[0]
    torch.testing.assert_close(QB @ torch.diag(lB) @ QB.T, (B @ B.T).double())
    torch.testing.assert_close(QA @ torch.diag(lA) @ QA.T, (A @ A.T).double())
