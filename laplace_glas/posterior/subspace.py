"""The posterior half of the laplace-torch contract for a subspace Laplace posterior.

:class:`SubspacePosterior` is a mixin of
:class:`~laplace_glas.laplace.ActiveSubspaceLaplace`: the precision and covariance
operators, the evidence's log-determinants, the log density, sampling and prior
tuning. They ask the prior (a :class:`~laplace_glas.posterior.prior.Prior` built from
``prior_precision``) for the posterior of ``(U, a)``: with a scalar prior precision
``tau`` the closed forms of :mod:`laplace_glas.posterior.closed_forms`
(``v_j = 1 / (a_j + tau)``, 1-D empirical Bayes); with a layerwise or diagonal prior
``P_0 = diag(p)`` (laplace-torch's ``prior_precision`` of one value per parameter
tensor or per weight) the ``O(k^2 D)`` algebra of
:mod:`laplace_glas.posterior.diagonal_prior`: the ``k x k`` restricted precision
``diag(a) + U^T P_0 U`` (``complement='zero'``) or Woodbury's form of
``(P_0 + U diag(a) U^T)^{-1}`` (``complement='prior'``), and the evidence's Occam term
``log det(I + diag(sqrt a) U^T P_0^{-1} U diag(sqrt a))``.

The mixin reads ``eigenvectors``, ``subspace_curvature``, ``prior_precision``,
``params``, ``complement``, ``mean`` and ``n_params`` of the class it is
mixed into.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torchmetrics
from laplace.utils.enums import LinkApprox, PredType, PriorStructure, TuningMethod
from laplace.utils.utils import fix_prior_prec_structure
from torch.utils.data import DataLoader

from laplace_glas.posterior.closed_forms import (
    ScalarPriorPosterior,
    SubspaceOperator,
    optimal_prior_precision,
    proper_tau,
)
from laplace_glas.posterior.complement import (
    optimal_complement_prior_precision,
)
from laplace_glas.posterior.diagonal_prior import (
    DiagonalPriorPosterior,
    LowRankDiagonalOperator,
    layer_grams,
)
from laplace_glas.posterior.hyperparameters import CURVATURE_COMPLEMENTS, unchanged_on_failure
from laplace_glas.posterior.kron_complement import (
    KronCurvature,
    curvature_complement_posterior,
    projected_residual,
)
from laplace_glas.posterior.prior import Prior
from laplace_glas.validation import (
    choice,
    finite_number,
    grid_bounds_and_loss,
    positive_int,
    reiterable,
    scalar_prior_precision,
)

REPRESENTABLE_MARGIN = 1e-2
"""The share of the dtype's largest number the scaled curvature may reach."""

__all__ = ["SubspacePosterior"]

_PRIOR_STRUCTURES = ("scalar", "layerwise", "diag")
_TUNING_METHODS = tuple(m.value for m in TuningMethod)
_GRID_PRED_TYPES = ("glm", "nn")  # the predictives the grid search scores
_LINKS = tuple(link.value for link in LinkApprox)


