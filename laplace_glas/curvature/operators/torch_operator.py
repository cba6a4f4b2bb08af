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

__all__ = ["NUMPY_DTYPES", "TorchOperator"]

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
