"""The fit half of laplace-torch's contract for a subspace Laplace posterior (a mixin).

``fit`` runs the data's way through the curvature package: the loss at the MAP and
``N`` (:func:`~laplace_glas.curvature.data.map_loss.loss_at_map`), one
:class:`~laplace_glas.curvature.data.problem.CurvatureProblem`, one
:class:`~laplace_glas.curvature.memory.planner.Plan` (operator and solver), the data-parallel
wrapper where a process group is given, and the eigen-solve
(:func:`~laplace_glas.curvature.solvers.solve.compute_eigenpairs`). The result is stored
in laplace-torch's form: ``H = (U, h)`` with ``h = N * eig(G_1)``, ``G_1`` the
unit-noise GGN of the mean loss

.. math::

    G_1 = \\frac{1}{N} \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n .

:class:`~laplace_glas.ActiveSubspaceLaplace` inherits it; the last-layer and subnetwork
posteriors override :meth:`SubspaceFit._plan` and the hooks ``_prepare_fit`` (before the
checks) and ``_fitted_mean`` (the stored mean) where their weights differ.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, RandomSampler

from laplace_glas.autodiff.context import autodiff_friendly, evaluation_mode
from laplace_glas.curvature.complement.passes import ComplementCurvature, ComplementPass
from laplace_glas.curvature.data.map_loss import MapLoss, loss_at_map
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.data.replay import KEPT_BYTES, ReplayedBatches
from laplace_glas.curvature.memory.budget import return_freed_memory
from laplace_glas.curvature.memory.peak import PeakMemory, with_measured_peak
from laplace_glas.curvature.memory.planner import Plan, plan_solve
from laplace_glas.curvature.operators.updated import StoredCurvature, add_stored_curvature
from laplace_glas.curvature.parallel.agreement import FitAgreement
from laplace_glas.curvature.parallel.distributed import (
    Shards,
    broadcast_eigenpairs,
    data_parallel,
    distribute_operator,
    reduce_map_loss,
)
from laplace_glas.curvature.solvers.eigenpairs import Eigenpairs, NumericalRankWarning
from laplace_glas.curvature.solvers.solve import compute_eigenpairs
from laplace_glas.settings import parse_memory_budget
from laplace_glas.validation import (
    flag,
    lanczos_basis_size,
    positive_int,
    reiterable,
    tolerance,
    trainable_size_and_dtype,
)

__all__ = ["SubspaceFit"]


class SubspaceFit(ComplementPass, FitAgreement):
    """``fit`` and ``compute_eigenpairs`` of a subspace Laplace posterior (a mixin; see
    the module).
    """

    _fit_leaves_model_in_eval = False
    """``fit`` gives the model back in the modes it found; True: in evaluation mode, as
    laplace-torch's ``LLLaplace.fit`` leaves its feature extractor."""

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool | None = None,
        *,
        process_group: Any = None,
    ) -> None:
        """Compute the top-k eigenpairs of the mean-loss GGN and the loss at the MAP.

        The fit's peak memory, measured by
        :class:`~laplace_glas.curvature.memory.peak.PeakMemory`, is recorded in
        ``lanczos_info.plan['measured_peak_bytes']`` (``-1``: not measurable here), which
        ``lanczos_info.measured_peak_bytes`` reads as None.

        Parameters
        ----------
        train_loader : DataLoader or iterable of batches
            ``(X, y)`` batches, or mappings with the target under ``dict_key_y``.
            The model's current weights are the MAP ``theta*``.
        override : bool, default=True
            True: a new fit. False (after a fit): add this loader's curvature, loss
            and number of terms to the stored ones, as laplace-torch does. The stored
            curvature is rank ``K``, so the update is the top-``K`` eigen-solve of
            ``(U diag(h) U^T + N_new G_new) / (N_old + N_new)``
            (:mod:`laplace_glas.curvature.operators.updated`): exact when ``K`` reaches the rank
            of the old GGN, otherwise off the union's fit by at most
            ``N_old * lambda_{K+1}(G_old)`` in the summed curvature. Solved by Lanczos
            (or the block solver with ``solver='block'``). The mean becomes the
            model's current weights.
        progress_bar : bool, optional
            Overrides the constructor's ``progress_bar``.
        process_group : torch.distributed process group, optional
            Data-parallel fit: each rank passes its own shard of the data; the loss,
            ``N`` and every GGN product are summed with ``all_reduce`` and all ranks end
            with rank 0's eigenpairs (:mod:`laplace_glas.curvature.parallel.distributed`).
            Default: ``torch.distributed``'s default group when it is initialised; a
            group of one rank fits on the local data alone.

        """
        # every pass of the fit sees the network in evaluation mode (dropout off, batch
        # norm on its running statistics); the caller's modes come back afterwards
        with PeakMemory(self._device) as peak, evaluation_mode(self.model):
            shards = data_parallel(process_group)
            try:  # local checks: a rank that fails them still takes part in the agreement
                self._prepare_fit(train_loader, override, shards)
                update, show, k = self._fit_checks(train_loader, override, progress_bar)
            except Exception as err:
                if shards is None:
                    raise
                self._agree(shards, train_loader, error=err)  # raises err after the exchange
            generator = self.generator
            if generator is None:
                generator = torch.Generator().manual_seed(self.seed)
            self._agree(shards, train_loader, k=k, update=update, generator=generator)
            # nothing is assigned until the solve has succeeded: a failed fit leaves the
            # previous posterior (or the unfitted state) as it was
            loss, n_data, out_shape, first_batch, kept = self._loss_at_map(
                train_loader, show, shards, keep_bytes=self._keep_bytes(train_loader, shards)
            )
            return_freed_memory()  # the loss pass's activations: not resident beside the solve
            stored = None
            if update:
                if out_shape[-1] != self.n_outputs:
                    raise ValueError(
                        f"fit(override=False) adds data of the fitted kind: the model now has "
                        f"{out_shape[-1]} outputs, the fitted posterior {self.n_outputs}."
                    )
                stored = StoredCurvature(*self.H, self.n_data)
            problem = self._curvature_problem(
                train_loader, out_shape, n_data, generator, self.subsample_size, shards, show,
                first_batch=first_batch, kept=kept,
            )  # fmt: skip
            del first_batch, kept  # held by the problem where it needs them
            # the complement's pass first (its refusals come before the eigen-solve's cost),
            # unless KFAC's factors may come from the solve's operator
            passes = problem.replay_of(train_loader)  # the kept batches, where they are
            complement = self._complement_pass(passes, shards, show, update, problem)
            eig = self._solve(problem, k, generator, stored=stored, complement=complement)
            complement = self._complement_after_solve(complement, passes, show)
            if complement.source is not None:
                eig = replace(eig, plan={**eig.plan, "kron_factors": complement.source})
            if update:
                loss, n_data = self.loss + loss, self.n_data + n_data
            n_below = int(eig.below_threshold.sum())
            if n_below:
                remedy = (
                    "Use fewer components."
                    if self._dtype == torch.float64
                    else "Use fewer components, or float64 for the spectrum's tail."
                )
                warnings.warn(
                    f"{n_below} of the {eig.k} eigenvalues lie below "
                    f"{eig.rank_threshold:.1e} x lambda_1, beyond what the "
                    f"{str(self._dtype).replace('torch.', '')} GGN products resolve: they "
                    f"are treated as zero curvature (prior variance along those directions). "
                    f"{remedy}",
                    NumericalRankWarning,
                    stacklevel=2,
                )
            self.mean = self._fitted_mean(parameters_to_vector(self.params).detach())
            self.loss = loss
            self.n_data = n_data  # likelihood terms: data points, or tokens for sequences
            self.n_outputs = out_shape[-1]
            self._out_shape = out_shape
            self.model.output_size = self.n_outputs
            self._eigenpairs = eig
            self._n_components = eig.k
            self.H = (eig.vectors, n_data * eig.values)
            self._ggn_diagonal, self._ggn_kron = complement.diagonal, complement.kron
            if complement.resolved is not None:  # complement='auto', resolved by this fit
                self._complement_fitted = complement.resolved
                self._complement_why = complement.why
            self._process_group = process_group
        self._eigenpairs = with_measured_peak(self._eigenpairs, peak)
        if self._fit_leaves_model_in_eval:
            self.model.eval()

    def _prepare_fit(self, train_loader: Any, override: bool, shards: Shards | None) -> None:
        """A subclass's step before the fit's checks: nothing here (the last-layer
        posterior finds its layer on the first batch).
        """

    def _fitted_mean(self, theta: torch.Tensor) -> torch.Tensor:
        """The posterior mean given the fitted weights ``theta`` (``D``): ``theta`` itself
        here (a subnetwork's posterior keeps its own entries).
        """
        return theta

    def _fit_checks(
        self, train_loader: Any, override: bool, progress_bar: bool | None
    ) -> tuple[bool, bool, int]:
        """The checks of ``fit`` that need no data pass: whether it updates, whether it
        shows progress bars and the checked ``k``.
        """
        update = not flag("override", override) and getattr(self, "_eigenpairs", None) is not None
        show = self.progress_bar if progress_bar is None else progress_bar
        if (
            isinstance(train_loader, DataLoader)
            and train_loader.drop_last
            and isinstance(train_loader.sampler, RandomSampler)
        ):
            raise ValueError(
                "A shuffled DataLoader with drop_last=True changes the data between "
                "GGN products; use drop_last=False."
            )
        reiterable("train_loader", train_loader)
        frozen = [n for n, p in zip(self._param_names, self.params) if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"The parameters {', '.join(frozen[:5])} no longer require grad: the "
                "posterior was constructed over them (as laplace-torch, it collects the "
                "trainable parameters at construction). Construct a new Laplace object "
                "for the model as it is now."
            )
        trainable_size_and_dtype(self.model)  # e.g. moved to the 'meta' device since
        k = self._validate_n_components(
            self.H[0].shape[1] if update else self._n_components, self.n_params
        )
        return update, show, k

    def _keep_bytes(self, loader: Any, shards: Shards | None) -> int:
        """Bytes of the training batches the pass at the MAP may keep for the fit's
        later passes (:mod:`~laplace_glas.curvature.data.replay`): ``KEPT_BYTES``;
        none for a data-parallel fit, a solve on a subsample or a loader that is a list
        or tuple already.
        """
        if shards is not None or self.subsample_size is not None:
            return 0
        return 0 if isinstance(loader, list | tuple) else KEPT_BYTES

    def _data_settings(self) -> dict[str, Any]:
        """The posterior's settings of a pass over its data, by name: the loss
        (``loss_fn``), the targets left out (``ignore_index``), the keys of mapping
        batches, and the device and dtype of the products.
        """
        return {
            "loss_fn": self.loss_fn,
            "ignore_index": self.ignore_index,
            "dict_key_x": self.dict_key_x,
            "dict_key_y": self.dict_key_y,
            "device": self._device,
            "dtype": self._dtype,
        }

    def _loss_at_map(
        self, loader: Any, show: bool, shards: Shards | None = None, keep_bytes: int = 0
    ) -> MapLoss:
        """:func:`laplace_glas.curvature.data.map_loss.loss_at_map` with this posterior's
        settings, summed over the ranks of ``shards`` (``keep_bytes``: see
        :meth:`_keep_bytes`).
        """
        local, error = None, None
        try:  # a rank whose pass fails still takes part in the all-reduce
            local = loss_at_map(
                self.model,
                loader,
                self._curvature_likelihood,
                **self._data_settings(),
                progress_bar=show,
                keep_bytes=keep_bytes,
            )
        except Exception as err:
            if shards is None:
                raise
            error = err
        return reduce_map_loss(local, shards, error=error, device=self._device)

    def compute_eigenpairs(
        self,
        train_loader: DataLoader,
        n_components: int | None = None,
        generator: torch.Generator | None = None,
        subsample_size: int | None = None,
        progress_bar: bool = False,
        tol: float | None = None,
        maxiter: int | None = None,
        ncv: int | None = None,
        process_group: Any = None,
    ) -> Eigenpairs:
        """Top eigenpairs of the unit-noise mean-loss GGN (or of ``loss_fn``'s) at the
        model's weights.

        The solve ``fit`` uses, exposed so that it can be repeated with other random
        starts or data subsamples (see :func:`laplace_glas.diagnostics.convergence.replica_check`)
        without touching this object's posterior. Lanczos settings default to the
        constructor's. After ``fit``, ``train_loader`` should hold data of the fitted
        kind (the output shape per point is reused; its number of terms ``N`` is counted, so the
        eigenvalues are those of this loader's mean GGN even when its size differs).
        ``process_group`` (default: the fit's) spreads the solve over the ranks as in
        :meth:`fit`. The peak memory of the solve is recorded in ``plan``
        (``measured_peak_bytes``).

        Returns
        -------
        Eigenpairs
            Eigenvalues of ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n`` with unit noise
            (divide by ``sigma^2`` for the regression GGN); with ``loss_fn``,
            ``Lambda_n`` is that loss's Hessian in the outputs.

        """
        with PeakMemory(self._device) as peak:
            if process_group is None:
                process_group = getattr(self, "_process_group", None)
            shards = data_parallel(process_group)
            try:  # local checks: a rank that fails them still takes part in the agreement
                k = self._n_components if n_components is None else n_components
                k = self._validate_n_components(k, self.n_params)
                reiterable("train_loader", train_loader)
                ncv = lanczos_basis_size(self.ncv if ncv is None else ncv, k, self.n_params)
                tol = self.tol if tol is None else tolerance(tol)
                maxiter = self.maxiter if maxiter is None else positive_int("maxiter", maxiter)
            except Exception as err:
                if shards is None:
                    raise
                self._agree(shards, train_loader, error=err)  # raises err after the exchange
            if generator is None:
                generator = torch.Generator().manual_seed(self.seed)
            self._agree(
                shards,
                train_loader,
                k=k,
                generator=generator,
                subsample_size=subsample_size,
                tol=tol,
                maxiter=maxiter,
                ncv=ncv,
            )
            out_shape, n_terms = getattr(self, "_out_shape", None), None
            if not out_shape:  # before fit: a pass at the MAP gives both
                at_map = self._loss_at_map(train_loader, False, shards)
                n_terms, out_shape = at_map.n_terms, at_map.out_shape
            # after fit: the output shape per point is the model's; N is this loader's
            problem = self._curvature_problem(
                train_loader, out_shape, n_terms, generator, subsample_size, shards, progress_bar
            )
            eig = self._solve(problem, k, generator, tol=tol, maxiter=maxiter, ncv=ncv)
        return with_measured_peak(eig, peak)

    def _curvature_problem(
        self,
        loader: Any,
        out_shape: torch.Size,
        n_terms: int | None,
        generator: torch.Generator,
        subsample_size: int | None,
        shards: Shards | None,
        progress_bar: bool,
        first_batch: Any = None,
        kept: ReplayedBatches | None = None,
    ) -> CurvatureProblem:
        """The curvature of ``loader`` with this posterior's settings
        (:meth:`~laplace_glas.curvature.data.problem.CurvatureProblem.build`; ``n_terms=None``
        counts ``N``; ``first_batch``, the loader's first item, and ``kept``, all its
        items, where the pass at the MAP kept them).
        """
        return CurvatureProblem.build(
            self.model,
            self.params,
            loader,
            self.likelihood,
            out_shape,
            n_terms=n_terms,
            subsample_size=subsample_size,
            generator=generator,
            **self._data_settings(),
            shards=shards,
            progress_bar=progress_bar,
            first_batch=first_batch,
            kept=kept,
            output_hessian=self.output_hessian,
        )

    def _solve(
        self,
        problem: CurvatureProblem,
        k: int,
        generator: torch.Generator,
        *,
        stored: StoredCurvature | None = None,
        tol: float | None = None,
        maxiter: int | None = None,
        ncv: int | None = None,
        complement: ComplementCurvature | None = None,
    ) -> Eigenpairs:
        """The top-``k`` eigenpairs of ``problem`` (plus ``stored``, the fitted
        curvature, for ``fit(override=False)``), on every rank of ``problem.shards``;
        a pending ``complement`` takes KFAC's factors from the plan's operator.

        ``tol``, ``maxiter`` and ``ncv`` are checked values; ``None`` takes the
        constructor's (``ncv``: checked against ``k``).
        """
        if ncv is None:
            ncv = lanczos_basis_size(self.ncv, k, self.n_params)
        with autodiff_friendly(self.model):
            plan, error = None, None
            try:  # a rank whose planning fails still takes part in the agreement
                plan = self._plan(problem, k, ncv)
            except Exception as err:
                error = err
            plan = distribute_operator(plan, problem, error)
            if complement is not None:
                self._complement_from_plan(complement, plan, problem)
            reduced = plan.operator  # an AllReducedGGN when problem.shards is set
            try:  # a rank whose solve fails between products tells the others (close)
                eig, plan = self._eigenpairs_of(
                    plan, problem, k, generator, stored, tol, maxiter, ncv
                )
            except Exception as err:
                if problem.shards is None:
                    raise
                reduced.close(err)
            if problem.shards is not None:
                reduced.close()
        eig = replace(eig, plan={**plan.summary(), "solver": eig.solver})
        return broadcast_eigenpairs(eig, problem.shards)

    def _eigenpairs_of(
        self,
        plan: Plan,
        problem: CurvatureProblem,
        k: int,
        generator: torch.Generator,
        stored: StoredCurvature | None,
        tol: float | None,
        maxiter: int | None,
        ncv: int,
    ) -> tuple[Eigenpairs, Plan]:
        """:func:`compute_eigenpairs` of ``plan`` (plus ``stored``) and the plan solved."""
        if stored is not None:  # fit(override=False): add to the stored curvature
            plan = add_stored_curvature(plan, stored, problem.n_loader_terms, self._dtype)
        eig = compute_eigenpairs(
            plan.operator,
            k,
            scale=plan.scale,
            dtype=self._dtype,
            device=self._device,
            tol=self.tol if tol is None else tol,
            maxiter=self.maxiter if maxiter is None else maxiter,
            ncv=ncv,
            generator=generator,
            rank_threshold=self.rank_threshold,
            n_data=plan.n_data,
            progress_bar=problem.progress_bar,
            solver=plan.solver,
            block_size=self.block_size if plan.block_size is None else plan.block_size,
            operator_name=plan.operator_name,
        )
        return eig, plan

    def _plan(self, problem: CurvatureProblem, k: int, ncv: int | None = None) -> Plan:
        """The operator and solver for ``problem`` with this posterior's ``solver``,
        ``curvature`` and ``memory_budget``
        (:func:`laplace_glas.curvature.memory.planner.plan_solve`).
        """
        return plan_solve(
            problem,
            k,
            self.solver,
            self.curvature,
            # checked again: the attribute may have been set after the constructor
            memory_budget=parse_memory_budget(getattr(self, "memory_budget", None)),
            ncv=ncv,
            block_size=self.block_size,
        )
