"""ActiveSubspaceLaplace: the GLAS posterior behind laplace-torch's interface.

The class is thin: the predictive methods live in the mixin
:mod:`laplace_glas.predictive.subspace_predictive`, the posterior operators, evidence terms,
sampling and prior tuning in the mixin :mod:`laplace_glas.posterior.subspace` (with the
layerwise / diagonal prior algebra in :mod:`laplace_glas.posterior.prior`), the eigen-solve in
:mod:`laplace_glas.curvature.eigensolve` (the problem in
:mod:`laplace_glas.curvature.problem`, the operator and solver chosen by
:mod:`laplace_glas.curvature.planner`), the data pass of ``fit`` and the choice of the
GGN's loss in :mod:`laplace_glas.curvature.fitting`, the closed forms in
:mod:`laplace_glas.posterior.closed_forms`, the forward-mode JVPs in
:mod:`laplace_glas.predictive.jvp`,
the state-dict checks in :mod:`laplace_glas.io` and the argument checks in
:mod:`laplace_glas.validation`. What is here is the laplace-torch contract: the
``Laplace(model, likelihood, 'all', 'glas')`` registration, ``fit``, the
hyperparameters and (de)serialisation.

Conventions (laplace-torch's): ``H`` is the *summed*, unit-noise curvature; the
observation noise and the temperature enter through ``_H_factor`` when ``H`` is read.
Here ``H = (U, h)`` with ``U`` the ``(D, k)`` eigenvectors and ``h = N * eig(G_1)``,
``G_1`` the unit-noise GGN of the mean loss. With loss scaling ``s`` (``'mean'``:
``s = 1``; ``'sum'``: ``s = N``) the posterior sees the curvature

.. math::

    a_j = \\frac{s}{N \\sigma^2 T} h_j = \\frac{s \\lambda_j}{T}, \\qquad
    \\lambda_j = \\frac{h_j}{N \\sigma^2},

so ``loss_scaling='mean'`` is exactly laplace-torch at ``temperature = N`` and
``loss_scaling='sum'`` is the standard Bayesian posterior.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torchmetrics
from laplace.baselaplace import ParametricLaplace
from laplace.utils.enums import LinkApprox, PredType
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, RandomSampler

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.backends import resolve_backend
from laplace_glas.curvature.distributed import (
    Shards,
    broadcast_eigenpairs,
    data_parallel,
    distribute_operator,
    gridsearch,
    reduce_map_loss,
)
from laplace_glas.curvature.eigenpairs import Eigenpairs, NumericalRankWarning
from laplace_glas.curvature.eigensolve import compute_eigenpairs
from laplace_glas.curvature.fitting import MapLoss, loss_at_map, validate_loss_fn
from laplace_glas.curvature.operators.updated import StoredCurvature, add_stored_curvature
from laplace_glas.curvature.planner import SOLVERS, Plan, plan_solve
from laplace_glas.curvature.problem import CurvatureProblem, curvature_likelihood
from laplace_glas.diagnostics.calibration import DimensionSelection, select_dimension
from laplace_glas.io import glas_state, restore_glas_state
from laplace_glas.posterior.subspace import SubspacePosterior
from laplace_glas.posterior.view import FittedPosterior
from laplace_glas.predictive.jvp import (
    parameter_names,
)
from laplace_glas.predictive.subspace_predictive import (
    FittedWeightsChangedWarning,
    SubspacePredictive,
)
from laplace_glas.validation import (
    ArgumentTypeError,
    choice,
    finite_number,
    flag,
    homoscedastic_noise,
    integer,
    lanczos_basis_size,
    parameter_dtype,
    positive_int,
    positive_scalar,
    prior_precision_values,
    reiterable,
    scalar_value,
    tolerance,
)
from laplace_glas.validation import seed as valid_seed

__all__ = ["ActiveSubspaceLaplace", "FittedWeightsChangedWarning", "NotFittedError"]

_LOSS_SCALINGS = ("mean", "sum")
_LIKELIHOODS = ("regression", "classification", "reward_modeling")
_COMPLEMENTS = ("zero", "prior")


class NotFittedError(ValueError, AttributeError):
    """A method that needs the posterior was called before ``fit``.

    Also an ``AttributeError``: ``hasattr(la, 'eigenvalues')`` is False before ``fit``.
    """


class ActiveSubspaceLaplace(SubspacePredictive, SubspacePosterior, ParametricLaplace):
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
    n_components : int, default=20
        ``k``, the number of leading GGN eigenpairs (``1 <= k < D``).
    loss_scaling : {'mean', 'sum'}, default='mean'
        Generalized (``s = 1``, the GLAS default) or standard Bayesian (``s = N``)
        scaling of the loss.
    complement : {'zero', 'prior'}, default='zero'
        Variance outside ``span(U)``: none (GLAS), or the prior's ``1/tau`` (the
        posterior of laplace-torch's ``LowRankLaplace``).
    solver : {'auto', 'dual', 'factored', 'lanczos', 'block'}, default='auto'
        Eigen-solver. ``'auto'``: where every trainable parameter sits in an
        ``nn.Linear``, ``nn.Conv1d/2d``, ``nn.LayerNorm``, ``nn.BatchNorm1d/2d`` (eval)
        or ``nn.Embedding`` and there is no ``loss_fn``, the GGN is factored from one
        forward and one batched backward pass (:mod:`laplace_glas.curvature.operators.factored`)
        and eigen-solved through the ``NR x NR`` Gram matrix (``'dual'``) when it fits
        ``max(768 MiB, k D itemsize)`` and is cheaper, else by Lanczos on the
        factored products (``'factored'``); any other model gets Lanczos on the
        linearised GGN (:mod:`laplace_glas.curvature.operators.linearized`: each batch's forward
        graph kept, no forward pass per product), or on curvlinops' operator where the
        kept graphs would exceed their budget (recorded in ``lanczos_info.operator``).
        The factors, and the kept graphs, take at most ``max(2 GiB, 4 k D itemsize)``.
        ``'lanczos'``: ARPACK's Lanczos (``scipy.sparse.linalg.eigsh``) on curvlinops'
        operator, one GGN product per data pass, the reference. ``'block'``: block
        Krylov with Rayleigh-Ritz on the factored, linearised or curvlinops operator
        (``block_size`` products per data pass).
    block_size : int, optional
        Columns per data pass of the block solver (default ``max(k, 8)``).
    tol : float, default=0.0
        Relative tolerance (``0``: machine precision of the model's dtype for Lanczos;
        1e-5 / 1e-8 in float32 / float64 for the block solver).
    maxiter : int, optional
        Lanczos restarts allowed (ARPACK's default ``10 * D``); data passes for the
        block solver (default 50).
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
        Memory grows with it (each direction carries a weight-sized tangent through
        every layer), speed hardly does: on the 1.6M-weight SMILES LSTM with k = 20,
        100 sequences, 'glm' took 18.0 s and +3.7 GB with all 20 at once, 11.8 s and
        +1.3 GB with 8.
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
        n_components: int = 20,
        loss_scaling: str = "mean",
        complement: str = "zero",
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        trainable = [p for p in model.parameters() if p.requires_grad]
        n_params = sum(p.numel() for p in trainable)
        if n_params == 0:
            raise ValueError(
                "The model has no parameters that require grad: there is nothing to "
                "put a posterior on."
            )
        dtype = parameter_dtype(trainable)
        likelihood = choice("likelihood", likelihood, _LIKELIHOODS)
        self.loss_scaling = loss_scaling  # validated by the property
        complement = choice(
            "complement", complement, _COMPLEMENTS, " (no variance / the prior's outside span(U))"
        )
        solver = choice("solver", solver, SOLVERS)
        # a subset class whose weights are not known yet checks k when they are
        bound = n_params if self._k_bound_known_at_init else math.inf
        n_components = self._validate_n_components(n_components, bound)
        curvature = resolve_backend(backend, backend_kwargs)
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValueError(f"generator must be a CPU torch.Generator or None, got {generator!r}.")
        block_size, maxiter, ncv, subsample_size, jvp_chunk_size = (
            positive_int(name, value)
            for name, value in (
                ("block_size", block_size),
                ("maxiter", maxiter),
                ("ncv", ncv),
                ("subsample_size", subsample_size),
                ("jvp_chunk_size", jvp_chunk_size),
            )
        )
        lanczos_basis_size(ncv, n_components, n_params)
        sample_chunk_size = positive_int("sample_chunk_size", sample_chunk_size, allow_none=False)
        tol = tolerance(tol)
        seed = valid_seed(seed)
        if rank_threshold is not None:
            rank_threshold = finite_number("rank_threshold", rank_threshold, 0.0, 1.0)
        ignore_index = integer("ignore_index", ignore_index)
        enable_backprop = flag("enable_backprop", enable_backprop)
        progress_bar = flag("progress_bar", progress_bar)
        for name, key in (("dict_key_x", dict_key_x), ("dict_key_y", dict_key_y)):
            if not isinstance(key, str):
                raise ArgumentTypeError(f"{name} must be a str, got {key!r}.")
        # laplace-torch compares sigma_noise with 1 before its setter runs (a crash for
        # a tensor), so it is checked here; prior_precision and temperature are checked
        # by this class's setters inside ParametricLaplace.__init__
        homoscedastic_noise(sigma_noise, dtype, likelihood)
        validate_loss_fn(loss_fn, ignore_index if likelihood != "regression" else None)

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
        self.solver = solver
        self.block_size = block_size
        self.tol = tol
        self.maxiter = maxiter
        self.ncv = ncv
        self.seed = seed
        self.generator = generator
        self.subsample_size = subsample_size
        self.rank_threshold = rank_threshold
        self.jvp_chunk_size = jvp_chunk_size
        self.sample_chunk_size = sample_chunk_size
        self.ignore_index = ignore_index
        self.loss_fn = loss_fn
        self.progress_bar = progress_bar
        self._eigenpairs: Eigenpairs | None = None
        self._out_shape: torch.Size | None = None
        self._param_names = parameter_names(model, self.params)
        self._param_shapes = [p.shape for p in self.params]

    # ------------------------------------------------------------------ helpers
    _k_bound_known_at_init = True  # D is known at construction (False: checked later)

    @staticmethod
    def _validate_n_components(k: Any, n_params: int) -> int:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise ArgumentTypeError(f"n_components must be an int, got {type(k).__name__}.")
        k = int(k)
        if k < 1:
            raise ValueError(f"n_components must be >= 1, got {k}.")
        if k >= n_params:
            raise ValueError(
                f"n_components={k} must be smaller than the number of parameters "
                f"D={n_params}: Lanczos (scipy eigsh) finds at most D - 1 eigenpairs. "
                f"For a model this small, laplace-torch's FullLaplace "
                f"(hessian_structure='full') is exact and cheap."
            )
        return k

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
    def n_components(self) -> int:
        """``k``: the number of eigenpairs the posterior uses.

        Setting a smaller value after ``fit`` truncates to the leading eigenpairs
        without recomputing anything; a larger one than was computed needs a refit.
        """
        return self._n_components

    @n_components.setter
    def n_components(self, k: int) -> None:
        # n_params is None while a last-layer posterior has not found its layer
        k = self._validate_n_components(k, math.inf if self.n_params is None else self.n_params)
        if self._eigenpairs is not None and k > self._eigenpairs.k:
            raise ValueError(
                f"Only {self._eigenpairs.k} eigenpairs were computed; n_components={k} "
                "needs a refit with a larger n_components."
            )
        self._n_components = int(k)

    @property
    def loss_scaling(self) -> str:
        """``'mean'`` (s = 1) or ``'sum'`` (s = N). Changing it after ``fit`` is exact and
        free: the stored eigenpairs do not depend on the scaling.
        """
        return self._loss_scaling

    @loss_scaling.setter
    def loss_scaling(self, value: str) -> None:
        self._loss_scaling = choice(
            "loss_scaling", value, _LOSS_SCALINGS, " (generalized s = 1 / standard s = N)"
        )

    def with_loss_scaling(self, loss_scaling: str) -> ActiveSubspaceLaplace:
        """A shallow copy with another loss scaling, sharing the eigenpairs (no refit).

        Prior precision and ``n_components`` are copied, so tuning one does not
        change the other.
        """
        other = copy.copy(self)
        other.loss_scaling = loss_scaling
        other._prior_precision = self._prior_precision.clone()
        return other

    @property
    def scaling_factor(self) -> float:
        """``s``: 1 for ``loss_scaling='mean'``, N for ``'sum'``."""
        self._check_H_init()
        return 1.0 if self.loss_scaling == "mean" else float(self.n_data)

    @property
    def _H_factor(self) -> torch.Tensor:
        """``s / (N sigma^2 T)``: turns the summed unit-noise ``H`` into ``s * G / T``."""
        factor = super()._H_factor
        if self.loss_scaling == "mean":
            factor = factor / self.n_data
        return factor

    @property
    def lanczos_info(self) -> Eigenpairs:
        """The eigen-solve record: products used, residuals, wall time (all ``k``
        computed pairs, not only the active ones).
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
        """``a_j = s * lambda_j / T`` for ``j <= k``, any ``k`` up to the computed number."""
        self._check_H_init()
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

    @property
    def prior_precision(self) -> torch.Tensor:
        """The prior precision: laplace-torch's ``(1,)`` tensor ``tau``, or one positive
        value per parameter tensor (``(n_layers,)``) or per weight (``(D,)``).
        """
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, prior_precision: float | torch.Tensor) -> None:
        # refused before it is set, so that a failed call (e.g. log_marginal_likelihood
        # with a per-layer prior) leaves the posterior as it was; a tensor is stored as
        # given (it may carry gradients for the evidence)
        prior_precision_values(prior_precision, self.n_layers, self.n_params, self._dtype)
        if isinstance(prior_precision, torch.Tensor):
            prior_precision = prior_precision.reshape(-1)
        else:
            prior_precision = scalar_value("prior_precision", prior_precision)
        ParametricLaplace.prior_precision.fset(self, prior_precision)

    @property
    def sigma_noise(self) -> torch.Tensor:
        """The observation noise ``sigma > 0`` (regression; 1 for classification)."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, sigma_noise: float | torch.Tensor) -> None:
        homoscedastic_noise(sigma_noise, self._dtype, self.likelihood)
        if isinstance(sigma_noise, torch.Tensor):
            sigma_noise = sigma_noise.reshape(())
        else:
            sigma_noise = scalar_value("sigma_noise", sigma_noise)
        ParametricLaplace.sigma_noise.fset(self, sigma_noise)

    @property
    def temperature(self) -> float | torch.Tensor:
        """The likelihood's temperature ``T > 0`` (the curvature is divided by it)."""
        return self._temperature

    @temperature.setter
    def temperature(self, temperature: float | torch.Tensor) -> None:
        number = positive_scalar("temperature", temperature, dtype=self._dtype)
        # numbers are stored as floats (a huge Python int would overflow torch's int64)
        # a tensor is kept (it may carry gradients) as a 0-d one: shape (1, 1) would
        # broadcast the evidence and the variances into matrices
        if isinstance(temperature, torch.Tensor):
            self._temperature = temperature.reshape(())
        else:
            self._temperature = number

    @property
    def prior_mean(self) -> torch.Tensor:
        """The prior mean ``mu_0``: a scalar or one value per weight (finite)."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, prior_mean: float | torch.Tensor) -> None:
        if isinstance(prior_mean, torch.Tensor) and prior_mean.ndim > 1:
            raise ValueError(
                "prior_mean must be a scalar or a vector of D="
                f"{self.n_params} entries (as in laplace-torch), got shape "
                f"{tuple(prior_mean.shape)}."
            )
        if isinstance(prior_mean, torch.Tensor) and prior_mean.numel() not in (1, self.n_params):
            raise ValueError(
                f"prior_mean must be a scalar or have D={self.n_params} entries, got shape "
                f"{tuple(prior_mean.shape)}."
            )
        if isinstance(prior_mean, torch.Tensor):
            finite = bool(torch.isfinite(prior_mean).all())
        else:
            finite = math.isfinite(scalar_value("prior_mean", prior_mean))
        if not finite:
            raise ValueError("prior_mean must be finite (no NaN or inf).")
        ParametricLaplace.prior_mean.fset(self, prior_mean)

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool | None = None,
        *,
        process_group: Any = None,
    ) -> None:
        """Compute the top-k eigenpairs of the mean-loss GGN and the loss at the MAP.

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
            with rank 0's eigenpairs (:mod:`laplace_glas.curvature.distributed`).
            Default: ``torch.distributed``'s default group when it is initialised; a
            group of one rank fits on the local data alone.

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
        self.model.eval()
        shards = data_parallel(process_group)
        # nothing is assigned until the solve has succeeded: a failed fit leaves the
        # previous posterior (or the unfitted state) as it was
        loss, n_data, out_shape = self._loss_at_map(train_loader, show, shards)
        generator = self.generator
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        stored = None
        if update:
            if out_shape[-1] != self.n_outputs:
                raise ValueError(
                    f"fit(override=False) adds data of the fitted kind: the model now has "
                    f"{out_shape[-1]} outputs, the fitted posterior {self.n_outputs}."
                )
            stored = StoredCurvature(*self.H, self.n_data)
        k = self._validate_n_components(
            self.H[0].shape[1] if update else self._n_components, self.n_params
        )
        problem = self._curvature_problem(
            train_loader, out_shape, n_data, generator, self.subsample_size, shards, show
        )
        eig = self._solve(problem, k, generator, stored=stored)
        if update:
            loss, n_data = self.loss + loss, self.n_data + n_data
        n_below = int(eig.below_threshold.sum())
        if n_below:
            warnings.warn(
                f"{n_below} of the {eig.k} eigenvalues lie below "
                f"{eig.rank_threshold:.1e} x lambda_1, beyond what the "
                f"{str(self._dtype).replace('torch.', '')} GGN products resolve: they "
                "are treated as zero curvature (prior variance along those directions). "
                "Use fewer components, or float64 for the spectrum's tail.",
                NumericalRankWarning,
                stacklevel=2,
            )
        self.mean = parameters_to_vector(self.params).detach()
        self.loss = loss
        self.n_data = n_data  # likelihood terms: data points, or tokens for sequences
        self.n_outputs = out_shape[-1]
        self._out_shape = out_shape
        self.model.output_size = self.n_outputs
        self._eigenpairs = eig
        self._n_components = eig.k
        self.H = (eig.vectors, n_data * eig.values)
        self._process_group = process_group

    def _loss_at_map(self, loader: Any, show: bool, shards: Shards | None = None) -> MapLoss:
        """:func:`laplace_glas.curvature.fitting.loss_at_map` with this posterior's
        settings, summed over the ranks of ``shards``.
        """
        local = loss_at_map(
            self.model,
            loader,
            self._curvature_likelihood,
            ignore_index=self.ignore_index,
            dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y,
            device=self._device,
            dtype=self._dtype,
            loss_fn=self.loss_fn,
            progress_bar=show,
        )
        return reduce_map_loss(local, shards)

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
        :meth:`fit`.

        Returns
        -------
        Eigenpairs
            Eigenvalues of ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n`` with unit noise
            (divide by ``sigma^2`` for the regression GGN); with ``loss_fn``,
            ``Lambda_n`` is that loss's Hessian in the outputs.

        """
        k = self._n_components if n_components is None else n_components
        k = self._validate_n_components(k, self.n_params)
        reiterable("train_loader", train_loader)
        ncv = lanczos_basis_size(self.ncv if ncv is None else ncv, k, self.n_params)
        tol = self.tol if tol is None else tolerance(tol)
        maxiter = self.maxiter if maxiter is None else positive_int("maxiter", maxiter)
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        if process_group is None:
            process_group = getattr(self, "_process_group", None)
        shards = data_parallel(process_group)
        out_shape, n_terms = getattr(self, "_out_shape", None), None
        if not out_shape:  # before fit: a pass at the MAP gives both
            _, n_terms, out_shape = self._loss_at_map(train_loader, False, shards)
        # after fit: the output shape per point is the model's; N is this loader's
        problem = self._curvature_problem(
            train_loader, out_shape, n_terms, generator, subsample_size, shards, progress_bar
        )
        return self._solve(problem, k, generator, tol=tol, maxiter=maxiter, ncv=ncv)

    def _curvature_problem(
        self,
        loader: Any,
        out_shape: torch.Size,
        n_terms: int | None,
        generator: torch.Generator,
        subsample_size: int | None,
        shards: Shards | None,
        progress_bar: bool,
    ) -> CurvatureProblem:
        """The curvature of ``loader`` with this posterior's settings
        (:meth:`~laplace_glas.curvature.problem.CurvatureProblem.build`; ``n_terms=None``
        counts ``N``).
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
            loss_fn=self.loss_fn,
            ignore_index=self.ignore_index,
            dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y,
            device=self._device,
            dtype=self._dtype,
            shards=shards,
            progress_bar=progress_bar,
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
    ) -> Eigenpairs:
        """The top-``k`` eigenpairs of ``problem`` (plus ``stored``, the fitted
        curvature, for ``fit(override=False)``), on every rank of ``problem.shards``.

        ``tol``, ``maxiter`` and ``ncv`` are checked values; ``None`` takes the
        constructor's (``ncv``: checked against ``k``).
        """
        if ncv is None:
            ncv = lanczos_basis_size(self.ncv, k, self.n_params)
        with autodiff_friendly(self.model):
            plan = distribute_operator(self._plan(problem, k), problem)
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
                block_size=self.block_size,
                operator_name=plan.operator_name,
            )
        eig = replace(eig, plan={**plan.summary(), "solver": eig.solver})
        return broadcast_eigenpairs(eig, problem.shards)

    def _plan(self, problem: CurvatureProblem, k: int) -> Plan:
        """The operator and solver for ``problem`` with this posterior's ``solver`` and
        ``curvature`` (:func:`laplace_glas.curvature.planner.plan_solve`).
        """
        return plan_solve(problem, k, self.solver, self.curvature)

    # ------------------------------------------------------------------ posterior
    @property
    def scatter(self) -> torch.Tensor:
        """``(theta* - mu_0)^T P_0 (theta* - mu_0)`` over the full space (laplace-torch's
        convention).
        """
        self._check_H_init()
        return super().scatter

    @property
    def log_likelihood(self) -> torch.Tensor:
        """``-s * Lbar(theta*) / T`` plus the Gaussian normaliser for regression:
        laplace-torch's log likelihood with the GLAS loss scaling.

        ``Lbar`` is the mean loss (``0.5 * ||f - y||^2 / sigma^2`` per point, or the
        cross-entropy per target). As in laplace-torch at ``temperature = N`` (which
        ``loss_scaling='mean'`` equals), the normaliser ``-N C log(sigma sqrt(2 pi))``
        is not scaled: under mean scaling the evidence's dependence on ``sigma_noise``
        is not a likelihood's, so tune ``sigma_noise`` with ``loss_scaling='sum'`` (or
        on held-out data), not through the mean-scaled evidence.
        """
        self._check_H_init()
        return super().log_likelihood

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
        all ranks' shards are averaged (:func:`laplace_glas.curvature.distributed.gridsearch`).
        """
        shards = data_parallel(getattr(self, "_process_group", None))
        if shards is None:
            return super()._gridsearch(
                loss, interval, val_loader, pred_type, link_approx, n_samples, progress_bar
            )
        return gridsearch(
            self, shards, loss, interval, val_loader, pred_type, link_approx, n_samples
        )

    # ------------------------------------------------------------------ calibration
    def calibrate(
        self,
        calib_loader: DataLoader,
        coverage: float = 0.9,
        ks: list[int] | None = None,
        prior_precisions: list[float] | None = None,
        pred_type: str = "glm",
        n_samples: int = 200,
        generator: torch.Generator | None = None,
        include_noise: bool = False,
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
        return glas_state(self, super().state_dict())

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
            loss_scalings=_LOSS_SCALINGS,
            complements=_COMPLEMENTS,
            dtype=dtype,
        )
        super().load_state_dict(state_dict)
        self.loss = torch.as_tensor(self.loss).to(device, dtype)
        U, h = state_dict["H"]
        self.H = (U.to(device, dtype), h.to(device, dtype))
        self.mean = self.mean.to(device, dtype)
        self.loss_scaling = state_dict["loss_scaling"]
        self.complement = state_dict["complement"]
        self._eigenpairs = eigenpairs.to(device, dtype)
        self._n_components = int(state_dict["n_components"])
