"""Thread counts of the BLAS and LAPACK libraries while a solver phase runs.

Two thread pools share the cores during a fit: torch's (OpenMP, with MKL's LAPACK)
and SciPy's OpenBLAS. Both are tuned for large calls; the solvers make many small ones,
where threads cost more than they give:

* idle OpenBLAS workers spin between calls and take the cores from torch's threads
  computing the GGN products (on 2 cores ARPACK's ``symv`` products of the Gram solve
  ran 25x slower with two OpenBLAS threads than with one);
* MKL's ``geqrf`` and ``syevd`` synchronise their threads at every panel, so a thin QR
  or a small symmetric eigen-problem is no faster, often slower, on two threads than on
  one. Measured on the 2-core CPU (two threads / one), under OpenMP's default wait
  policy and with ``OMP_WAIT_POLICY=PASSIVE`` (sleeping, not spinning, workers, as on a
  busy machine): ``qr`` of a ``93,901 x 62`` float32 block 115 / 74 ms (128 / 72 ms),
  of ``93,901 x 250`` 956 / 982 ms (995 / 989 ms); float64 ``eigh`` of a ``186 x 186``
  matrix 2.0 / 2.5 ms (4.7 / 2.5 ms), ``700 x 700`` 88 / 70 ms (87 / 70 ms).

:func:`single_threaded_openblas` and :func:`single_threaded_torch` set one thread for
the duration of a block and restore the previous counts afterwards, also on an error.
They act on the calling thread's counts (OpenBLAS's count is global; torch's OpenMP
backend keeps its count per thread): another thread running torch at the same time
keeps its own, and a thread that first runs torch inside the block may keep one
thread afterwards. The solvers start no threads inside these blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import torch

__all__ = ["SMALL_EIGH", "eigh_threads", "single_threaded_openblas", "single_threaded_torch"]

SMALL_EIGH = 768
"""Largest order of a symmetric eigen-problem run on one thread by :func:`eigh_threads`.

Measured on the 2-core CPU, ``torch.linalg.eigh`` of an ``n x n`` float32 matrix on two
threads against one: n = 300 3.7 / 4.5 ms (18.8 / 4.3 ms with ``OMP_WAIT_POLICY=PASSIVE``),
n = 1,000 55 / 96 ms (137 / 96 ms), n = 2,000 368 / 650 ms (607 / 643 ms); float64
n = 700 88 / 70 ms (87 / 70 ms). One thread costs at most 20% up to this order under
the default policy and saves up to 4x under ``PASSIVE``; above it two threads win.
"""


@functools.cache
def _openblas_thread_controls() -> tuple:
    """``(get, set)`` thread-count functions of every OpenBLAS loaded in this process
    (found as threadpoolctl finds them; none off Linux).
    """
    controls = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return ()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("", "64_"):
                get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    controls.append((get, put))
    return tuple(controls)


@contextlib.contextmanager
def single_threaded_openblas() -> Iterator[None]:
    """SciPy's (and NumPy's) OpenBLAS on one thread while the block runs."""
    controls = _openblas_thread_controls()
    before = [get() for get, _ in controls]
    try:
        for _, put in controls:
            put(1)
        yield
    finally:
        for (_, put), n in zip(controls, before):
            put(n)


def eigh_threads(n: int) -> contextlib.AbstractContextManager[None]:
    """:func:`single_threaded_torch` for an ``n x n`` eigen-problem up to
    :data:`SMALL_EIGH`, else the caller's thread count.
    """
    return single_threaded_torch() if n <= SMALL_EIGH else contextlib.nullcontext()


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """One thread for torch's intra-op pool (and MKL's LAPACK under it) while the block
    runs; for small dense factorisations (thin QR, the Rayleigh-Ritz ``eigh``), not for
    products.
    """
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        yield
    finally:
        torch.set_num_threads(before)
