"""laplace-glas: Generalized Laplace Active Subspace (GLAS) for laplace-torch.

Importing the package registers ``hessian_structure='glas'`` with laplace-torch's
``Laplace`` factory for ``subset_of_weights='all'``, ``'last_layer'`` (the factory's
default) and ``'subnetwork'`` (:mod:`laplace_glas.subsets`)::

    import laplace_glas  # noqa: F401
    from laplace import Laplace

    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.fit(train_loader)

Layout: :mod:`laplace_glas.laplace` holds the laplace-torch class;
:mod:`laplace_glas.curvature` the data pass and the eigen-solve;
:mod:`~laplace_glas.posterior`, :mod:`~laplace_glas.predictive`,
:mod:`~laplace_glas.calibration`, :mod:`~laplace_glas.activity` and
:mod:`~laplace_glas.diagnostics` one concern each; :mod:`laplace_glas.applications`
the data sets, the SMILES language model and the comparison harness used by the
examples. The modules of version 0.1 (``laplace_glas.subspace``,
``laplace_glas.smiles``, ...) remain importable under their old names.
"""

import importlib
import sys

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
from laplace_glas.curvature.subspace import (
    Eigenpairs,
    LanczosConvergenceWarning,
    NumericalRankWarning,
    compute_eigenpairs,
    mean_ggn_operator,
)
from laplace_glas.diagnostics import ReplicaCheck, ResidualReport, replica_check, residual_report
from laplace_glas.jacobian_alignment import Alignment, alignment, ood_scores
from laplace_glas.laplace import ActiveSubspaceLaplace, FittedWeightsChangedWarning, NotFittedError
from laplace_glas.posterior import SubspaceOperator, optimal_prior_precision
from laplace_glas.subsets import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

__version__ = "0.1.0"

# Modules of version 0.1 that moved: their old import paths keep working.
_MOVED_MODULES = {
    "batches": "laplace_glas.curvature.batches",
    "block_krylov": "laplace_glas.curvature.block_krylov",
    "fitting": "laplace_glas.curvature.fitting",
    "losses": "laplace_glas.curvature.losses",
    "subspace": "laplace_glas.curvature.subspace",
    "compare": "laplace_glas.applications.compare",
    "data": "laplace_glas.applications.data",
    "smiles": "laplace_glas.applications.smiles",
}
for _old, _new in _MOVED_MODULES.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(_new)
    globals()[_old] = sys.modules[_new]
del _old, _new

__all__ = [
    "ActiveSubspaceLaplace",
    "Alignment",
    "CoverageNotReachedWarning",
    "CoverageRow",
    "DimensionSelection",
    "Eigenpairs",
    "FittedWeightsChangedWarning",
    "LanczosConvergenceWarning",
    "LastLayerActiveSubspaceLaplace",
    "NotFittedError",
    "NumericalRankWarning",
    "ReplicaCheck",
    "ResidualReport",
    "SubnetActiveSubspaceLaplace",
    "SubspaceOperator",
    "activity_scores",
    "alignment",
    "compute_eigenpairs",
    "coverage",
    "cumulative_activity",
    "interval_width",
    "mean_ggn_operator",
    "ood_scores",
    "optimal_prior_precision",
    "per_parameter",
    "replica_check",
    "residual_report",
    "select_dimension",
    "weights_for_share",
]
