"""laplace-glas: Generalized Laplace Active Subspace (GLAS) for laplace-torch.

Importing the package registers ``hessian_structure='glas'`` with laplace-torch's
``Laplace`` factory::

    import laplace_glas  # noqa: F401
    from laplace import Laplace

    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.fit(train_loader)
"""

from laplace_glas.laplace import ActiveSubspaceLaplace, NotFittedError
from laplace_glas.posterior import SubspaceOperator, optimal_prior_precision
from laplace_glas.subspace import (
    Eigenpairs,
    LanczosConvergenceWarning,
    NumericalRankWarning,
    compute_eigenpairs,
    mean_ggn_operator,
)

__version__ = "0.1.0"

__all__ = [
    "ActiveSubspaceLaplace",
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "NotFittedError",
    "NumericalRankWarning",
    "SubspaceOperator",
    "compute_eigenpairs",
    "mean_ggn_operator",
    "optimal_prior_precision",
]
