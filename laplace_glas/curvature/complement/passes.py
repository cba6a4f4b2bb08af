"""The complement's curvature a fit computes beside its eigen-solve (a mixin).

``complement='diag'`` takes the summed GGN diagonal
(:func:`~laplace_glas.curvature.complement.diagonal.ggn_diagonal`, one data pass before the
solve) and ``complement='kron'`` KFAC's Kronecker factors of the summed GGN
(:mod:`~laplace_glas.curvature.complement.kron`); ``complement='kron_diag'`` both, block by
block: KFAC's factors of the layers KFAC covers and the GGN diagonal of every other
trainable parameter (``ggn_kron(partial=True)``, then
:func:`~laplace_glas.curvature.complement.diagonal.ggn_diagonal` over the parameters it left
empty). ``'auto'`` takes the first of ``'kron'``, ``'kron_diag'``, ``'diag'`` that is not
refused, under a scalar prior, and whose pass succeeds, else ``'zero'`` with a warning
naming why.

KFAC's factors come without a data pass where the planner builds the factored
operator: the fit hands its operator to :meth:`ComplementPass._complement_from_plan`
between planning and solving, and :func:`~laplace_glas.curvature.complement.kron.factored_kron`
forms ``A = (1/(N T_c)) sum a a^T`` and ``B = N sum g g^T`` from the stored factors
(two GEMMs per layer) while the operator is alive anyway. Where the model or the first
batch rules that out (:func:`~laplace_glas.curvature.complement.kron.factored_kron_refusal`),
curvlinops' KFAC pass (:func:`~laplace_glas.curvature.complement.kron.ggn_kron`) runs before the
solve, as the diagonal's does; where only the operator does (another strategy, a
subsample, padded targets), the pass runs after the solve, once the operator is freed,
so that the fit's peak is the larger of the two, not their sum. ``lanczos_info.plan``
records the source as ``'kron_factors'``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from laplace.utils.matrix import Kron

from laplace_glas.curvature.complement.diagonal import ggn_diagonal
from laplace_glas.curvature.complement.kfac_layers import union_of_factors
from laplace_glas.curvature.complement.kron import factored_kron, factored_kron_refusal, ggn_kron
from laplace_glas.curvature.data.output_hessian import OutputHessianRefusal
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.parallel.distributed import Shards
from laplace_glas.validation import user_stacklevel

__all__ = ["AUTO_CANDIDATES", "ComplementCurvature", "ComplementPass", "ZeroComplementWarning"]


class ZeroComplementWarning(UserWarning):
    """``complement='auto'`` found no curvature outside ``span(U)`` it could compute and
    resolved to ``'zero'`` (the reason is in the message and in ``complement_reason``).
    """


AUTO_CANDIDATES = ("kron", "kron_diag", "diag")
"""What ``complement='auto'`` tries, in order, before ``'zero'``."""

FROM_FACTORS = "factored operator"
"""``lanczos_info.plan['kron_factors']`` where KFAC's factors came from the operator."""


@dataclass
class ComplementCurvature:
    """The complement's curvature as a fit resolves it.

    Attributes
    ----------
    resolved : str or None
        What ``'auto'`` resolved to (None for an explicit setting).
    why : str or None
        The reason recorded for ``'auto'``.
    diagonal : torch.Tensor or None
        The summed GGN diagonal (``'diag'``; ``'kron_diag'``: over the parameters whose
        KFAC block is empty, in their order).
    kron : Kron or None
        KFAC's factors of the summed GGN (``'kron'``; ``'kron_diag'``: ``[]`` blocks for
        the parameters the diagonal covers).
    pending : bool
        ``'kron'`` waits for the fit's operator (its factors) or, failing that, for
        curvlinops' pass after the solve.
    source : str or None
        Where KFAC's factors came from (``'factored operator'`` or ``'curvlinops'``
        with the reason), for ``lanczos_info.plan['kron_factors']``.
    reasons : list of str
        ``'auto'``: the candidates refused so far.

    """

    resolved: str | None = None
    why: str | None = None
    diagonal: torch.Tensor | None = None
    kron: Kron | None = None
    pending: bool = False
    source: str | None = None
    reasons: list[str] = field(default_factory=list)


def _kron_why(reasons: list[str]) -> str:
    why = " ".join(reasons) or (
        "KFAC covers every trainable parameter (a scalar or layerwise prior, the "
        "likelihood's GGN, no loss_fn)."
    )
    return f"complement='auto' resolved to 'kron': {why}"


