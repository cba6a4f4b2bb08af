"""laplace-glas: Generalized Laplace Active Subspace (GLAS) for laplace-torch.

Importing the package registers ``hessian_structure='glas'`` with laplace-torch's
``Laplace`` factory::

    import laplace_glas  # noqa: F401
    from laplace import Laplace

    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.fit(train_loader)
"""

from laplace_glas.activity import (
    activity_scores,
    cumulative_activity,
    per_parameter,
    weights_for_share,
)
from laplace_glas.calibration import (
    CoverageNotReachedWarning,
    CoverageRow,
    DimensionSelection,
    coverage,
    interval_width,
    select_dimension,
)
from laplace_glas.diagnostics import ReplicaCheck, ResidualReport, replica_check, residual_report
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
    "CoverageNotReachedWarning",
    "CoverageRow",
    "DimensionSelection",
    "Eigenpairs",
    "LanczosConvergenceWarning",
    "NotFittedError",
    "NumericalRankWarning",
    "ReplicaCheck",
    "ResidualReport",
    "SubspaceOperator",
    "activity_scores",
    "compute_eigenpairs",
    "coverage",
    "cumulative_activity",
    "interval_width",
    "mean_ggn_operator",
    "optimal_prior_precision",
    "per_parameter",
    "replica_check",
    "residual_report",
    "select_dimension",
    "weights_for_share",
]