class SubspacePosterior:
    """Posterior operators, evidence terms, sampling and prior tuning (a mixin; see
    the module).
    """

    #: True where the posterior's directions are embedded in a larger network (a
    #: subnetwork posterior): layerwise and diagonal priors are refused there.
    _directions_embedded = False

    # ------------------------------------------------------------------ evidence terms
    @unchanged_on_failure
    def log_marginal_likelihood(
        self,
        prior_precision: torch.Tensor | None = None,
        sigma_noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """laplace-torch's log evidence (differentiable in ``prior_precision`` and
        ``sigma_noise``, which it sets, as laplace-torch does; a refused call leaves
        both as they were).

        Under ``loss_scaling='mean'`` the evidence is laplace-torch's at ``T = N``, whose
        Gaussian normaliser is not tempered: as a function of ``sigma_noise`` it is not
        a likelihood, and maximising it drives ``sigma`` far below the residuals' scale.
        Passing ``sigma_noise`` then warns; tune the noise with ``loss_scaling='sum'``
        (:meth:`with_loss_scaling` shares the eigenpairs) or on held-out data.
        """
        if sigma_noise is not None and self.loss_scaling == "mean":
            warnings.warn(
                "log_marginal_likelihood(sigma_noise=...) under loss_scaling='mean' is not "
                "a likelihood in sigma (the mean-scaled evidence's normaliser is "
                "untempered): tuning sigma through it gives far too small a noise. Tune "
                "sigma_noise on la.with_loss_scaling('sum') (same eigenpairs) or on "
                "held-out data.",
                UserWarning,
                stacklevel=2,
            )
        if prior_precision is not None:  # laplace-torch's updates, then its formula
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            if self.likelihood != "regression":
                raise ValueError("Can only change sigma_noise for regression.")
            self.sigma_noise = sigma_noise
        log_likelihood = self.log_likelihood
        # summed in float64: near prior_precision = 1e38 the scatter exceeds float32's
        # range (an evidence of -inf) where the evidence itself does not
        evidence = log_likelihood.double() - 0.5 * (
            self.log_det_ratio.double() + self._scatter(torch.float64)
        )
        return evidence.to(log_likelihood.dtype)

    @property
    def scatter(self) -> torch.Tensor:
        """``(theta* - mu_0)^T P_0 (theta* - mu_0)`` over the full space (laplace-torch's
        convention).
        """
        return self._scatter(self.mean.dtype)

    def _scatter(self, dtype: torch.dtype) -> torch.Tensor:
        """:attr:`scatter` summed in float64, returned in ``dtype``."""
        self._check_H_init()
        delta = (self.mean - self.prior_mean).to(torch.float64)
        return ((delta * self.prior_precision_diag.to(torch.float64)) @ delta).to(dtype)

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

    # ------------------------------------------------------------------ prior
    @property
    def _prior(self) -> Prior:
        """``prior_precision`` as a :class:`~laplace_glas.posterior.prior.Prior` (scalar,
        layerwise or diagonal; validated when it was set).
        """
        return Prior.of(
            self.prior_precision,
            [q.numel() for q in self.params],
            self.n_params,
            dtype=self._dtype,
            device=self._device,
            check=False,
        )

    def _posterior(self) -> ScalarPriorPosterior | DiagonalPriorPosterior:
        """The posterior of ``(U, a)`` under the prior (:meth:`Prior.posterior`).

        A layerwise prior uses the cached per-layer Gram matrices ``U_l^T U_l``: after
        the first call, ``U^T P_0^{+-1} U`` costs ``O(L k^2)`` (a marglik step no
        longer touches ``U``).
        """
        if self._directions_embedded:
            self._prior.check_embedded(type(self).__name__)
        U, curvature = self.eigenvectors, self.subspace_curvature  # refused before a fit
        if self.complement in CURVATURE_COMPLEMENTS:
            factor = self._H_factor
            UCU, UU, m, log_det_UU = self._unit_projected_residual(U)
            return curvature_complement_posterior(
                self.complement, U, curvature, self._complement_prior(),
                self._complement_curvature(), (factor * UCU, UU, factor * m, log_det_UU),
            )  # fmt: skip
        return self._prior.posterior(U, curvature, self.complement, self._layer_grams)

    def _check_representable_curvature(self) -> None:
        """Refuse a likelihood factor ``s / (N sigma^2 T)`` that makes the posterior's
        curvature overflow the model's dtype.

        The GGN's top eigenvalue ``lambda_1`` bounds every direction's curvature (KFAC's
        within a small factor), so ``a_max = s lambda_1 / (N sigma^2 T)`` must stay
        ``REPRESENTABLE_MARGIN`` below the dtype's largest number, which leaves room for
        the sums and products of the closed forms (a float32 model with
        ``sigma_noise=3e-19``, accepted by the constructor, gave a NaN evidence).
        """
        top = float(self.H[1].max()) if self.H[1].numel() else 0.0
        largest = float(torch.as_tensor(self._H_factor).detach()) * top
        limit = torch.finfo(self._dtype).max * REPRESENTABLE_MARGIN
        if largest > limit:
            raise ValueError(
                f"The posterior's curvature overflows {str(self._dtype).replace('torch.', '')}: "
                f"s * lambda_1 / (N sigma^2 T) = {largest:.3g} exceeds {limit:.1e} "
                f"(sigma_noise={float(self.sigma_noise):.3g}, temperature="
                f"{float(self.temperature):.3g}, GGN lambda_1 = {top:.3g}). Use a larger "
                "sigma_noise or temperature, or a float64 model."
            )

    def _unit_projected_residual(self, U: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(U^T C_r U, U^T U, m, log det U^T U)`` of the residual complement curvature
        at unit scale
        (:func:`~laplace_glas.posterior.kron_complement.projected_residual`), cached for
        the fitted eigenvectors, ``k`` and the complement's stored curvature: the
        curvature scales with ``s / (N sigma^2 T)``, so that an evidence step of a
        hyperparameter loop reuses it for every prior, noise and temperature.
        """
        stored = (getattr(self, "_ggn_kron", None), getattr(self, "_ggn_diagonal", None))
        key = (self.H[0], U.shape[1], self.complement, *stored)
        cached = getattr(self, "_projection_cache", None)
        if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        unit = self._complement_curvature(torch.ones((), dtype=U.dtype, device=U.device))
        projected = projected_residual(unit, U, self.H[1][: U.shape[1]])
        self._projection_cache = (key, projected)
        return projected

    def _complement_curvature(
        self, scale: torch.Tensor | None = None
    ) -> torch.Tensor | KronCurvature:
        """``c = s diag(G) / T`` ``(D,)`` ('diag'), or KFAC's ``C = s K / T`` ('kron'; with
        diagonal blocks for 'kron_diag'), scaled as the subspace curvature ``a`` (or by
        ``scale`` instead of ``s / (N sigma^2 T)``).
        """
        scale = self._H_factor if scale is None else scale
        if self.complement in ("kron", "kron_diag"):
            return KronCurvature(self._kron_blocks(), scale)
        diagonal = getattr(self, "_ggn_diagonal", None)
        stored = self._stored_complement_curvature()
        if diagonal is None or stored != "diag":
            raise ValueError(
                "complement='diag' needs the GGN diagonal of every weight, computed by fit: "
                f"this posterior was fitted with {stored or 'no complement curvature'!r}"
                + (" (its diagonal covers only the parameters KFAC leaves out)"
                   if stored == "kron_diag" else "")
                + ". Refit with complement='diag'."
            )  # fmt: skip
        return scale * diagonal

    def _kron_blocks(self) -> list:
        """The eigen-decomposed Kronecker factors of the fit (cached per factor set); for
        'kron_diag' the GGN diagonal fills the empty blocks.
        """
        kron, complement = getattr(self, "_ggn_kron", None), self.complement
        if kron is None or self._stored_complement_curvature() != complement:
            raise ValueError(
                f"complement={complement!r} needs its curvature, computed by fit: this "
                f"posterior was fitted with another complement. Refit with "
                f"complement={complement!r}."
            )
        diagonal = getattr(self, "_ggn_diagonal", None)
        cache = getattr(self, "_kron_cache", None)
        if cache is None or cache[0] is not kron or cache[1] is not diagonal:
            sizes = [q.numel() for q, block in zip(self.params, kron.kfacs) if not block]
            pieces = list(diagonal.split(sizes)) if sizes else None
            blocks = KronCurvature.decompose(kron, self._dtype, self._device, pieces)
            cache = (kron, diagonal, blocks)
            self._kron_cache = cache
        return cache[2]

    def _complement_prior(self) -> torch.Tensor:
        """The prior the curvature-aware complements take: the scalar ``tau`` (0-dim), or
        the layerwise / per-weight prior's diagonal ``p`` ``(D,)`` (a clear error on a
        posterior over part of the weights).
        """
        if self._directions_embedded:
            raise ValueError(
                f"complement={self.complement!r} takes a prior over all of the network's "
                f"weights; got {type(self).__name__}. Use complement='prior' here."
            )
        prior = self._prior
        return prior.tau if prior.tau is not None else prior.diagonal()

    def _layer_grams(self) -> torch.Tensor:
        """The ``(n_layers, k, k)`` blocks ``U_l^T U_l``, cached."""
        # keyed on the eigenvector tensor itself (held, so never reused), its in-place
        # version and k
        vectors, k = self.H[0], self._n_components
        cache = getattr(self, "_layer_gram_cache", None)
        if cache is None or cache[0] is not vectors or cache[1:3] != (vectors._version, k):
            blocks = layer_grams(self.eigenvectors.detach(), [q.numel() for q in self.params])
            cache = (vectors, vectors._version, k, blocks)
            self._layer_gram_cache = cache
        return cache[3]

    def _covariance_factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(V, w, d)`` with ``Sigma = V diag(w) V^T + diag(d)`` (``d`` None: no term;
        a 0-dim ``d`` is ``d I``), ``V`` over the network's weights.

        Scalar prior: ``V = U``, ``w = v`` (``complement='zero'``) or ``w = v - 1/tau``,
        ``d = 1/tau`` ('prior'). Otherwise :meth:`DiagonalPriorPosterior.covariance_factors`.
        """
        V, weights, diagonal = self._posterior().covariance_factors()
        return self._embed_directions(V), weights, diagonal

    def _embed_directions(self, V: torch.Tensor) -> torch.Tensor:
        """``(n_params, m)`` directions over the posterior's weights as ``(D, m)`` over
        ``self.params`` (the identity here; a subnetwork posterior embeds them).
        """
        return V

    @property
    def _tau(self) -> torch.Tensor:
        prior_precision = self.prior_precision
        scalar_prior_precision(prior_precision)
        return prior_precision.reshape(())

    def _proper_tau(self, what: str) -> torch.Tensor:
        """``tau``, refused where ``what`` needs a proper prior (``tau > 0``)."""
        return proper_tau(self._tau, what)

    @property
    def posterior_variances(self) -> torch.Tensor:
        """``v_j = 1 / (s lambda_j / T + tau)``: ``(k,)`` variances of ``z``.

        With ``prior_precision = 0`` every kept direction needs curvature ``a_j > 0``
        (else its variance is infinite and this raises ``ValueError``). With a
        layerwise or diagonal prior ``z`` is correlated and this is ``diag(U^T Sigma U)``,
        the variance along each ``u_j``.
        """
        return self._posterior().subspace_variances

    @property
    def _complement_variance(self) -> torch.Tensor:
        if self.complement == "prior":
            return 1.0 / self._proper_tau("complement='prior' (the prior's variance off U)")
        return torch.zeros((), device=self._device, dtype=self._dtype)

    # ------------------------------------------------------------------ posterior
    @property
    def posterior_precision(self) -> SubspaceOperator | LowRankDiagonalOperator:
        """``P = U diag(a + tau) U^T + c (I - U U^T)`` as a matrix-free operator.

        ``c = tau`` for ``complement='prior'``; ``c = inf`` for the restricted GLAS
        posterior (``to_dense()`` then refuses). Call ``.to_dense()`` for the D x D
        matrix. With a layerwise or diagonal prior ``P_0``: ``P_0 + U diag(a) U^T``
        ('prior') or ``U (diag(a) + U^T P_0 U) U^T`` with ``inf`` off ``span(U)``
        ('zero').
        """
        return self._posterior().precision

    @property
    def posterior_covariance(self) -> SubspaceOperator | LowRankDiagonalOperator:
        """``Sigma = U diag(v) U^T + c (I - U U^T)``, ``c = 0`` or ``1/tau``; matrix-free.

        With a layerwise or diagonal prior: ``U (diag(a) + U^T P_0 U)^{-1} U^T`` ('zero')
        or Woodbury's ``(P_0 + U diag(a) U^T)^{-1}`` ('prior'), see
        :mod:`laplace_glas.posterior.diagonal_prior`.
        """
        return self._posterior().covariance

    @property
    def log_det_posterior_precision(self) -> torch.Tensor:
        """``sum_j log(a_j + tau) + (D - k) log tau``.

        The complement enters as the prior's precision for both complements: it is
        the log-determinant that makes ``log_det_ratio`` the subspace Occam term
        ``sum_j log(1 + a_j / tau)``. With a layerwise or diagonal prior:
        ``log det(P_0 + U diag(a) U^T)``.
        """
        return self._posterior().log_det_posterior_precision

    @property
    def log_det_prior_precision(self) -> torch.Tensor:
        """``D log tau`` (needs ``tau > 0``); ``sum_i log p_i`` for a non-scalar prior."""
        return self._prior.log_det()

    @property
    def log_det_ratio(self) -> torch.Tensor:
        """``log det P - log det P_0 = sum_j log(1 + s lambda_j / (T tau))`` (the
        evidence's Occam term; needs ``tau > 0``).

        With a layerwise or diagonal prior ``P_0``, for both complements,
        ``log det(I + diag(sqrt a) U^T P_0^{-1} U diag(sqrt a))`` (``O(k^2 D)``;
        differentiable in the prior precision).
        """
        return self._posterior().log_det_ratio

    def square_norm(self, value: torch.Tensor) -> torch.Tensor:
        """``(theta - theta*)^T P (theta - theta*)``.

        For ``complement='zero'`` only the component in ``span(U)`` counts (the
        posterior is a density on the affine subspace ``theta* + span(U)``).
        """
        self._check_H_init()
        self._check_weight_vectors(value)
        return self._posterior().square_norm(value - self.mean)

    def log_prob(self, value: torch.Tensor, normalized: bool = True) -> torch.Tensor:
        """Log density of ``value`` ``(D,)`` or ``(n, D)`` under the posterior.

        For ``complement='prior'`` this is the Gaussian density in R^D. For
        ``complement='zero'`` it is the ``k``-dimensional Gaussian density of the
        projection onto the subspace (the posterior has no density in R^D).
        """
        square_norm = self.square_norm(value)
        if not normalized:
            return -square_norm / 2
        dim, log_det = self._posterior().log_normaliser()
        return -dim / 2 * math.log(2 * math.pi) + log_det / 2 - square_norm / 2

    def sample(
        self, n_samples: int = 100, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Draw ``(n_samples, D)`` weight vectors ``theta* + U z (+ complement)``."""
        self._check_H_init()
        n_samples = positive_int("n_samples", n_samples, allow_none=False)
        self._check_generator(generator)
        return self.mean.reshape(1, -1) + self._posterior().sample(n_samples, generator)

    def _check_weight_vectors(self, value: Any) -> None:
        """``value`` must be ``(D,)`` or ``(n, D)`` floating weight vectors."""
        if (
            not isinstance(value, torch.Tensor)
            or not value.is_floating_point()
            or value.ndim not in (1, 2)
            or value.shape[-1] != self.n_params
        ):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"Expected weight vectors of shape (D,) or (n, D) with D={self.n_params} "
                f"(floating point), got {shape}."
            )
        if not torch.isfinite(value).all():
            raise ValueError("The weight vectors contain NaN or inf.")

    # ------------------------------------------------------------------ evidence
    @unchanged_on_failure
    def optimize_prior_precision(
        self,
        pred_type: PredType | str = PredType.GLM,
        method: TuningMethod | str = TuningMethod.MARGLIK,
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | torch.Tensor = 1.0,
        prior_structure: PriorStructure | str = PriorStructure.SCALAR,
        val_loader: DataLoader | None = None,
        loss: torchmetrics.Metric | Callable[[torch.Tensor], torch.Tensor | float] | None = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
    ) -> None:
        """Tune the prior precision (laplace-torch's signature and semantics).

        Scalar (``prior_structure='scalar'`` and a scalar ``init_prior_prec``):
        ``method='marglik'`` solves the 1-D stationarity condition of the evidence
        in closed form (``tau m = sum_j a_j / (a_j + tau)``, see
        :func:`laplace_glas.posterior.closed_forms.optimal_prior_precision`): ``n_steps``, ``lr``
        and ``init_prior_prec`` of laplace-torch's gradient ascent are not needed
        and are ignored.

        ``'layerwise'`` (one precision per parameter tensor, in the order of
        ``model.parameters()``) or ``'diag'`` (one per weight), or an
        ``init_prior_prec`` of that length: ``method='marglik'`` is laplace-torch's
        Adam ascent on ``log p`` (``n_steps``, ``lr``) of the evidence, whose Occam
        term ``log det(I + diag(sqrt a) U^T P_0^{-1} U diag(sqrt a))`` costs
        ``O(k^2 D)`` per step (``'diag'``), or ``O(L k^2)`` after the first for ``L``
        layers (``'layerwise'``: cached ``U_l^T U_l``); the scatter adds ``O(D)``.

        ``method='gridsearch'`` is laplace-torch's validation-loss search over one
        value for all weights; with ``prior_structure='layerwise'`` or ``'diag'`` the
        chosen value is stored in that structure (as ``fix_prior_prec_structure``
        lays it out).
        """
        self._check_H_init()
        prior_structure = choice(
            "prior_structure",
            str(getattr(prior_structure, "value", prior_structure)),
            _PRIOR_STRUCTURES,
        )
        structured = prior_structure != PriorStructure.SCALAR or (
            isinstance(init_prior_prec, torch.Tensor) and init_prior_prec.numel() != 1
        )
        method = choice("method", str(getattr(method, "value", method)), _TUNING_METHODS)
        if method == TuningMethod.GRIDSEARCH:
            choice("pred_type", str(getattr(pred_type, "value", pred_type)), _GRID_PRED_TYPES)
            choice("link_approx", str(getattr(link_approx, "value", link_approx)), _LINKS)
            if val_loader is not None:
                reiterable("val_loader", val_loader)
                # data checks of a data-parallel posterior run in its grid search, where
                # a rank that fails them still meets the others' all-reduce
                if not torch.distributed.is_initialized() and next(iter(val_loader), None) is None:
                    raise ValueError("val_loader is empty: there is nothing to score the grid on.")
            grid_size = positive_int("grid_size", grid_size, allow_none=False)
            base = finite_number("log_prior_prec_base", log_prior_prec_base, 0.0)
            if base in (0.0, 1.0):
                raise ValueError(f"log_prior_prec_base must be > 0 and != 1, got {base}.")
            grid_bounds_and_loss(log_prior_prec_min, log_prior_prec_max, loss)
        if method == TuningMethod.MARGLIK and structured:
            n_steps = positive_int("n_steps", n_steps, allow_none=False)
            lr = finite_number("lr", lr, 0.0)
            self.prior_precision = init_prior_prec  # validated before the ascent starts
        elif method == TuningMethod.MARGLIK:
            if val_loader is not None:
                warnings.warn("`val_loader` is ignored when method='marglik'.", stacklevel=2)
            delta = self.mean - self.prior_mean
            square_norm = float(delta.detach().square().sum())
            with torch.no_grad():
                if self.complement in CURVATURE_COMPLEMENTS:  # the evidence over every direction
                    tau = optimal_complement_prior_precision(
                        self.eigenvectors,
                        self.subspace_curvature,
                        self._complement_curvature(),
                        square_norm,
                    )
                else:
                    tau = optimal_prior_precision(self.subspace_curvature.detach(), square_norm)
            self.prior_precision = tau
            if verbose:
                print(f"Optimized prior precision is {self.prior_precision}.")
            return
        super().optimize_prior_precision(
            pred_type,
            method,
            n_steps,
            lr,
            init_prior_prec,
            prior_structure,
            val_loader,
            loss,
            log_prior_prec_min,
            log_prior_prec_max,
            grid_size,
            link_approx,
            n_samples,
            verbose,
            progress_bar,
            log_prior_prec_base,
        )
        if method == TuningMethod.GRIDSEARCH and prior_structure != PriorStructure.SCALAR:
            self.prior_precision = fix_prior_prec_structure(
                float(self.prior_precision.reshape(-1)[0]),
                prior_structure,
                self.n_layers,
                self.n_params,
                self._device,
                self._dtype,
            )
