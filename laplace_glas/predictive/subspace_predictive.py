"""laplace-torch's predictive methods for a posterior on a weight subspace.

:class:`SubspacePredictive` holds the predictive half of the laplace-torch contract of
:class:`~laplace_glas.laplace.ActiveSubspaceLaplace`: ``__call__`` with the same
arguments and return shapes as laplace-torch's ``ParametricLaplace.__call__``,
``functional_samples``, ``predictive_samples``, ``functional_variance`` /
``functional_covariance`` and the 'glm' / 'nn' hooks. For a posterior
``theta = theta* + U z``, ``z ~ N(0, diag(v))`` (plus variance ``c`` off ``span(U)``):

.. math::

    \\mathrm{Cov}[f(x)] \\approx (J U) \\,\\mathrm{diag}(v - c)\\, (J U)^\\top + c\\, J J^\\top,

with ``J U`` from ``k`` forward-mode JVPs ('glm'; ``J J^T`` only when ``c > 0``), or
network outputs at weight samples ('nn').

The mixin reads the posterior through ``mean``, ``eigenvectors``, ``_prior`` (the
:class:`~laplace_glas.posterior.prior.Prior`), ``_posterior`` and
``_covariance_factors`` (``Sigma = V diag(w) V^T + diag(d)``, which covers layerwise
and diagonal priors) and ``sample`` of the class it is mixed into; the model runs in
eval mode inside (see :func:`laplace_glas.autodiff.context.autodiff_friendly`).
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from typing import Any

import torch
from laplace.utils.enums import LinkApprox, PredType

from laplace_glas.autodiff.context import autodiff_friendly
from laplace_glas.curvature.data.batches import batch_input
from laplace_glas.curvature.operators.factored import factored_jacobian_directions
from laplace_glas.predictive.jvp import batched_outputs, jvp_directions
from laplace_glas.predictive.links import gaussian_samples, laplace_bridge, probit
from laplace_glas.predictive.prior_gram import PriorGram
from laplace_glas.validation import ArgumentTypeError, positive_int

__all__ = ["FittedWeightsChangedWarning", "SubspacePredictive"]


class FittedWeightsChangedWarning(UserWarning):
    """The model's weights changed after ``fit``: predictions use the fitted ones."""


def _check_pred_type(pred_type: PredType | str) -> None:
    if pred_type not in [p.value for p in PredType] or pred_type == PredType.GP:
        raise ValueError("Only glm and nn supported as prediction types.")


def _weighted(Js: torch.Tensor, base: Any) -> torch.Tensor:
    """``Js diag(d)`` for a diagonal ``d``, or the base operator ``B`` (KFAC's
    ``E^{-1}``, symmetric) applied to the last axis of ``Js``.
    """
    return base(Js) if callable(base) else Js * base