class ComplementPass:
    """The complement passes of :class:`~laplace_glas.curvature.fit.SubspaceFit` (a
    mixin; see the module).
    """

    def _complement_pass(
        self,
        loader: Any,
        shards: Shards | None,
        show: bool,
        update: bool,
        problem: CurvatureProblem | None = None,
    ) -> ComplementCurvature:
        """Before the solve: an explicit complement's refusal is raised; its pass runs,
        or ``'kron'`` is left pending where the factored operator may give it
        (``problem``: the solve's, None: never).
        """
        setting = self._complement_setting
        if setting == "auto":
            return self._auto_complement(loader, shards, show, update, problem)
        refusal = self._complement_refusal(setting, update)
        if refusal is not None:
            raise ValueError(refusal)
        if setting == "kron" and self._may_take_factors(problem, loader, shards, update):
            return ComplementCurvature(pending=True)
        n_new = None if problem is None else problem.n_loader_terms
        curvature = self._complement_data(setting, loader, shards, show, update, n_new)
        if setting == "diag":
            return ComplementCurvature(diagonal=curvature)
        if setting == "kron_diag":
            kron, diagonal = curvature
            return ComplementCurvature(kron=kron, diagonal=diagonal, source="curvlinops")
        source = None if curvature is None else "curvlinops"
        return ComplementCurvature(kron=curvature, source=source)

    def _auto_complement(
        self,
        loader: Any,
        shards: Shards | None,
        show: bool,
        update: bool,
        problem: CurvatureProblem | None,
        candidates: tuple[str, ...] = AUTO_CANDIDATES,
        reasons: list[str] | None = None,
    ) -> ComplementCurvature:
        """``'auto'`` over ``candidates`` (``reasons``: the refusals so far)."""
        reasons = list(reasons or [])
        n_new = None if problem is None else problem.n_loader_terms
        for candidate in candidates:
            refusal = self._auto_candidate_refusal(candidate, update)
            if refusal is None and candidate == "kron":
                if self._may_take_factors(problem, loader, shards, update):
                    return ComplementCurvature("kron", _kron_why(reasons), pending=True,
                                               reasons=reasons)  # fmt: skip
            if refusal is None:
                try:
                    curvature = self._complement_data(
                        candidate, loader, shards, show, update, n_new
                    )
                except ValueError as err:  # a data-time refusal (BackPACK's, a batch's)
                    if shards is not None:
                        # the other ranks left the fit on this rank's failure (the pass's
                        # own collective told them): moving on alone would leave this
                        # rank waiting in the next candidate's collectives
                        raise
                    refusal = str(err)
                else:
                    if candidate == "kron":
                        return ComplementCurvature("kron", _kron_why(reasons), kron=curvature,
                                                   source="curvlinops")  # fmt: skip
                    why = f"complement='auto' resolved to {candidate!r}: {' '.join(reasons)}"
                    if candidate == "kron_diag":
                        kron, diagonal = curvature
                        return ComplementCurvature("kron_diag", why, diagonal=diagonal,
                                                   kron=kron, source="curvlinops")  # fmt: skip
                    return ComplementCurvature("diag", why, diagonal=curvature)
            reasons.append(f"not {candidate!r}: {refusal}")
        why = "complement='auto' resolved to 'zero': " + " ".join(reasons)
        warnings.warn(
            f"{why} The posterior has no variance outside span(U); pass complement='zero' "
            "explicitly to silence this warning.",
            ZeroComplementWarning,
            stacklevel=user_stacklevel(),
        )
        return ComplementCurvature("zero", why)

    def _auto_candidate_refusal(self, candidate: str, update: bool) -> str | None:
        """Why ``'auto'`` cannot take ``candidate`` before any data pass (None: it may):
        :meth:`_complement_refusal`, and a per-weight prior for the KFAC complements.
        """
        refusal = self._complement_refusal(candidate, update)
        if refusal is None and candidate != "diag" and self._per_weight_prior():
            shape = tuple(self.prior_precision.shape)
            refusal = (
                f"complement={candidate!r} takes a scalar or layerwise prior, got one "
                f"per weight (shape {shape})."
            )
        return refusal

    def _complement_before_data(self, update: bool) -> str:
        """The complement a fit starts its passes with: the setting, or for ``'auto'``
        the first of ``'kron'``, ``'kron_diag'``, ``'diag'`` that nothing but a data pass
        may still refuse (``'zero'`` when none). Ranks of a data-parallel fit must agree
        on it, since it decides which collectives the complement's pass calls.
        """
        if self._complement_setting != "auto":
            return self._complement_setting
        for candidate in AUTO_CANDIDATES:
            if self._auto_candidate_refusal(candidate, update) is None:
                return candidate
        return "zero"

    def _may_take_factors(
        self, problem: CurvatureProblem | None, loader: Any, shards: Shards | None, update: bool
    ) -> bool:
        """Whether KFAC's factors may come from the solve's operator: one process, a
        new fit on all of ``loader`` and :func:`factored_kron_refusal` None.
        """
        if problem is None or shards is not None or update or problem.loader is not loader:
            return False
        return (
            factored_kron_refusal(
                self.model,
                problem.params,
                loader if problem.first_batch is None else [problem.first_batch],
                problem.likelihood,
                problem.out_shape,
                self.dict_key_y,
            )
            is None
        )

    @staticmethod
    def _complement_from_plan(
        complement: ComplementCurvature, plan: Any, problem: CurvatureProblem
    ) -> None:
        """Between planning and solving: a pending ``'kron'`` takes its factors from the
        plan's operator where :func:`factored_kron` gives them (else its reason is kept
        for the pass after the solve).
        """
        if not complement.pending:
            return
        try:
            kron = factored_kron(plan.operator, problem.model, problem.params, problem.n_terms)
        except ValueError as err:  # e.g. non-finite factors: curvlinops' pass decides
            kron = str(err)
        if isinstance(kron, str):
            complement.source = f"curvlinops ({kron})"
        else:
            complement.kron, complement.pending, complement.source = kron, False, FROM_FACTORS

    def _complement_after_solve(
        self, complement: ComplementCurvature, loader: Any, show: bool
    ) -> ComplementCurvature:
        """After the solve (its operator freed): curvlinops' pass for a ``'kron'`` still
        pending; under ``'auto'``, a data-time refusal moves on to ``'diag'``.
        """
        if not complement.pending:
            return complement
        source = complement.source or "curvlinops"
        if complement.resolved is None:  # explicit: its errors are raised
            kron = self._complement_data("kron", loader, None, show, False)
            return ComplementCurvature(kron=kron, source=source)
        try:
            kron = self._complement_data("kron", loader, None, show, False)
        except ValueError as err:
            reasons = [*complement.reasons, f"not 'kron': {err}"]
            candidates = AUTO_CANDIDATES[1:]
            return self._auto_complement(loader, None, show, False, None, candidates, reasons)
        return ComplementCurvature("kron", complement.why, kron=kron, source=source)

    def _complement_data(
        self,
        complement: str,
        loader: Any,
        shards: Shards | None,
        show: bool,
        update: bool,
        n_new: int | None = None,
    ) -> torch.Tensor | Kron | tuple[Kron, torch.Tensor] | None:
        """The summed GGN diagonal (``'diag'``; plus the stored one for an update),
        KFAC's factors of the summed GGN by curvlinops' pass (``'kron'``), both block by
        block (``'kron_diag'``: the factors, and the diagonal of the parameters whose
        block is empty), else None.
        """
        if self.output_hessian is not None and complement in ("kron", "kron_diag"):
            raise OutputHessianRefusal(
                f"complement={complement!r} needs KFAC's data pass at the MAP's output "
                "Hessian, not the posterior-averaged one: KFAC's factors follow "
                "output_hessian only where they come from the solve's factored operator "
                "(complement='diag' follows it on any model)."
            )
        common = {"ignore_index": self.ignore_index, "dict_key_y": self.dict_key_y}
        if complement in ("kron", "kron_diag"):
            kron = ggn_kron(
                self.model, loader, self._curvature_likelihood, shards=shards,
                progress_bar=show, partial=complement == "kron_diag", **common,
            )  # fmt: skip
            if update:  # KFAC's factors of the union: A by the counts, B summed
                kron = union_of_factors(self._ggn_kron, self.n_data, kron, n_new)
            if complement == "kron":
                return kron
            trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
            names = [n for n, block in zip(trainable, kron.kfacs) if not block]
            if not names:
                return kron, torch.zeros(0, dtype=self._dtype, device=self._device)
            diagonal = ggn_diagonal(
                self.model, loader, self._curvature_likelihood, device=self._device,
                shards=shards, progress_bar=show, names=names, **common, **self._diagonal_options(),
            ).to(self._dtype)  # fmt: skip
            return kron, diagonal + self._ggn_diagonal if update else diagonal
        if complement != "diag":
            return None
        diagonal = ggn_diagonal(
            self.model, loader, self._curvature_likelihood, device=self._device,
            shards=shards, progress_bar=show, **common, **self._diagonal_options(),
            output_hessian=self.output_hessian,
        ).to(self._dtype)  # fmt: skip
        return diagonal + self._ggn_diagonal if update else diagonal

    def _diagonal_options(self) -> dict[str, Any]:
        """The GGN diagonal's estimator (``diagonal_estimator``) and, for ``'mc'``, its
        generator: seeded with ``seed`` on the model's device (the same signs on every
        rank of a data-parallel fit, each over its own examples).
        """
        estimator = getattr(self, "diagonal_estimator", "exact")
        if estimator != "mc":
            return {"estimator": estimator}
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        return {"estimator": estimator, "generator": generator}
