"""A symmetric SciPy ``LinearOperator`` whose products are computed in torch.

GLAS's own curvature operators (factored, linearised, all-reduced) multiply torch
tensors; ARPACK multiplies NumPy arrays, the block solver torch tensors.
:class:`TorchOperator` serves both from one method, ``matmat_torch(V)`` for
``V (D, m)``: ``operator @ tensor`` stays in torch, ``operator @ array`` (and SciPy's
``matvec`` / ``matmat``) converts to and from NumPy in the operator's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator

__all__ = ["NUMPY_DTYPES", "ColumnChunks", "TorchOperator"]

NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}
"""The NumPy dtype of each torch dtype an operator computes in."""


class TorchOperator(LinearOperator):
    """Base of the symmetric operators computed in torch; subclasses define
    ``matmat_torch(V: torch.Tensor) -> torch.Tensor`` (any device, their dtype).
    """

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` for ``V (D, m)``."""
        raise NotImplementedError

    def __matmul__(self, V):  # torch tensors stay torch (block solver)
        if isinstance(V, torch.Tensor):
            return self.matmat_torch(V)
        return super().__matmul__(V)

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        V = torch.from_numpy(np.ascontiguousarray(X, dtype=self.dtype))
        return self.matmat_torch(V).cpu().numpy()

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(x.reshape(-1, 1)).reshape(-1)

    def _adjoint(self) -> TorchOperator:
        return self  # symmetric


class ColumnChunks(TorchOperator):
    """``A V`` computed ``max_columns`` columns at a time (a memory bound).

    Wraps an operator that multiplies torch tensors (curvlinops' operators, or a
    :class:`TorchOperator`): its products of many columns (the residual check's ``k``,
    the block solver's ``block_size``) hold temporaries per column; in chunks they stay
    within the memory budget the planner gives them, at the cost of more data passes.
    """

    def __init__(self, operator, max_columns: int, dtype: torch.dtype, device):
        super().__init__(dtype=NUMPY_DTYPES[dtype], shape=tuple(operator.shape))
        self.operator = operator
        self.max_columns = max(1, int(max_columns))
        self.torch_dtype = dtype
        self.device = torch.device(device)

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` for ``V (D, m)``, in chunks of at most ``max_columns`` columns."""
        V = V.to(device=self.device, dtype=self.torch_dtype)
        if V.shape[1] <= self.max_columns:
            return self.operator @ V
        out = torch.empty_like(V)
        for start in range(0, V.shape[1], self.max_columns):
            stop = start + self.max_columns
            out[:, start:stop] = self.operator @ V[:, start:stop]
        return out