class SubspacePredictive(PriorGram):
    """Predictive methods of a subspace Laplace posterior (a mixin; see the module).

    Attributes
    ----------
    jacobian_path : str or None
        How the last 'glm' predictive computed ``J(x) U``: ``'factored'`` (one forward
        and one batched backward pass, then GEMMs) or ``'jvp (reason)'`` (``k``
        forward-mode JVPs); None before the first call.

    """

    jacobian_path: str | None = None

    def _to_device(self, X: Any) -> Any:
        return X.to(self._device) if isinstance(X, torch.Tensor) else X

    def _check_fitted_weights(self) -> bool:
        """Warn when the model's weights are no longer the fitted MAP ``la.mean``.

        Predictions linearise at, and sample around, ``la.mean``: after the weights
        change (further training, ``load_state_dict`` of other weights) they describe
        the fitted network, not the current one. The check compares the weights with
        ``la.mean`` (one pass over ``D`` numbers, no copy).
        """
        offset = 0
        theta = self._network_weights()
        for param in self.params:
            n = param.numel()
            fitted = theta[offset : offset + n]
            offset += n
            if fitted.device != param.device or not torch.equal(
                param.detach().reshape(-1), fitted.detach()
            ):
                warnings.warn(
                    "The model's weights differ from those GLAS was fitted at (la.mean): "
                    "predictions use the fitted weights and their curvature, not the "
                    "current ones. Call fit() again after changing the model.",
                    FittedWeightsChangedWarning,
                    stacklevel=3,
                )
                return False
        return True

    def _network_weights(self) -> torch.Tensor:
        """``theta*`` over ``self.params`` (all of the network's weights under
        inference; a subnetwork posterior overrides it to embed its ``mean``).
        """
        return self.mean

    def _network_directions(self) -> torch.Tensor:
        """``U`` over ``self.params``: ``(D, k)`` (a subnetwork posterior embeds its
        ``(D_s, k)`` eigenvectors).
        """
        return self.eigenvectors

    def _network_directions_up_to(self, k: int) -> torch.Tensor:
        """The leading ``k`` computed eigenvectors over ``self.params``: ``(D, k)``, also
        beyond ``n_components`` (the calibration sweeps; a subnetwork posterior embeds
        its ``(D_s, k)`` ones).
        """
        return self.H[0][:, :k]

    def _embed_weight_draws(self, draws: torch.Tensor) -> torch.Tensor:
        """``(S, n_params)`` draws over the posterior's weights as ``(S, D)`` over
        ``self.params`` (the identity here; a subnetwork posterior puts zeros on the
        weights outside it).
        """
        return draws

    def _check_inputs(self, X: Any) -> None:
        inputs = batch_input(X, self.dict_key_x)
        if isinstance(inputs, torch.Tensor):
            if inputs.ndim == 0:
                raise ValueError("The input must have a batch axis: shape (batch, ...), got ().")
            if inputs.is_floating_point() and inputs.dtype != self._dtype:
                name = str(self._dtype).replace("torch.", "")
                raise ArgumentTypeError(
                    f"The input is {str(inputs.dtype).replace('torch.', '')} but the model's "
                    f"parameters are {name}: pass x.to({self._dtype})."
                )
            if inputs.shape[0] == 0:
                raise ValueError("The input batch is empty.")
            if inputs.is_floating_point() and not torch.isfinite(inputs).all():
                raise ValueError("The input contains NaN or inf.")

    def _check_generator(self, generator: torch.Generator | None) -> None:
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != self._device.type
        ):
            raise ValueError("Invalid random generator (check type and device).")

    def __call__(
        self,
        x: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        pred_type: PredType | str = PredType.GLM,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: dict[str, Any],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Posterior predictive at ``x``; same arguments and return shapes as
        laplace-torch's ``ParametricLaplace.__call__``.

        'glm': ``f(x; theta*)`` and ``(J U) diag(v) (J U)^T`` from ``k`` forward-mode
        JVPs; with ``complement='zero'`` no Jacobian is formed, with ``'prior'`` and the
        curvature-aware complements (the default ``'auto'`` among them) each input's
        Jacobian over all weights is formed, chunked by inputs, for ``J J^T / tau`` or
        ``J P E^{-1} P J^T``. 'nn': weight samples pushed through the network with
        ``functional_call`` under ``vmap``. ``generator`` controls every sampling
        path (laplace-torch ignores it for 'nn' and 'mc'). ``link_approx='probit'`` is
        the probit on differences of logits
        (:func:`~laplace_glas.predictive.links.probit`), not laplace-torch's
        ``softmax(kappa * mu)``: the two differ on the same covariance, so compare
        posteriors under one link with ``'mc'``.
        """
        self._check_H_init()
        _check_pred_type(pred_type)
        if link_approx not in [la.value for la in LinkApprox]:
            raise ValueError(f"Unsupported link approximation {link_approx}.")
        if pred_type == PredType.NN and link_approx != LinkApprox.MC:
            raise ValueError("Only mc link approximation is supported for nn prediction type.")
        likelihood = self._predictive_likelihood(fitting)
        self._check_bridge(pred_type, link_approx, likelihood)
        self._check_generator(generator)
        n_samples = positive_int("n_samples", n_samples, allow_none=False)
        self._check_inputs(x)
        x = self._to_device(x)

        if pred_type == PredType.NN:
            if joint and likelihood == "regression":
                raise ValueError("joint=True is only available for pred_type='glm'.")
            if likelihood == "regression":
                fs = self._nn_functional_samples(x, n_samples, generator, **model_kwargs)
                if n_samples < 2:
                    raise ValueError(
                        "n_samples must be >= 2 for the sample variance of a regression "
                        f"'nn' predictive, got {n_samples}."
                    )
                return fs.mean(dim=0), fs.var(dim=0)
            fs = self._nn_functional_samples(x, n_samples, generator, **model_kwargs)
            return torch.softmax(fs, dim=-1).mean(dim=0)

        if joint and likelihood == "regression":
            # as in laplace-torch, joint only applies to regression (ignored otherwise)
            return self._glm_moments(x, joint=True)[:2]
        f_mu, f_var, lead = self._glm_moments(x)
        C = f_mu.shape[-1]
        if likelihood == "regression":
            if diagonal_output:
                return f_mu.reshape(*lead, C), f_var.diagonal(dim1=-2, dim2=-1).reshape(*lead, C)
            return f_mu.reshape(*lead, C), f_var.reshape(*lead, C, C)
        if link_approx == LinkApprox.MC:
            probs = self._glm_predictive_samples(
                f_mu, f_var, n_samples, diagonal_output, generator
            ).mean(dim=0)
        elif link_approx == LinkApprox.PROBIT:
            probs = probit(f_mu, f_var)
        else:
            probs = laplace_bridge(f_mu, f_var, normalize=link_approx == LinkApprox.BRIDGE_NORM)
        return probs.reshape(*lead, C)

    def _predictive_likelihood(self, fitting: bool = False) -> str:
        """The predictive's likelihood: laplace-torch's ``'reward_modeling'`` predicts
        individual rewards as a regression, and preference pairs as a classification
        when ``fitting=True``.
        """
        if self.likelihood == "reward_modeling":
            return "classification" if fitting else "regression"
        return self.likelihood

    def _check_bridge(
        self,
        pred_type: PredType | str,
        link_approx: LinkApprox | str,
        likelihood: str = "classification",
    ) -> None:
        """The Laplace bridge needs a logit covariance of full rank ``C``.

        It conditions ``N(f_mu, f_var)`` on ``sum(f) = 0`` and reads the per-class
        variances off the result. The restricted posterior's ``(J U) diag(v) (J U)^T``
        has rank at most ``k``; for ``k < C`` the conditioned variances are round-off
        (rank ``k - 1``), and the bridge returns arbitrary or invalid probabilities.
        """
        if (
            pred_type == PredType.GLM
            and link_approx in (LinkApprox.BRIDGE, LinkApprox.BRIDGE_NORM)
            and likelihood == "classification"
            and self.complement == "zero"
            and self._n_components < self.n_outputs
        ):
            raise ValueError(
                f"link_approx={str(getattr(link_approx, 'value', link_approx))!r} needs a "
                f"logit covariance of full rank C = {self.n_outputs}, but the restricted "
                f"GLAS posterior's has rank at most k = {self._n_components}. Use "
                "link_approx='probit' or 'mc', n_components >= C, or complement='prior'."
            )

    def _glm_moments(
        self, X: torch.Tensor | MutableMapping[str, torch.Tensor | Any], joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
        """Linearised predictive ``f(x; theta*)``, ``J Sigma J^T`` and the leading shape.

        Outputs ``(batch, ..., C)`` are flattened to ``(n, C)`` with
        ``n = batch * ...`` (one Gaussian per token for sequence models) and the
        covariance is ``(n, C, C)``; with ``joint`` they are ``(n C,)`` and
        ``(n C, n C)``.
        """
        self._check_H_init()
        self._check_inputs(X)
        at_fitted_weights = self._check_fitted_weights()
        X = self._to_device(X)
        # Sigma = U diag(weights) U^T + c P_0^{-1}, c = 0 (None) or 1; U over the
        # network's weights (a subnetwork posterior embeds its directions)
        U, weights, c = self._covariance_factors()
        theta = self._network_weights()
        theta = theta if self.enable_backprop else theta.detach()
        with torch.set_grad_enabled(self.enable_backprop), autodiff_friendly(self.model):
            f_mu, JU = self._jacobian_directions(X, U, theta, at_fitted_weights)
            if f_mu.ndim < 2:
                raise ValueError(
                    "The 'glm' predictive needs model outputs of shape (batch, ..., outputs); "
                    f"got {tuple(f_mu.shape)}."
                )
            lead = f_mu.shape[:-1]
            f_mu = f_mu.reshape(-1, f_mu.shape[-1])
            JU = JU.reshape(*f_mu.shape, JU.shape[-1])
            if joint:
                JU_flat = JU.reshape(-1, JU.shape[-1])
                f_var = (JU_flat * weights) @ JU_flat.T
                if c is not None:
                    f_var = f_var + self._diagonal_gram(X, theta, c, joint=True)
                f_mu = f_mu.flatten()
            else:
                f_var = torch.einsum("nck,k,nlk->ncl", JU, weights, JU)
                if c is not None:
                    f_var = f_var + self._diagonal_gram(X, theta, c)
        if not self.enable_backprop:
            f_mu, f_var = f_mu.detach(), f_var.detach()
        return f_mu, f_var, lead

    def _jacobian_directions(
        self, X: Any, U: torch.Tensor, theta: torch.Tensor, at_fitted_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``f(x)`` and ``J(x) U``: from the factored Jacobian of the batch where the
        model qualifies
        (:func:`~laplace_glas.curvature.operators.factored.factored_jacobian_directions`:
        the model at its fitted weights, no backpropagation through the predictive),
        otherwise by ``k`` forward-mode JVPs. Which path ran is kept in
        ``self.jacobian_path`` (``'factored'`` or ``'jvp (why)'``).
        """
        reason = "enable_backprop" if self.enable_backprop else None
        if reason is None and not at_fitted_weights:
            reason = "the model's weights differ from la.mean"
        if reason is None:
            with torch.no_grad():
                result = factored_jacobian_directions(
                    self.model, self.params, X, U, dict_key_x=self.dict_key_x
                )
            if not isinstance(result, str):
                self.jacobian_path = "factored"
                return result
            reason = result
        self.jacobian_path = f"jvp ({reason})"
        return jvp_directions(
            self.model,
            self._param_names,
            self._param_shapes,
            theta,
            X,
            U,
            chunk_size=self.jvp_chunk_size,
        )

    def _glm_predictive_distribution(
        self,
        X: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        joint: bool = False,
        diagonal_output: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean ``f(x; theta*)`` ``(n, C)`` and covariance ``J Sigma J^T`` ``(n, C, C)``
        of the linearised model (laplace-torch's hook; sequence outputs come
        flattened to one row per token).
        """
        f_mu, f_var, _ = self._glm_moments(X, joint=joint)
        if diagonal_output and not joint:
            f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        return f_mu, f_var

    def functional_samples(
        self,
        x: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``functional_samples``: ``(n_samples, batch, ..., C)`` draws of
        ``f(x)``; sequence outputs keep their ``(batch, seq_len)`` axes for 'glm' as
        for 'nn' (laplace-torch's hook hands the 'glm' sampler one row per token).
        """
        return self._samples(x, pred_type, n_samples, diagonal_output, generator, link=False)

    def predictive_samples(
        self,
        x: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``predictive_samples`` (the inverse link applied to
        :meth:`functional_samples`), with the same output axes.
        """
        return self._samples(x, pred_type, n_samples, diagonal_output, generator, link=True)

    def _samples(
        self,
        x: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        pred_type: PredType | str,
        n_samples: int,
        diagonal_output: bool,
        generator: torch.Generator | None,
        link: bool,
    ) -> torch.Tensor:
        _check_pred_type(pred_type)
        self._check_generator(generator)
        n_samples = positive_int("n_samples", n_samples, allow_none=False)
        if pred_type == PredType.NN:
            if link:
                return self._nn_predictive_samples(x, n_samples, generator)
            return self._nn_functional_samples(x, n_samples, generator)
        f_mu, f_var, lead = self._glm_moments(x)
        sampler = self._glm_predictive_samples if link else self._glm_functional_samples
        samples = sampler(f_mu, f_var, n_samples, diagonal_output, generator)
        return samples.reshape(n_samples, *lead, samples.shape[-1])

    def _glm_functional_samples(
        self,
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Draws ``(n_samples, n, C)`` from ``N(f_mu, f_var)`` per row.

        The GLAS output covariance ``(J U) diag(v) (J U)^T`` has rank at most k, so
        laplace-torch's Cholesky sampler fails whenever ``C > k``; the square root is
        taken from an eigen-decomposition instead (negative round-off clamped to 0).
        """
        if diagonal_output and f_var.shape != f_mu.shape:
            f_var = f_var.diagonal(dim1=-2, dim2=-1)
        return gaussian_samples(f_mu, f_var, n_samples, generator)

    def functional_variance(self, Js: torch.Tensor) -> torch.Tensor:
        """``J Sigma J^T`` per input: ``(batch, C, C)`` from Jacobians ``(batch, C, D)``."""
        self._check_jacobians(Js)
        V, weights, diagonal = self._posterior().covariance_factors()
        JV = Js @ V
        f_var = torch.einsum("nck,k,nlk->ncl", JV, weights, JV)
        if diagonal is None:
            return f_var
        if hasattr(diagonal, "root"):  # B = R R^T: (J R)(J R)^T, PSD in floating point
            JR = diagonal.root(Js)
            return f_var + JR @ JR.transpose(-1, -2)
        return f_var + torch.einsum("ncp,nkp->nck", _weighted(Js, diagonal), Js)

    def functional_covariance(self, Js: torch.Tensor) -> torch.Tensor:
        """Joint ``J Sigma J^T``: ``(batch*C, batch*C)`` from Jacobians ``(batch, C, D)``."""
        self._check_jacobians(Js)
        n_batch, n_outs, n_params = Js.shape
        Js = Js.reshape(n_batch * n_outs, n_params)
        V, weights, diagonal = self._posterior().covariance_factors()
        JV = Js @ V
        f_cov = (JV * weights) @ JV.T
        if diagonal is None:
            return f_cov
        if hasattr(diagonal, "root"):
            JR = diagonal.root(Js)
            return f_cov + JR @ JR.T
        return f_cov + _weighted(Js, diagonal) @ Js.T

    def _nn_functional_samples(
        self,
        X: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """``(n_samples, batch, C)`` network outputs at posterior weight samples."""
        self._check_H_init()
        n_samples = positive_int("n_samples", n_samples, allow_none=False)
        self._check_inputs(X)
        self._check_fitted_weights()
        X = self._to_device(X)
        outputs = []
        with torch.set_grad_enabled(self.enable_backprop), autodiff_friendly(self.model):
            for start in range(0, n_samples, self.sample_chunk_size):
                n_chunk = min(self.sample_chunk_size, n_samples - start)
                thetas = self.sample(n_chunk, generator)
                outputs.append(
                    batched_outputs(
                        self.model,
                        self._param_names,
                        self._param_shapes,
                        thetas,
                        X,
                        chunk_size=None,
                        model_kwargs=model_kwargs,
                    )
                )
        fs = torch.cat(outputs)
        return fs if self.enable_backprop else fs.detach()

    def _nn_predictive_samples(
        self,
        X: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        **model_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        fs = self._nn_functional_samples(X, n_samples, generator, **model_kwargs)
        if self._predictive_likelihood() == "classification":
            fs = torch.softmax(fs, dim=-1)
        return fs

    def _nn_predictive_classification(
        self,
        X: torch.Tensor | MutableMapping[str, torch.Tensor | Any],
        n_samples: int = 100,
        **model_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        return self._nn_predictive_samples(X, n_samples, None, **model_kwargs).mean(dim=0)
