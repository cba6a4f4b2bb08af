"""Adding a new data set's curvature to a fitted low-rank one (``fit(override=False)``).

laplace-torch's ``fit(loader, override=False)`` adds the new data's curvature to the
stored one, ``H <- H + H_new``. A GLAS posterior stores its curvature only through
its top ``K`` eigenpairs, ``H_old ~ U diag(h) U^T`` (``h = N_old * eig(G_old)``), so
the update is the top-``K`` eigen-solve of

.. math::

    \\bar G = \\frac{U \\operatorname{diag}(h) U^\\top + N_\\text{new} G_\\text{new}}
                  {N_\\text{old} + N_\\text{new}},

the mean-loss GGN of the union of both data sets with the old part truncated to its
``K`` kept directions. Against a fit on the union, the matrix differs by the old
data's discarded tail, ``N_old (G_old - U U^T G_old U U^T)``, whose spectral norm is
``N_old * lambda_{K+1}(G_old)`` (zero when ``K`` reaches the rank of ``G_old``, e.g.
when the same data is added again).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator

__all__ = ["StoredCurvature", "UpdatedCurvature", "add_stored_curvature"]


class StoredCurvature(NamedTuple):
    """A fitted posterior's curvature, ``H_old ~ U diag(h) U^T``."""

    vectors: torch.Tensor
    """``(D, K)`` orthonormal eigenvectors ``U``."""
    curvatures: torch.Tensor
    """``(K,)`` summed curvatures ``h = N_old * lambda``."""
    n_terms: int
    """``N_old``, the likelihood terms behind it."""


def add_stored_curvature(plan: Any, stored: StoredCurvature, n_new: int, dtype: torch.dtype):
    """The plan of ``fit(override=False)``: ``plan``'s operator (the new data's curvature
    over ``n_new`` terms, all of them also when a subsample is solved) added to
    ``stored``, solved by Lanczos (or the block solver).
    """
    operator = UpdatedCurvature(*stored, n_new, plan.operator, plan.scale, dtype)
    return replace(
        plan,
        operator=operator,
        scale=1.0,
        solver="block" if plan.solver == "block" else "lanczos",
        operator_name=f"stored rank-{stored.vectors.shape[1]} curvature + {plan.operator_name}",
        n_data=stored.n_terms + n_new,
    )


class UpdatedCurvature(LinearOperator):
    """``(U diag(h) U^T + N_new * scale * B) / (N_old + N_new)`` as a SciPy operator.

    Parameters
    ----------
    vectors : torch.Tensor
        ``(D, K)`` orthonormal eigenvectors ``U`` of the stored curvature.
    curvatures : torch.Tensor
        ``(K,)`` the stored summed curvatures ``h = N_old * lambda``.
    n_old, n_new : int
        Likelihood terms behind the stored curvature and behind ``B``.
    operator : LinearOperator or operator with ``to_scipy``
        ``B``, the new data's mean-loss GGN up to ``scale``.
    scale : float
        Factor of ``B`` (e.g. ``C / 2`` for curvlinops' MSE GGN).
    dtype : torch.dtype
        Precision of the products (the model's).

    """

    def __init__(
        self,
        vectors: torch.Tensor,
        curvatures: torch.Tensor,
        n_old: int,
        n_new: int,
        operator,
        scale: float,
        dtype: torch.dtype,
    ):
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        new = operator.to_scipy(dtype=np_dtype) if hasattr(operator, "to_scipy") else operator
        if new.shape[0] != vectors.shape[0]:
            raise ValueError(
                f"The new data's curvature acts on D={new.shape[0]} weights, the stored "
                f"one on D={vectors.shape[0]}."
            )
        super().__init__(dtype=np_dtype, shape=new.shape)
        self._U = vectors.detach().cpu().numpy().astype(np_dtype)
        self._h = curvatures.detach().cpu().numpy().astype(np_dtype)
        self._new = new
        total = n_old + n_new
        self._w_old = 1.0 / total
        self._w_new = n_new * scale / total

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        old = self._U @ (self._h[:, None] * (self._U.T @ X))
        return (self._w_old * old + self._w_new * self._new.matmat(X)).astype(self.dtype)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(x.reshape(-1, 1)).reshape(-1)

    def _adjoint(self) -> UpdatedCurvature:
        return self
