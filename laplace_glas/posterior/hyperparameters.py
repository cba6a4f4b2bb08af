"""The hyperparameters of a subspace Laplace posterior (a mixin): ``k``, the loss
scaling, the prior precision and mean, the observation noise and the temperature.

Conventions (laplace-torch's): ``H`` is the *summed*, unit-noise curvature; the
observation noise and the temperature enter through ``_H_factor`` when ``H`` is read.
With loss scaling ``s`` (``'mean'``: ``s = 1``; ``'sum'``: ``s = N``) the posterior sees
the curvature

.. math::

    a_j = \\frac{s}{N \\sigma^2 T} h_j = \\frac{s \\lambda_j}{T}, \\qquad
    \\lambda_j = \\frac{h_j}{N \\sigma^2},

so ``loss_scaling='mean'`` is exactly laplace-torch at ``temperature = N`` and
``loss_scaling='sum'`` is the standard Bayesian posterior. Every setter checks its
value before it is stored, so a refused value leaves the posterior as it was.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from laplace.baselaplace import ParametricLaplace

from laplace_glas.curvature.complement.kfac_layers import kron_diag_refusal, kron_refusal
from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian
from laplace_glas.validation import (
    ArgumentTypeError,
    choice,
    homoscedastic_noise,
    positive_scalar,
    prior_precision_values,
    scalar_value,
)

__all__ = [
    "COMPLEMENTS",
    "COMPLEMENT_SETTINGS",
    "CURVATURE_COMPLEMENTS",
    "DEFAULT_N_COMPONENTS",
    "LOSS_SCALINGS",
    "PosteriorHyperparameters",
    "unchanged_on_failure",
]

LOSS_SCALINGS = ("mean", "sum")
"""The ``loss_scaling`` values: generalized (``s = 1``) and standard (``s = N``)."""
COMPLEMENTS = ("zero", "prior", "diag", "kron", "kron_diag")
"""The ``complement`` values: none, the prior's, the GGN diagonal's, KFAC's curvature, or
KFAC's where it covers a layer and the GGN diagonal's elsewhere."""
CURVATURE_COMPLEMENTS = ("diag", "kron", "kron_diag")
"""The complements that carry the GGN's curvature outside ``span(U)`` (a data pass in
``fit``, a scalar prior)."""
COMPLEMENT_SETTINGS = ("auto", *COMPLEMENTS)
"""The ``complement`` arguments: ``'auto'`` (resolved by ``fit``) or one of :data:`COMPLEMENTS`."""
DEFAULT_N_COMPONENTS = 20
"""``n_components`` when none is given (capped at ``D - 1``)."""


Method = TypeVar("Method", bound=Callable[..., Any])


def unchanged_on_failure(method: Method) -> Method:
    """Run ``method`` so that, when it raises, the object's attributes are those it had
    before the call (a refused ``optimize_prior_precision``, ``calibrate`` or
    ``load_state_dict`` leaves the posterior as it was).

    The attributes are restored shallowly: the methods it wraps replace tensors and do
    not change them in place.
    """

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = dict(self.__dict__)
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    return guarded  # type: ignore[return-value]


class PosteriorHyperparameters:
    """Hyperparameter properties of a subspace Laplace posterior (a mixin; see the
    module).
    """

    _k_bound_known_at_init = True  # D is known at construction (False: checked later)

    _k_from_default = False  # n_components was not given: min(20, D - 1)
    #: Whether ``complement='diag'`` / ``'kron'`` are served (the GGN's diagonal or KFAC
    #: over the posterior's weights); the last-layer and subnetwork posteriors refuse them.
    _diag_complement_available = True

    #: ``complement`` as given (``'auto'`` or a value of :data:`COMPLEMENTS`), what
    #: ``fit`` resolved ``'auto'`` to (None: not resolved) and why.
    _complement_setting = "zero"
    _complement_fitted: str | None = None
    _complement_why: str | None = None

    _output_hessian: PosteriorAveragedHessian | None = None

    @property
    def output_hessian(self) -> PosteriorAveragedHessian | None:
        """The loss Hessian in the outputs that the next ``fit`` weights each training
        example's GGN term by: ``None`` (the default) for the Hessian at the MAP's
        outputs, or a
        :class:`~laplace_glas.curvature.data.output_hessian.PosteriorAveragedHessian`
        (classification only; set by
        :func:`~laplace_glas.posterior.fixed_point.fit_posterior_curvature`).
        """
        return self._output_hessian

    @output_hessian.setter
    def output_hessian(self, value: PosteriorAveragedHessian | None) -> None:
        if value is not None and not isinstance(value, PosteriorAveragedHessian):
            raise ArgumentTypeError(
                f"output_hessian must be None or a PosteriorAveragedHessian, got {value!r}."
            )
        if value is not None and getattr(self, "likelihood", None) == "regression":
            raise ValueError(
                "output_hessian averages the softmax cross-entropy's Hessian; regression's "
                "(unit noise) is the identity at every output."
            )
        self._output_hessian = value

    def _static_complement_refusal(
        self, complement: str, curvature_kind: str = "ggn", loss_fn: Any = None
    ) -> str | None:
        """Why ``complement`` cannot serve this class, curvature and loss (None: it can):
        ``'diag'`` and ``'kron'`` take the likelihood's GGN over all of the weights.
        """
        if complement not in CURVATURE_COMPLEMENTS:
            return None
        if not self._diag_complement_available:
            return (
                f"complement={complement!r} is not available for {type(self).__name__} (its "
                "GGN curvature would be over other weights than the posterior's); use "
                "complement='zero' or 'prior'."
            )
        if curvature_kind != "ggn" or loss_fn is not None:
            what = "a custom loss_fn" if loss_fn is not None else f"the {curvature_kind} backend"
            return (
                f"complement={complement!r} takes the likelihood's GGN curvature and cannot "
                f"follow {what}; use complement='zero' or 'prior' with it."
            )
        return None

    def _stored_complement_curvature(self) -> str | None:
        """Which complement's curvature the stored fit holds (``'diag'``, ``'kron'``,
        ``'kron_diag'``; None: none).
        """
        kron, diagonal = getattr(self, "_ggn_kron", None), getattr(self, "_ggn_diagonal", None)
        if kron is not None:  # 'kron_diag' keeps a diagonal, empty where KFAC covers all
            return "kron_diag" if diagonal is not None else "kron"
        return "diag" if diagonal is not None else None

    def _complement_refusal(self, complement: str, update: bool) -> str | None:
        """Why ``fit`` cannot compute ``complement``'s curvature here (None: it can): the
        class, curvature and loss (:meth:`_static_complement_refusal`), the model
        (:func:`~laplace_glas.curvature.complement.kfac_layers.kron_refusal` for ``'kron'``,
        :func:`~laplace_glas.curvature.complement.kfac_layers.kron_diag_refusal` for
        ``'kron_diag'``), and
        for an update (``fit(override=False)``) a stored fit without that complement's
        curvature to add to.
        """
        refusal = self._static_complement_refusal(complement, self.curvature.kind, self.loss_fn)
        if refusal is not None or complement not in CURVATURE_COMPLEMENTS:
            return refusal
        if complement in ("kron", "kron_diag"):
            refusal = (kron_refusal if complement == "kron" else kron_diag_refusal)(self.model)
            if refusal is not None:
                return refusal
        stored = self._stored_complement_curvature()
        if not update or stored == complement:
            return None
        return (
            f"fit(override=False) with complement={complement!r} adds to the stored fit's "
            f"curvature, which is {stored or 'none'!r} (fitted with another complement): "
            "refit with override=True."
        )

    def _checked_complement(
        self, complement: Any, curvature_kind: str = "ggn", loss_fn: Any = None
    ) -> str:
        """``complement`` checked against :data:`COMPLEMENT_SETTINGS` and, unless it is
        ``'auto'``, against this class, the curvature and the loss
        (:meth:`_static_complement_refusal`).
        """
        complement = choice(
            "complement",
            complement,
            COMPLEMENT_SETTINGS,
            " (resolved by fit / no variance / the prior's / the GGN diagonal's / KFAC's / "
            "KFAC's where it covers a layer and the GGN diagonal's elsewhere, curvature "
            "outside span(U))",
        )
        refusal = self._static_complement_refusal(complement, curvature_kind, loss_fn)
        if refusal is not None:
            raise ValueError(refusal)
        return complement

    @property
    def complement(self) -> str:
        """The complement in use: as given, or for ``complement='auto'`` what ``fit``
        resolved it to (``'auto'`` before the fit; see :attr:`complement_reason`).

        The curvature-aware complements take a scalar, layerwise or (``'diag'``)
        per-weight prior precision. Assigning a value sets it explicitly.
        """
        if self._complement_setting != "auto":
            return self._complement_setting
        if self._complement_fitted is None:
            return "auto"
        return self._complement_fitted

    @complement.setter
    def complement(self, value: str) -> None:
        # checked as the constructor checks it: a misspelt value (or None, a number) is
        # refused by name instead of predicting as 'zero'
        curvature = getattr(self, "curvature", None)
        kind = getattr(curvature, "kind", "ggn")
        value = self._checked_complement(value, kind, getattr(self, "loss_fn", None))
        self._complement_setting = value
        self._complement_fitted = None
        self._complement_why = None
        if value == "auto" and getattr(self, "_eigenpairs", None) is not None:
            # after a fit: what the stored fit's curvature serves ('zero' without one)
            stored = self._stored_complement_curvature()
            self._complement_fitted = stored or "zero"
            self._complement_why = (
                f"complement='auto' assigned after fit: {stored!r}, the curvature the fit stored."
                if stored
                else "complement='auto' assigned after fit: 'zero', "
                "the fit stored no curvature outside span(U) (refit for one)."
            )

    @property
    def complement_reason(self) -> str | None:
        """Why ``complement='auto'`` resolved as it did (None for an explicit
        complement, or before the fit).
        """
        return self._complement_why

    def _complement_state(self) -> dict[str, str]:
        """The state dict's entries for ``complement='auto'``: what ``fit`` resolved it to
        and why (none for an explicit complement).
        """
        if self._complement_setting != "auto":
            return {}
        return {
            "complement": self._complement_fitted,
            "complement_setting": "auto",
            "complement_reason": self._complement_why or "",
        }

    def _restore_complement(self, state: dict[str, Any]) -> None:
        """The complement of a checked state (a state without ``complement_setting``,
        saved before ``'auto'`` existed, is explicit).
        """
        self.complement = state["complement"]
        if state.get("complement_setting") == "auto":
            self._complement_setting, self._complement_fitted = "auto", state["complement"]
            self._complement_why = state.get("complement_reason") or None

    def _per_weight_prior(self, prior_precision: Any = None) -> bool:
        """Whether ``prior_precision`` (default: the one set) has one value per weight
        (not a scalar, not one per parameter tensor): what the Kronecker blocks of
        'kron' / 'kron_diag' cannot take.
        """
        if prior_precision is None:
            prior_precision = getattr(self, "_prior_precision", None)
        if not isinstance(prior_precision, torch.Tensor):
            return False
        return prior_precision.numel() not in (1, self.n_layers)

    def _capped_default(self, k: int | None, n_params: float) -> int:
        """``k``, or for the default (``None``, or the default after the weights are
        known) ``min(DEFAULT_N_COMPONENTS, D - 1)``.
        """
        if k is None or self._k_from_default:
            return int(min(DEFAULT_N_COMPONENTS, max(n_params - 1, 1)))
        return k

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
                f"D={n_params} (at least one direction stays outside the subspace; "
                f"leave n_components out for the default min(20, D - 1)). "
                f"For a model this small, laplace-torch's FullLaplace "
                f"(hessian_structure='full') is exact and cheap."
            )
        return k

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
        self._k_from_default = False

    @property
    def loss_scaling(self) -> str:
        """``'mean'`` (s = 1) or ``'sum'`` (s = N). Changing it after ``fit`` is exact and
        free: the stored eigenpairs do not depend on the scaling.
        """
        return self._loss_scaling

    @loss_scaling.setter
    def loss_scaling(self, value: str) -> None:
        self._loss_scaling = choice(
            "loss_scaling", value, LOSS_SCALINGS, " (generalized s = 1 / standard s = N)"
        )

    def with_loss_scaling(self, loss_scaling: str) -> PosteriorHyperparameters:
        """A shallow copy with another loss scaling, sharing the eigenpairs (no refit).

        Prior precision and ``n_components`` are copied, so tuning one does not
        change the other.
        """
        other = copy.copy(self)
        other.loss_scaling = loss_scaling
        other.prior_precision = self.prior_precision.clone()  # the checked setter
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
        if (
            self.complement in ("kron", "kron_diag")
            and self._per_weight_prior(prior_precision)
            and getattr(self, "_ggn_kron", None) is not None
            and any(len(block) > 0 for block in self._ggn_kron.kfacs)
        ):
            raise ValueError(
                f"complement={self.complement!r} takes a scalar or layerwise prior precision "
                "(one value per parameter tensor) on its Kronecker blocks; a per-weight "
                "prior needs complement='diag' (refit with it)."
            )
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
