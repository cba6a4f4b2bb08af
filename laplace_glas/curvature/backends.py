"""laplace-torch's ``backend`` argument, mapped to curvlinops' matrix-free operators.

laplace-torch builds dense or factored curvature blocks through a backend class
(``CurvlinopsGGN``, ``BackPackEF``, ``AsdlHessian``, ...). GLAS never forms a ``D x D``
matrix: it needs the *product* of the curvature with vectors. Each backend is
therefore read as the matrix it stands for and served by curvlinops' operator of
that matrix, of the mean loss over the ``N`` likelihood terms (unit noise):

.. math::

    G_1 &= \\frac{1}{N} \\sum_{n} J_n^\\top \\Lambda_n J_n
    &&\\text{GGN: } \\texttt{CurvlinopsGGN, BackPackGGN, AsdlGGN}
    \\;\\to\\; \\texttt{GGNLinearOperator} \\\\
    F_1 &= \\frac{1}{N} \\sum_{n} g_n g_n^\\top, \\; g_n = \\nabla_\\theta \\ell_n
    &&\\text{empirical Fisher: } \\texttt{CurvlinopsEF, BackPackEF, AsdlEF}
    \\;\\to\\; \\texttt{EFLinearOperator} \\\\
    H_1 &= \\frac{1}{N} \\sum_{n} \\nabla^2_\\theta \\ell_n
    &&\\text{Hessian: } \\texttt{CurvlinopsHessian, AsdlHessian}
    \\;\\to\\; \\texttt{HessianLinearOperator}

with ``l_n = 0.5 ||f_n - y_n||^2`` (regression) or the cross-entropy of one target
(classification): the matrices laplace-torch's ``FullLaplace`` with the same backend
sums (``H = N * M_1``). One exception follows laplace-torch too: its regression
empirical Fisher is ``1/2`` times the empirical Fisher of ``||f_n - y_n||^2``, i.e.
``F_1 = (2/N) sum_n g_n g_n^T`` with the ``g_n`` above (twice the empirical Fisher of
``l_n``), and GLAS uses the same matrix so that both posteriors agree.

laplace-torch's generic ``GGNInterface`` and ``EFInterface`` (which its last-layer and
subnetwork test suites fit with), and their subclasses that are none of the classes
above, stand for the GGN and the empirical Fisher (with the same regression factor: the
generic ``EFInterface.full`` is ``0.5 sum_n G_n G_n^T`` with ``G_n`` the gradients of
``||f_n - y_n||^2``). BackPACK, ASDL and these generic classes get a ``UserWarning``
saying that curvlinops computes the same matrix matrix-free (a subclass's own
``full`` / ``diag`` methods are not called). The Hessian is indefinite: its
leading eigenpairs are its largest *algebraic* eigenvalues, and eigenvalues at or
below ``rank_threshold * lambda_1`` (negative ones included) count as zero curvature.

Refused with a ``ValueError`` naming the class: a stochastic GGN
(``backend_kwargs={'stochastic': True}``, a Monte-Carlo Fisher whose draws would
change between Lanczos products) and any class that is none of the above (e.g. a
user's own direct ``CurvatureInterface`` subclass), which has no matrix-free operator here.

The operators themselves are built by the planner
(:func:`~laplace_glas.curvature.memory.planner.plan_solve`).

Only the GGN has the fast paths (:mod:`~laplace_glas.curvature.operators.factored`,
:mod:`~laplace_glas.curvature.solvers.gram`,
:mod:`~laplace_glas.curvature.operators.linearized`); the
empirical Fisher and the Hessian use curvlinops with Lanczos (or the block solver),
recorded in
``lanczos_info.operator`` as ``'curvlinops EF'`` / ``'curvlinops Hessian'``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from laplace.curvature import (
    AsdlEF,
    AsdlGGN,
    AsdlHessian,
    BackPackEF,
    BackPackGGN,
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
    EFInterface,
    GGNInterface,
)
from torch import nn

from laplace_glas.curvature.data.losses import TokenCrossEntropy
from laplace_glas.validation import ArgumentTypeError

__all__ = [
    "CURVATURES",
    "MATRIX_NAMES",
    "CurvatureChoice",
    "ef_loss",
    "resolve_backend",
]

CURVATURES = ("ggn", "ef", "hessian")
"""The matrices a backend can stand for."""

_CURVLINOPS = {CurvlinopsGGN: "ggn", CurvlinopsEF: "ef", CurvlinopsHessian: "hessian"}
_MAPPED = {
    BackPackGGN: "ggn",
    AsdlGGN: "ggn",
    BackPackEF: "ef",
    AsdlEF: "ef",
    AsdlHessian: "hessian",
}
_GENERIC = {GGNInterface: "ggn", EFInterface: "ef"}
_EF_LOSSES = (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss)
MATRIX_NAMES = {"ggn": "GGN", "ef": "empirical Fisher", "hessian": "Hessian"}
_OPERATOR_NAMES = {
    "ggn": "GGNLinearOperator",
    "ef": "EFLinearOperator",
    "hessian": "HessianLinearOperator",
}


@dataclass(frozen=True)
class CurvatureChoice:
    """The matrix a ``backend`` stands for.

    Attributes
    ----------
    kind : {'ggn', 'ef', 'hessian'}
        The curvature GLAS eigen-decomposes.
    backend : str
        The name of the class given (``'CurvlinopsGGN'`` when None).

    """

    kind: str
    backend: str

    @property
    def factorable(self) -> bool:
        """Whether the factored GGN / dual Gram fast paths apply (GGN only)."""
        return self.kind == "ggn"


def resolve_backend(backend: Any, backend_kwargs: dict[str, Any] | None = None) -> CurvatureChoice:
    """Which matrix laplace-torch's ``backend`` (a class or None) stands for.

    Raises
    ------
    ArgumentTypeError
        When ``backend_kwargs`` is neither a dict nor None.
    ValueError
        For a stochastic GGN and for classes without a matrix-free operator.

    """
    if backend_kwargs is not None and not isinstance(backend_kwargs, Mapping):
        raise ArgumentTypeError(
            f"backend_kwargs must be a dict (of keyword arguments for the backend) or None, "
            f"got {type(backend_kwargs).__name__} ({backend_kwargs!r})."
        )
    if backend is None:
        return CurvatureChoice("ggn", CurvlinopsGGN.__name__)
    name = getattr(backend, "__name__", repr(backend))
    if not isinstance(backend, type):
        raise ValueError(
            f"The curvature backend {name} is not a class: pass a laplace-torch curvature "
            "class such as CurvlinopsGGN (default), CurvlinopsEF or CurvlinopsHessian."
        )
    kind = None
    for table in (_CURVLINOPS, _MAPPED, _GENERIC):
        for cls, value in table.items():
            if issubclass(backend, cls):
                kind, base = value, cls
                break
        if kind is not None:
            break
    if kind is None:
        raise ValueError(
            f"The curvature backend {name} has no matrix-free operator in GLAS: use "
            "CurvlinopsGGN (default), CurvlinopsEF or CurvlinopsHessian (or their "
            "BackPACK / ASDL counterparts, or laplace-torch's GGNInterface / EFInterface)."
        )
    if kind == "ggn" and (backend_kwargs or {}).get("stochastic", False):
        raise ValueError(
            f"{name} with stochastic=True is a Monte-Carlo Fisher; GLAS's eigen-solve needs "
            "the same matrix in every product. Use the exact GGN (stochastic=False)."
        )
    if base in _MAPPED or base in _GENERIC:
        skipped = (
            "BackPACK / ASDL are not called"
            if base in _MAPPED
            else (f"the methods of {name} are not called")
        )
        warnings.warn(
            f"backend {name}: GLAS computes the same {MATRIX_NAMES[kind]} matrix-free with "
            f"curvlinops' {_OPERATOR_NAMES[kind]}; {skipped}.",
            UserWarning,
            stacklevel=3,
        )
    return CurvatureChoice(kind, name)


def ef_loss(loss_func: nn.Module, out_ndim: int) -> nn.Module:
    """The loss curvlinops' ``EFLinearOperator`` takes in place of ``loss_func``.

    Its per-example gradients are those of ``MSELoss``, ``CrossEntropyLoss`` or
    ``BCEWithLogitsLoss`` only; GLAS's token cross-entropy over ``(batch, classes)``
    outputs is ``CrossEntropyLoss`` itself. Sequence outputs are refused: one
    gradient per sequence is not the per-token empirical Fisher.
    """
    if isinstance(loss_func, TokenCrossEntropy):
        if out_ndim != 1:
            raise ValueError(
                "The empirical Fisher backend needs classification outputs of shape "
                "(batch, classes); sequence outputs (batch, seq_len, vocab) are not "
                "supported. Use the GGN backend (CurvlinopsGGN, the default)."
            )
        return nn.CrossEntropyLoss(reduction="sum", ignore_index=loss_func.ignore_index)
    if not isinstance(loss_func, _EF_LOSSES):
        raise ValueError(
            f"The empirical Fisher backend supports MSELoss, CrossEntropyLoss and "
            f"BCEWithLogitsLoss as loss_fn (curvlinops' EFLinearOperator), got "
            f"{type(loss_func).__name__}."
        )
    return loss_func
