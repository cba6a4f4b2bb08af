"""ActiveSubspaceLaplace: the GLAS posterior behind laplace-torch's interface.

The class is the laplace-torch contract and little else: the
``Laplace(model, likelihood, 'all', 'glas')`` registration, the constructor, the
read-only view of a fitted posterior (:attr:`ActiveSubspaceLaplace.posterior`),
calibration and (de)serialisation. The rest comes from one mixin per step of the data's
way: ``fit`` and the eigen-solve (:mod:`laplace_glas.curvature.fit`), the
hyperparameters and their conventions (:mod:`laplace_glas.posterior.hyperparameters`),
the posterior's operators, evidence, sampling and prior tuning
(:mod:`laplace_glas.posterior.subspace`) and the predictive methods
(:mod:`laplace_glas.predictive.subspace_predictive`).

Here ``H = (U, h)`` with ``U`` the ``(D, k)`` eigenvectors and ``h = N * eig(G_1)``,
``G_1`` the unit-noise GGN of the mean loss; the posterior sees ``a_j = s lambda_j / T``
along ``u_j`` (loss scaling ``s``, temperature ``T``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torchmetrics
from laplace.baselaplace import ParametricLaplace
from laplace.utils.enums import LinkApprox, PredType
from torch import nn
from torch.utils.data import DataLoader

from laplace_glas.curvature.backends import resolve_backend
from laplace_glas.curvature.complement.per_example_diagonal import DIAGONAL_ESTIMATORS
from laplace_glas.curvature.data.map_loss import validate_loss_fn
from laplace_glas.curvature.data.problem import curvature_likelihood
from laplace_glas.curvature.fit import SubspaceFit
from laplace_glas.curvature.memory.planner import SOLVERS
from laplace_glas.curvature.parallel.collectives import gridsearch
from laplace_glas.curvature.parallel.distributed import data_parallel
from laplace_glas.curvature.solvers.eigenpairs import Eigenpairs
from laplace_glas.diagnostics.calibration import DimensionSelection, select_dimension
from laplace_glas.io import glas_state, restore_glas_state, restored_complement
from laplace_glas.posterior.hyperparameters import (
    COMPLEMENTS,
    CURVATURE_COMPLEMENTS,
    LOSS_SCALINGS,
    PosteriorHyperparameters,
    unchanged_on_failure,
)
from laplace_glas.posterior.subspace import SubspacePosterior
from laplace_glas.posterior.view import FittedPosterior
from laplace_glas.predictive.jvp import parameter_names
from laplace_glas.predictive.subspace_predictive import (
    FittedWeightsChangedWarning,
    SubspacePredictive,
)
from laplace_glas.settings import laplace_arguments, solver_settings
from laplace_glas.validation import choice, grid_validation_data, trainable_size_and_dtype

__all__ = ["ActiveSubspaceLaplace", "FittedWeightsChangedWarning", "NotFittedError"]

_LIKELIHOODS = ("regression", "classification", "reward_modeling")


class NotFittedError(ValueError, AttributeError):
    """A method that needs the posterior was called before ``fit``.

    Also an ``AttributeError``: ``hasattr(la, 'eigenvalues')`` is False before ``fit``.
    """


class ActiveSubspaceLaplace(
    SubspaceFit,
    PosteriorHyperparameters,
    SubspacePredictive,
    SubspacePosterior,
    ParametricLaplace,
):
    """Generalized Laplace Active Subspace (GLAS) posterior over all weights.

    The posterior lives in the span of the top-k eigenvectors ``U`` of the GGN ``G``
    of the network's mean loss:

    .. math::

        \\theta = \\theta^* + U z, \\qquad
        z \\sim \\mathcal{N}(0, \\mathrm{diag}(v)), \\qquad
        v_j = \\frac{1}{s \\lambda_j / T + \\tau},

    with loss scaling ``s`` (1 for the mean loss, N for the summed loss), temperature
    ``T`` and scalar prior precision ``tau``. ``G`` is never formed: its eigenpairs
    come from Lanczos (``scipy.sparse.linalg.eigsh``) on curvlinops'
    ``GGNLinearOperator``.

    Parameters
    ----------
    model, likelihood, sigma_noise, prior_precision, prior_mean, temperature,
    enable_backprop, dict_key_x, dict_key_y :
        As in laplace-torch's ``ParametricLaplace``. ``prior_precision`` is a scalar
        (the closed forms), or one positive value per parameter tensor or per weight
        (:mod:`laplace_glas.posterior.prior`); ``likelihood`` is ``'regression'``
        (Gaussian, MSE), ``'classification'`` (softmax cross-entropy) or
        ``'reward_modeling'`` (laplace-torch's: fitted as classification on preference
        pairs, predicted as a regression of the reward unless ``fitting=True``).
    backend, backend_kwargs, asdl_fisher_kwargs :
        As in laplace-torch. ``backend`` picks the matrix (GGN by default, empirical
        Fisher for ``*EF``, Hessian for ``*Hessian``), always computed matrix-free
        by curvlinops (:mod:`laplace_glas.curvature.backends`; BackPACK / ASDL classes
        are mapped with a warning, a stochastic GGN or an unknown class is refused).
        ``la.curvature`` records the choice.
    n_components : int, optional
        ``k``, the number of leading GGN eigenpairs (``1 <= k < D``). Default:
        ``min(20, D - 1)``, so that the default works on any model with ``D >= 2``
        (for a model that small laplace-torch's ``'full'`` is exact and cheap).
    loss_scaling : {'sum', 'mean'}, default='sum'
        Standard Bayesian (``s = N``, as laplace-torch) or generalized (``s = 1``, GLAS's
        route to calibrated intervals with :meth:`calibrate`) scaling of the loss.
    complement : {'auto', 'zero', 'prior', 'diag', 'kron', 'kron_diag'}, default='auto'
        Variance outside ``span(U)``: none, the prior's ``1/tau`` (laplace-torch's
        ``LowRankLaplace``), or that of the GGN diagonal's (``'diag'``,
        :mod:`~laplace_glas.posterior.complement`), KFAC's (``'kron'``,
        :mod:`~laplace_glas.posterior.kron_complement`) or KFAC's where it covers a layer
        and the GGN diagonal's elsewhere (``'kron_diag'``) curvature plus the prior,
        projected off ``span(U)`` (extra data passes in ``fit``; their evidence counts
        every direction). ``'auto'``: ``fit`` takes the first of ``'kron'``,
        ``'kron_diag'``, ``'diag'`` it can compute, else ``'zero'`` with a
        ``ZeroComplementWarning`` (``la.complement`` and ``la.complement_reason`` record
        the choice).
    solver : {'auto', 'dual', 'factored', 'lanczos', 'block'}, default='auto'
        Eigen-solver. ``'auto'``: the fastest exact strategy within ``memory_budget``
        (:mod:`laplace_glas.curvature.memory.planner`): where every trainable parameter sits in
        an ``nn.Linear``, ``nn.Conv1d/2d``, ``nn.LayerNorm``, ``nn.BatchNorm1d/2d``
        (eval) or ``nn.Embedding`` and there is no ``loss_fn``, the GGN factored from
        one forward and one batched backward pass
        (:mod:`laplace_glas.curvature.operators.factored`), eigen-solved through the
        ``NR x NR`` Gram matrix (``'dual'``) when that is cheaper, else by Lanczos on the
        factored products; then Lanczos (fully re-orthogonalised, images kept) on the
        linearised GGN (:mod:`laplace_glas.curvature.operators.linearized`: each batch's
        graph kept), then on curvlinops' operator (streaming).
        ``'lanczos'``: ARPACK's Lanczos (``scipy.sparse.linalg.eigsh``) on curvlinops'
        operator, one GGN product per data pass, the reference. ``'block'``: block
        Krylov with Rayleigh-Ritz on the factored, linearised or curvlinops operator
        (``block_size`` products per data pass).
    block_size : int, optional
        Columns per data pass of the block solver (default ``max(k, 8)``).
    tol : float, default=0.0
        Relative residual ``||G u - theta u|| <= tol theta`` of each pair (``0``: 1e-4
        in float32, where the products' own rounding limits the eigenvectors anyway;
        in float64 machine precision for Lanczos and 1e-8 for the block solver).
    maxiter : int, optional
        Lanczos restarts allowed (ARPACK's default ``10 * D``); block solver: data
        passes (default ``50 * ceil(max(k, 8) / block_size)``).
    ncv : int, optional
        Lanczos basis size (ARPACK's default ``min(D, max(2k + 1, 20))``).
    seed : int, default=0
        Seed of the generator used when ``generator`` is None.
    generator : torch.Generator, optional
        CPU generator for the Lanczos start vector and the data subsample.
    subsample_size : int, optional
        Compute the eigenpairs on this many training points drawn without
        replacement (the loss at the MAP still uses all data).
    rank_threshold : float, optional
        Eigenvalues below ``rank_threshold * lambda_1`` are treated as zero (default
        ``100 * eps`` of the model's dtype); a warning names how many.
    jvp_chunk_size : int or None, default=8
        Number of Jacobian-vector products vectorised at once in the 'glm'
        predictive and the calibration sweeps; ``None`` pushes all ``k`` at once.
        Memory grows with it (a weight-sized tangent per direction), speed hardly does.
    sample_chunk_size : int, default=32
        Number of weight samples pushed through the network at once ('nn').
    ignore_index : int, default=-100
        Classification targets equal to this value (padding) are left out of the
        loss, the GGN and the count N of likelihood terms.
    loss_fn : torch.nn.Module, optional
        A loss whose GGN defines the curvature instead of the likelihood's:
        ``G = (1/N) sum_n J_n^T (d^2 l(f_n, y_n) / d f^2) J_n`` with ``l = loss_fn``,
        called on the model outputs and targets as they are. Any module curvlinops
        accepts (its Hessian in the outputs comes from autodiff), with
        ``reduction='sum'``: GLAS applies the ``1/N`` itself. It takes the place of
        ``0.5 * ||f - y||^2`` (regression, unit noise; ``sigma_noise`` still divides;
        note that ``nn.MSELoss(reduction='sum')`` is ``||f - y||^2``, twice the
        curvature) or the summed cross-entropy (classification, integer labels; e.g. a
        class-weighted ``nn.CrossEntropyLoss(weight=w, reduction='sum')``, a Huber
        loss, or a module of one's own; label smoothing leaves the GGN unchanged).
        For ``(batch, seq_len, vocab)`` outputs the loss must take the classes on the
        last axis (``nn.CrossEntropyLoss`` takes them on axis 1). Its buffers are
        moved to the model's device and dtype; an ``ignore_index`` attribute must
        equal ``ignore_index``. Only the curvature changes: the data-fit term of the
        evidence and the predictives keep laplace-torch's likelihood.
    progress_bar : bool, default=False
        Show ``tqdm`` progress bars during ``fit``.
    memory_budget : int, str or None, default=None
        Bytes the eigen-solve may take (operator, products and the solver's ``O(k D)``
        basis): an int, or a string such as ``'512MB'``, ``'1.5GiB'``, ``'64 MiB'``.
        ``None``: half of the free memory of the model's device at ``fit``. The planner
        (:mod:`laplace_glas.curvature.memory.planner`) takes the fastest exact strategy whose
        estimated peak fits, down to streaming (one batch's graph per product); a
        budget below every estimate raises ``MemoryBudgetError`` naming the smallest
        that works. ``lanczos_info.plan`` records the budget, the strategy, its
        estimate and the measured peak.
    diagonal_estimator : {'exact', 'mc'}, default='exact'
        The GGN diagonal of ``'diag'`` and ``'kron_diag'``: exact (BackPACK where it
        covers the model, else one reverse pass per output column and example), or the
        opt-in Monte Carlo estimate ``sum_n (J_n^T Lambda_n^{1/2} xi_n)^2`` with
        Rademacher ``xi_n`` drawn from a generator seeded with ``seed`` (unbiased, one
        reverse pass per example: ``C`` times cheaper than the exact per-example pass,
        and the way to a diagonal for outputs too wide for it, e.g. a vocabulary).

    """

    _key = ("all", "glas")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # laplace-torch's factory maps `_key` over *all* subclasses. A subclass that
        # inherits ours would compete for ('all', 'glas'); give it a private key.
        super().__init_subclass__(**kwargs)
        if "_key" not in cls.__dict__:
            cls._key = (f"{cls.__module__}.{cls.__qualname__}", "unregistered")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        sigma_noise: float | torch.Tensor = 1.0,
        prior_precision: float | torch.Tensor = 1.0,
        prior_mean: float | torch.Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: type | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        *,
        n_components: int | None = None,
        loss_scaling: str = "sum",
        complement: str = "auto",
        solver: str = "auto",
        block_size: int | None = None,
        tol: float = 0.0,
        maxiter: int | None = None,
        ncv: int | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        subsample_size: int | None = None,
        rank_threshold: float | None = None,
        jvp_chunk_size: int | None = 8,
        sample_chunk_size: int = 32,
        ignore_index: int = -100,
        loss_fn: nn.Module | None = None,
        progress_bar: bool = False,
        memory_budget: int | str | None = None,
        diagonal_estimator: str = "exact",
    ) -> None:
        n_params, dtype = trainable_size_and_dtype(model)
        likelihood, enable_backprop = laplace_arguments(
            likelihood, _LIKELIHOODS, sigma_noise=sigma_noise, dtype=dtype,
            enable_backprop=enable_backprop, dict_key_x=dict_key_x, dict_key_y=dict_key_y,
        )  # fmt: skip
        self.loss_scaling = loss_scaling  # validated by the property
        # a subset class whose weights are not known yet checks k when they are
        bound = n_params if self._k_bound_known_at_init else math.inf
        self._k_from_default = n_components is None
        n_components = self._validate_n_components(self._capped_default(n_components, bound), bound)
        curvature = resolve_backend(backend, backend_kwargs)
        complement = self._checked_complement(complement, curvature.kind, loss_fn)
        settings = solver_settings(
            n_components, n_params, solver=choice("solver", solver, SOLVERS),
            block_size=block_size, tol=tol, maxiter=maxiter, ncv=ncv, seed=seed,
            generator=generator, subsample_size=subsample_size,
            rank_threshold=rank_threshold, jvp_chunk_size=jvp_chunk_size,
            sample_chunk_size=sample_chunk_size, ignore_index=ignore_index,
            progress_bar=progress_bar, memory_budget=memory_budget,
        )  # fmt: skip
        validate_loss_fn(loss_fn, settings["ignore_index"] if likelihood != "regression" else None)

        super().__init__(
            model,
            likelihood,
            sigma_noise=sigma_noise,
            prior_precision=prior_precision,
            prior_mean=prior_mean,
            temperature=temperature,
            enable_backprop=enable_backprop,
            dict_key_x=dict_key_x,
            dict_key_y=dict_key_y,
            backend=None,
            backend_kwargs=backend_kwargs,
            asdl_fisher_kwargs=asdl_fisher_kwargs,
        )
        self.complement = complement
        self.curvature = curvature
        self._n_components = n_components
        for name, value in settings.items():  # solver, tol, seed, ... (checked above)
            setattr(self, name, value)
        self.loss_fn = loss_fn
        self.diagonal_estimator = choice(
            "diagonal_estimator", diagonal_estimator, DIAGONAL_ESTIMATORS,
            " (the GGN diagonal of the complement: exact, or one sampled column per output)",
        )  # fmt: skip
        self._eigenpairs: Eigenpairs | None = None
        self._out_shape: torch.Size | None = None
        self._param_names = parameter_names(model, self.params)
        self._param_shapes = [p.shape for p in self.params]

    # ------------------------------------------------------------------ helpers

    @property
    def _curvature_likelihood(self) -> str:
        """The likelihood of the curvature and of the training loss: laplace-torch fits
        ``'reward_modeling'`` as ``'classification'`` (Bradley-Terry preference pairs:
        a softmax over the pair's two rewards).
        """
        return curvature_likelihood(self.likelihood)

    def _init_H(self) -> None:
        self.H: tuple[torch.Tensor, torch.Tensor] | None = None

    def _check_H_init(self) -> None:
        if getattr(self, "H", None) is None:
            raise NotFittedError(
                "This ActiveSubspaceLaplace is not fitted yet: call fit(train_loader) "
                "(or load_state_dict) first."
            )

    # ------------------------------------------------------------------ state

    @property
    def lanczos_info(self) -> Eigenpairs:
        """The eigen-solve record: products used, residuals, wall time (all ``k``
        computed pairs, not only the active ones), the plan and its memory (budget,
        strategy, estimated and measured peak).
        """
        self._check_H_init()
        return self._eigenpairs

    @property
    def posterior(self) -> FittedPosterior:
        """A read-only view of the fitted posterior
        (:class:`~laplace_glas.posterior.view.FittedPosterior`): eigenpairs, curvature,
        prior, scaling, parameter names and shapes, device, dtype and the eigen-solve's
        record, taken now. Diagnostics, calibration and persistence read this view.
        """
        self._check_H_init()
        k_computed = self.H[0].shape[1]
        return FittedPosterior(
            eigenvectors=self.H[0],
            ggn_eigenvalues=self._eigenvalues_up_to(k_computed),
            curvature=self._curvature_up_to(k_computed),
            n_components=self._n_components,
            prior_precision=self.prior_precision,
            prior=self._prior,
            prior_mean=self.prior_mean,
            mean=self.mean,
            network_weights=self._network_weights(),
            scaling_factor=self.scaling_factor,
            n_data=self.n_data,
            sigma_noise=self.sigma_noise,
            temperature=self.temperature,
            likelihood=self.likelihood,
            complement=self.complement,
            param_names=tuple(self._param_names),
            param_shapes=tuple(self._param_shapes),
            device=self._device,
            dtype=self._dtype,
            eigen_solve=self._eigenpairs,
            weight_indices=getattr(self, "subnetwork_indices", None),
            ggn_diagonal=getattr(self, "_ggn_diagonal", None),
            ggn_kron=getattr(self, "_ggn_kron", None),
            complement_curvature=(
                self._complement_curvature() if self.complement in CURVATURE_COMPLEMENTS else None
            ),
            process_group=getattr(self, "_process_group", None),
            ignore_index=self.ignore_index,
            dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y,
            network_directions=self._network_directions_up_to,
            embed_weight_draws=self._embed_weight_draws,
            prior_gram_diagonal=self._prior_gram_diagonal,
            glm_moments=self._glm_moments,
            check_inputs=self._check_inputs,
            check_fitted_weights=self._check_fitted_weights,
            to_device=self._to_device,
        )

    def _eigenvalues_up_to(self, k: int) -> torch.Tensor:
        """``lambda_1..k`` of the mean-loss GGN, for any ``k`` up to the computed number."""
        self._check_H_init()
        return self.H[1][:k] / (self.n_data * self.sigma_noise.square())

    def _curvature_up_to(self, k: int) -> torch.Tensor:
        """``a_j = s * lambda_j / T`` for ``j <= k``, any ``k`` up to the computed number
        (refused where it overflows the dtype: :meth:`_check_representable_curvature`).
        """
        self._check_H_init()
        self._check_representable_curvature()
        return self._H_factor * self.H[1][:k]

    @property
    def eigenvectors(self) -> torch.Tensor:
        """``U``: ``(D, k)`` orthonormal leading eigenvectors of the mean-loss GGN."""
        self._check_H_init()
        return self.H[0][:, : self._n_components]

    @property
    def eigenvalues(self) -> torch.Tensor:
        """``lambda``: ``(k,)`` leading eigenvalues (descending) of the mean-loss GGN
        ``G = (1/N) sum_n J_n^T Lambda_n J_n`` (``Lambda = 1/sigma^2`` for regression).
        """
        return self._eigenvalues_up_to(self._n_components)

    @property
    def subspace_curvature(self) -> torch.Tensor:
        """``a_j = s * lambda_j / T``: the posterior's curvature along ``u_j``."""
        return self._curvature_up_to(self._n_components)

    # ------------------------------------------------------------------ prior tuning
    def _gridsearch(
        self,
        loss: torchmetrics.Metric | Callable,
        interval: torch.Tensor,
        val_loader: DataLoader,
        pred_type: PredType | str,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        progress_bar: bool = False,
    ) -> torch.Tensor:
        """laplace-torch's grid search; after a data-parallel fit the validation losses of
        all ranks' shards are averaged
        (:func:`laplace_glas.curvature.parallel.collectives.gridsearch`).
        """
        shards = data_parallel(getattr(self, "_process_group", None))
        outputs = self.n_outputs if self.likelihood == "regression" else None
        check = partial(grid_validation_data, val_loader, self.dict_key_y, outputs)
        if shards is None:
            check()
            return super()._gridsearch(
                loss, interval, val_loader, pred_type, link_approx, n_samples, progress_bar
            )
        args = (loss, interval, val_loader, pred_type, link_approx, n_samples, check)
        return gridsearch(self, shards, *args)

    # ------------------------------------------------------------------ calibration
    @unchanged_on_failure
    def calibrate(
        self,
        calib_loader: DataLoader,
        coverage: float = 0.9,
        ks: list[int] | None = None,
        prior_precisions: list[float] | None = None,
        pred_type: str = "glm",
        n_samples: int = 200,
        generator: torch.Generator | None = None,
        include_noise: bool = True,
        empirical_bayes: bool = True,
    ) -> DimensionSelection:
        """Select ``k`` and the prior precision by coverage on held-out data and apply them.

        See :func:`laplace_glas.diagnostics.calibration.select_dimension` for the arguments. The
        eigenpairs computed by ``fit`` are truncated, not recomputed. When the nominal
        coverage is not reached, the best candidate is applied and a
        ``CoverageNotReachedWarning`` is raised.
        """
        selection = select_dimension(
            self,
            calib_loader,
            coverage=coverage,
            ks=ks,
            prior_precisions=prior_precisions,
            pred_type=pred_type,
            n_samples=n_samples,
            generator=generator,
            include_noise=include_noise,
            empirical_bayes=empirical_bayes,
        )
        self.n_components = selection.k
        if selection.prior_precision is not None:  # None: the own structured prior
            self.prior_precision = selection.prior_precision
        return selection

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state plus the eigen-solve record and the GLAS settings
        (:func:`laplace_glas.io.glas_state`).
        """
        self._check_H_init()
        return {**glas_state(self, super().state_dict()), **self._complement_state()}

    @unchanged_on_failure
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a fitted posterior saved by :meth:`state_dict` (no refit).

        The whole state is validated first (:func:`laplace_glas.io.check_state`):
        a refused state raises ``ValueError`` naming the entry and leaves this object
        unchanged. See :func:`laplace_glas.io.restore_glas_state`.
        """
        device, dtype = self._device, self._dtype
        eigenpairs = restore_glas_state(
            self,
            state_dict,
            loss_scalings=LOSS_SCALINGS,
            complements=COMPLEMENTS,
            dtype=dtype,
        )
        super().load_state_dict(state_dict)
        self.loss = torch.as_tensor(self.loss).to(device, dtype)
        U, h = state_dict["H"]
        self.H = (U.to(device, dtype), h.to(device, dtype))
        self.mean = self.mean.to(device, dtype)
        self.loss_scaling = state_dict["loss_scaling"]
        self._restore_complement(state_dict)
        self._eigenpairs = eigenpairs.to(device, dtype)
        self._n_components = int(state_dict["n_components"])
        self._ggn_diagonal, self._ggn_kron = restored_complement(state_dict, device, dtype)
