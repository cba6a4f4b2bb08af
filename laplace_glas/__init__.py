"""laplace-glas: Generalized Laplace Active Subspace (GLAS) for laplace-torch.

Importing the package registers ``hessian_structure='glas'`` with laplace-torch's
``Laplace`` factory for ``subset_of_weights='all'``, ``'last_layer'`` (the factory's
default) and ``'subnetwork'`` (:mod:`laplace_glas.subsets`)::

    import laplace_glas  # noqa: F401
    from laplace import Laplace

    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="glas")
    la.fit(train_loader)

Layout (each step of the data's way from ``fit`` to the predictive has its folder):
:mod:`laplace_glas.laplace` holds the laplace-torch class; :mod:`laplace_glas.curvature`
the data pass, the GGN operators and the eigen-solvers; :mod:`laplace_glas.posterior`
the closed forms on the subspace and the prior; :mod:`laplace_glas.predictive` the
Jacobian-vector products and the predictive methods; :mod:`laplace_glas.diagnostics`
calibration, activity, alignment and convergence checks; :mod:`laplace_glas.io` the
state dict. :mod:`laplace_glas.applications` holds the data sets, the SMILES language
model and the comparison harness used by the examples; importing ``laplace_glas``
does not load it.
"""

import warnings

# laplace-torch (through asdl) and curvlinops (through linear_operator) call the deprecated
# `torch.jit.script` when they are imported, and so does torch itself when the first
# forward-mode product (a JVP of the GGN or the 'glm' predictive) loads its
# decompositions: a warning that says nothing to a user of this package. It is silenced
# for these imports only; later imports are cached.
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning
    )
    import curvlinops  # noqa: F401
    import laplace  # noqa: F401
    import torch.autograd.forward_ad as _forward_ad

    getattr(_forward_ad, "_maybe_load_decompositions", lambda: None)()
    del _forward_ad

from laplace_glas.curvature import (
    Eigenpairs,
    LanczosConvergenceWarning,
    MemoryBudgetError,
    NumericalRankWarning,
    compute_eigenpairs,
    mean_ggn_operator,
)
from laplace_glas.diagnostics.activity import (
    activity_scores,
    cumulative_activity,
    per_parameter,
    weights_for_share,
)
from laplace_glas.diagnostics.alignment import Alignment, alignment, ood_scores
from laplace_glas.diagnostics.calibration import (
    CoverageNotReachedWarning,
    CoverageRow,
    DimensionSelection,
    coverage,
    interval_width,
    select_dimension,
)
from laplace_glas.diagnostics.convergence import (
    ReplicaCheck,
    ResidualReport,
    replica_check,
    residual_report,
)
from laplace_glas.laplace import ActiveSubspaceLaplace, FittedWeightsChangedWarning, NotFittedError
from laplace_glas.posterior.closed_forms import SubspaceOperator, optimal_prior_precision
from laplace_glas.posterior.fixed_point import FixedPointStep, fit_posterior_curvature
from laplace_glas.subsets import LastLayerActiveSubspaceLaplace, SubnetActiveSubspaceLaplace

__version__ = "0.1.0"

__all__ = [
    "ActiveSubspaceLaplace",
    "Alignment",
    "CoverageNotReachedWarning",
    "CoverageRow",
    "DimensionSelection",
    "Eigenpairs",
    "FittedWeightsChangedWarning",
    "FixedPointStep",
    "LanczosConvergenceWarning",
    "LastLayerActiveSubspaceLaplace",
    "MemoryBudgetError",
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
    "fit_posterior_curvature",
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
