"""GLAS on a subset of the weights: the last layer or a subnetwork.

laplace-torch's ``subset_of_weights`` picks the weights ``theta_S`` the posterior is
over; the others stay at the MAP. GLAS then takes the top-k eigenpairs of the
mean-loss GGN *restricted to those weights*,

.. math::

    G_S = P_S^\\top G P_S = \\frac{1}{N} \\sum_n J_{n,S}^\\top \\Lambda_n J_{n,S},
    \\qquad J_{n,S} = \\partial f_n / \\partial \\theta_S ,

and every GLAS quantity (evidence, 'glm' / 'nn' predictives, samples, calibration)
is the one of :class:`~laplace_glas.ActiveSubspaceLaplace` with
``D`` replaced by ``D_S = |S|``. In the ``k >= rank(G_S)`` limit with ``complement='prior'`` the
posterior is laplace-torch's ``FullLLLaplace`` / ``FullSubnetLaplace``.

* :class:`LastLayerActiveSubspaceLaplace` (``('last_layer', 'glas')``, the factory's
  default subset): laplace-torch's ``LLLaplace`` conventions, i.e. the model is
  wrapped in a ``laplace.utils.FeatureExtractor`` (a deep copy) and the last
  ``nn.Linear`` is found on the first batch unless ``last_layer_name`` names it.
  The weights under inference are that layer's, so the whole GLAS machinery
  (factored GGN, dual solve, forward-mode JVPs) runs unchanged on them: products
  and JVPs go through the network, with tangents only from the last layer on.
* :class:`SubnetActiveSubspaceLaplace` (``('subnetwork', 'glas')``):
  laplace-torch's ``SubnetLaplace`` conventions (``subnetwork_indices`` into
  ``parameters_to_vector(model.parameters())``). ``G_S`` is applied matrix-free as
  ``v_S -> (G P_S v_S)_S`` (one product with the full GGN), solved by Lanczos or the
  block solver; the 'glm' predictive pushes the embedded directions ``P_S U``.
  ``n_params`` and ``mean`` are the subnetwork's (``D_S`` entries); ``sample`` returns
  full weight vectors (the other weights at the MAP), as laplace-torch's does.
  ``calibrate`` sweeps ``(k, tau)`` through the same embedded directions (for
  ``complement='prior'`` with the subnetwork's Jacobian Gram ``J_S J_S^T``).
  laplace-torch's ``Laplace`` factory refuses ``subset_of_weights='subnetwork'``
  with 'glas', so construct :class:`SubnetActiveSubspaceLaplace` directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from laplace.lllaplace import LLLaplace
from laplace.subnetlaplace import SubnetLaplace
from scipy.sparse.linalg import LinearOperator
from torch import nn
from torch.nn.utils import parameters_to_vector

from laplace_glas.autodiff.checkpoints import outside_posterior
from laplace_glas.curvature.data.batches import check_input_dtype, split_batch
from laplace_glas.curvature.data.problem import CurvatureProblem
from laplace_glas.curvature.memory.planner import Plan
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES
from laplace_glas.curvature.parallel.distributed import Shards
from laplace_glas.io import check_state_kind, check_subnetwork_indices
from laplace_glas.laplace import ActiveSubspaceLaplace
from laplace_glas.posterior.hyperparameters import unchanged_on_failure
from laplace_glas.predictive.jvp import jvp_directions, parameter_names
from laplace_glas.validation import reiterable

__all__ = [
    "LastLayerActiveSubspaceLaplace",
    "SubnetActiveSubspaceLaplace",
    "SubsetOperator",
]


# ---------------------------------------------------------------------- arguments
def laplace_torch_arguments(
    laplace_class: type,
    model: nn.Module,
    likelihood: str,
    args: tuple,
    kwargs: dict[str, Any],
    owner: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A subset class's arguments, split into laplace-torch's and GLAS's.

    The positional arguments and the keywords that ``laplace_class.__init__`` names are
    bound to laplace-torch's own signature (its order and its defaults, so a positional
    call reads as it does for laplace-torch's class; a clash raises its ``TypeError``).
    The other keywords (GLAS's, and ``enable_backprop`` / the dict keys where
    laplace-torch's class does not take them) come back as they were passed.

    ``owner`` names the class in a ``TypeError`` from the binding (default:
    ``laplace_class``'s name).

    Returns
    -------
    named : dict
        laplace-torch's arguments by name, ``model`` and ``likelihood`` included.
    others : dict
        The remaining keywords.

    """
    signature = inspect.signature(laplace_class.__init__)
    names = signature.parameters.keys()
    theirs = {name: value for name, value in kwargs.items() if name in names}
    others = {name: value for name, value in kwargs.items() if name not in names}
    try:
        bound = signature.bind(None, model, likelihood, *args, **theirs)  # None: self
    except TypeError as err:  # name the class called, as Python's own errors do
        raise TypeError(f"{owner or laplace_class.__name__}.__init__(): {err}") from None
    bound.apply_defaults()
    named = dict(bound.arguments)
    del named[next(iter(signature.parameters))]
    return named, others


def _with_laplace_torch_signature(
    laplace_class: type, *keyword_only: str
) -> Callable[[Callable], Callable]:
    """Show laplace-torch's ``laplace_class.__init__`` signature, then the arguments
    ``keyword_only`` of :class:`~laplace_glas.ActiveSubspaceLaplace` (by keyword, with
    its defaults) and ``**glas_kwargs``, as the decorated ``__init__``'s (for ``help``
    and ``inspect.signature``).
    """
    glas = inspect.signature(ActiveSubspaceLaplace.__init__).parameters

    def decorate(init: Callable) -> Callable:
        signature = inspect.signature(laplace_class.__init__)
        extra = [glas[name].replace(kind=inspect.Parameter.KEYWORD_ONLY) for name in keyword_only]
        keywords = inspect.Parameter.VAR_KEYWORD
        glas_kwargs = inspect.Parameter("glas_kwargs", keywords, annotation=Any)
        parameters = [*signature.parameters.values(), *extra, glas_kwargs]
        init.__signature__ = signature.replace(parameters=parameters, return_annotation=None)
        return init

    return decorate


# ---------------------------------------------------------------------- last layer
class _LastLayerInit(LLLaplace):
    """Hands ``last_layer_name`` / ``feature_reduction`` to ``LLLaplace.__init__``,
    which :class:`ActiveSubspaceLaplace`'s ``__init__`` calls without them.
    """

    def __init__(self, model: nn.Module, likelihood: str, **kwargs: Any) -> None:
        LLLaplace.__init__(
            self,
            model,
            likelihood,
            last_layer_name=self._pending_last_layer[0],
            feature_reduction=self._pending_last_layer[1],
            **kwargs,
        )


class LastLayerActiveSubspaceLaplace(ActiveSubspaceLaplace, _LastLayerInit):
    """GLAS over the weights of the last ``nn.Linear`` (laplace-torch's ``LLLaplace``).

    ``theta_L = theta_L* + U z``, ``U`` the top-k eigenvectors of the last-layer GGN
    ``G_L = (1/N) sum_n J_{n,L}^T Lambda_n J_{n,L}``; everything else as in
    :class:`~laplace_glas.ActiveSubspaceLaplace` with ``D = D_L`` (``n_params``). As
    laplace-torch's ``LLLaplace``, ``fit`` finds the last layer on the first batch
    (unless ``last_layer_name`` names it), refuses ``override=False`` and leaves the
    model in evaluation mode.

    Parameters
    ----------
    model, likelihood :
        As in laplace-torch's ``LLLaplace`` (the model is deep-copied into a
        ``FeatureExtractor``).
    *args :
        laplace-torch's ``LLLaplace`` arguments after them, in its order: ``sigma_noise,
        prior_precision, prior_mean, temperature, enable_backprop, feature_reduction,
        dict_key_x, dict_key_y, backend, last_layer_name, backend_kwargs,
        asdl_fisher_kwargs`` (bound to its own signature, with its defaults;
        ``asdl_fisher_kwargs`` must be None). GLAS differentiates through the model's
        own forward pass, so ``feature_reduction`` is only stored (the model's forward
        already reduces its features).
    **kwargs :
        Those arguments by name, and GLAS's: ``n_components``, ``loss_scaling``,
        ``complement``, ``solver``, ... as in
        :class:`~laplace_glas.ActiveSubspaceLaplace`; ``1 <= n_components < D_L``
        (checked once the last layer is known).

    """

    _diag_complement_available = False

    _key = ("last_layer", "glas")
    _k_bound_known_at_init = False  # D_L: checked against n_components once known
    _fit_leaves_model_in_eval = True  # as LLLaplace.fit leaves its feature extractor

    @_with_laplace_torch_signature(LLLaplace)
    def __init__(self, model: nn.Module, likelihood: str, *args: Any, **kwargs: Any) -> None:
        named, glas_kwargs = laplace_torch_arguments(
            LLLaplace, model, likelihood, args, kwargs, type(self).__name__
        )
        last_layer_name = named.pop("last_layer_name")
        if last_layer_name is not None and not isinstance(last_layer_name, str):
            raise TypeError(f"last_layer_name must be a str or None, got {last_layer_name!r}.")
        self._pending_last_layer = (last_layer_name, named.pop("feature_reduction"))
        super().__init__(**named, **glas_kwargs)
        del self._pending_last_layer
        if self.model.last_layer is not None:
            self._use_last_layer()

    @property
    def prior_precision(self) -> torch.Tensor:
        """A scalar or one value per last-layer weight (checked once ``D_L`` is known)."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, prior_precision: float | torch.Tensor) -> None:
        if (
            isinstance(prior_precision, torch.Tensor)
            and prior_precision.numel() > 1
            and self.n_params is not None
            and prior_precision.numel() != self.n_params
        ):
            raise ValueError(
                "prior_precision of a last-layer GLAS must be a scalar or have one value "
                f"per last-layer weight (D_L={self.n_params}), got shape "
                f"{tuple(prior_precision.shape)}: laplace-torch's LLLaplace has no layerwise "
                "prior."
            )
        ActiveSubspaceLaplace.prior_precision.fset(self, prior_precision)

    @unchanged_on_failure
    def optimize_prior_precision(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`ActiveSubspaceLaplace.optimize_prior_precision`, ``'layerwise'`` refused."""
        structure = kwargs.get("prior_structure", args[5] if len(args) > 5 else "scalar")
        if str(getattr(structure, "value", structure)) == "layerwise":
            raise ValueError(
                "prior_structure='layerwise' is not available for a last-layer GLAS "
                "(laplace-torch's LLLaplace takes a scalar or diagonal prior); use 'scalar' "
                "or 'diag'."
            )
        return super().optimize_prior_precision(*args, **kwargs)

    def _use_last_layer(self) -> None:
        """Put the posterior on the (now known) last layer's weights."""
        self.params = [p for p in self.model.last_layer.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("The last layer has no parameters that require grad.")
        self.n_params = sum(p.numel() for p in self.params)
        self.n_layers = len(self.params)
        self._param_names = parameter_names(self.model, self.params)
        self._param_shapes = [p.shape for p in self.params]
        self._n_components = self._validate_n_components(
            self._capped_default(self._n_components, self.n_params), self.n_params
        )

    def _prepare_fit(self, train_loader: Any, override: bool, shards: Shards | None) -> None:
        """Find the last layer on the first batch if it is not known yet (``fit`` then
        runs on its weights); ``override=False`` is refused as by laplace-torch's
        ``LLLaplace``.
        """
        if not override:
            raise ValueError("Last-layer Laplace approximations do not support `override=False`.")
        if self.model.last_layer is not None:
            return
        reiterable("train_loader", train_loader)  # before a batch is taken from it
        first = next(iter(train_loader), None)
        if first is None:
            if shards is None:
                raise ValueError("The training loader is empty: there is no data to fit.")
            return  # an empty shard is refused on every rank by the fit
        inputs = split_batch(first, self.dict_key_y)[0]
        check_input_dtype("The training inputs", inputs, self._dtype, 0)
        self.data = first
        self._find_last_layer(self.data)
        self._use_last_layer()
        # as LLLaplace: the hyperparameters given before D_L was known are checked now
        self.prior_precision = self._prior_precision
        self.prior_mean = self._prior_mean

    @unchanged_on_failure
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a fitted last-layer posterior (finding the layer from the saved batch)."""
        check_state_kind(state_dict, type(self).__name__)  # before any entry is read
        if self._last_layer_name != state_dict.get("_last_layer_name"):
            raise ValueError("Different `last_layer_name` detected!")
        data = state_dict.get("data")
        if self.model.last_layer is None:
            if data is None:
                raise ValueError(
                    "The saved state holds no batch to find the last layer from: construct "
                    "this object with last_layer_name."
                )
            self._find_last_layer(data)
            self._use_last_layer()
        # the last layer is known now: LLLaplace must not look for it again
        super().load_state_dict({**state_dict, "data": None})
        self.data = data


# ---------------------------------------------------------------------- subnetwork
class SubsetOperator(LinearOperator):
    """``G_S = P_S^T G P_S`` of a ``D x D`` operator ``G`` as a SciPy operator.

    ``G_S V = (G P_S V)_S``: embed, one product with ``G``, pick the rows ``S``.
    """

    def __init__(self, operator: Any, indices: torch.Tensor, dtype: torch.dtype):
        np_dtype = NUMPY_DTYPES[dtype]
        self._operator = (
            operator.to_scipy(dtype=np_dtype) if hasattr(operator, "to_scipy") else operator
        )
        self._indices = indices.cpu().numpy()
        self._full = self._operator.shape[0]
        n = len(self._indices)
        super().__init__(dtype=np_dtype, shape=(n, n))

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        full = np.zeros((self._full, X.shape[1]), dtype=self.dtype)
        full[self._indices] = X
        return np.asarray(self._operator.matmat(full))[self._indices]

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(x.reshape(-1, 1)).reshape(-1)

    def _adjoint(self) -> SubsetOperator:
        return self


class _SubnetInit(SubnetLaplace):
    """Hands ``subnetwork_indices`` to ``SubnetLaplace.__init__`` (which takes neither
    ``enable_backprop`` nor the dict keys; those are set afterwards).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        *,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        **kwargs: Any,
    ) -> None:
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        SubnetLaplace.__init__(self, model, likelihood, self._pending_indices, **kwargs)
        self.enable_backprop = enable_backprop
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y


class SubnetActiveSubspaceLaplace(ActiveSubspaceLaplace, _SubnetInit):
    """GLAS over a subnetwork (laplace-torch's ``SubnetLaplace``).

    ``theta_S = theta_S* + U z`` with ``U`` the top-k eigenvectors of
    ``G_S = P_S^T G P_S``; the other weights stay at the MAP. ``n_params`` is
    ``D_S`` and ``mean`` the subnetwork's MAP (``mean_subnet``, as laplace-torch
    names it, is the same tensor); the full network's count is ``n_params_model``.

    Parameters
    ----------
    model, likelihood :
        As in laplace-torch's ``SubnetLaplace``.
    *args :
        laplace-torch's ``SubnetLaplace`` arguments after them, in its order:
        ``subnetwork_indices, sigma_noise, prior_precision, prior_mean, temperature,
        backend, backend_kwargs, asdl_fisher_kwargs`` (bound to its own signature, with
        its defaults; ``subnetwork_indices``: distinct indices into
        ``parameters_to_vector(model.parameters())``, a non-empty 1-D LongTensor).
    **kwargs :
        Those arguments by name; ``enable_backprop``, ``dict_key_x`` and ``dict_key_y``
        (by keyword only: laplace-torch's ``SubnetLaplace`` does not take them; as in
        its ``ParametricLaplace``); and the keywords of
        :class:`~laplace_glas.ActiveSubspaceLaplace`; ``1 <= n_components < D_S``.
        The eigenpairs come from Lanczos or the block solver (the dual solve needs the
        whole network's factors).

    """

    _diag_complement_available = False

    _directions_embedded = True

    _key = ("subnetwork", "glas")

    @_with_laplace_torch_signature(SubnetLaplace, "enable_backprop", "dict_key_x", "dict_key_y")
    def __init__(self, model: nn.Module, likelihood: str, *args: Any, **kwargs: Any) -> None:
        named, glas_kwargs = laplace_torch_arguments(
            SubnetLaplace, model, likelihood, args, kwargs, type(self).__name__
        )
        self._pending_indices = named.pop("subnetwork_indices")
        prior_mean = named.pop("prior_mean")
        self._theta_map: torch.Tensor | None = None
        # the prior mean is set below, over the subnetwork
        super().__init__(**named, prior_mean=0.0, **glas_kwargs)
        del self._pending_indices
        self.n_params_model = self.n_params
        self.n_params = self.n_params_subnet
        # the prior mean is over the subnetwork's D_S weights (set now that n_params is
        # D_S; the constructor above checked it against the whole network's D)
        size = prior_mean.numel() if isinstance(prior_mean, torch.Tensor) else 1
        if size not in (1, self.n_params) and size == self.n_params_model:
            raise ValueError(
                f"prior_mean has {size} entries (the whole network's D={size}); the "
                f"subnetwork posterior's prior is over its D_S={self.n_params} weights: "
                "pass prior_mean[subnetwork_indices] or a scalar."
            )
        self.prior_mean = prior_mean
        self._n_components = self._validate_n_components(
            self._capped_default(self._n_components, self.n_params), self.n_params
        )

    @property
    def subnetwork_indices(self) -> torch.Tensor:
        """Indices of the subnetwork in ``parameters_to_vector(model.parameters())``."""
        return self.backend.subnetwork_indices

    @property
    def mean_subnet(self) -> torch.Tensor:
        """The subnetwork's MAP weights (``(D_S,)``; the same tensor as ``mean``)."""
        return self.mean

    @property
    def prior_precision_diag(self) -> torch.Tensor:
        """The ``(D_S,)`` prior precisions in the model's dtype (laplace-torch's scalar
        case builds them in the default dtype, which can differ from the model's).
        """
        return super().prior_precision_diag.to(self._dtype)

    def _fitted_mean(self, theta: torch.Tensor) -> torch.Tensor:
        """The subnetwork's entries of the fitted weights (the whole network's ``theta``
        is kept for the predictive and ``sample``).
        """
        self._theta_map = theta
        return theta[self._index_on_device()]

    def state_dict(self) -> dict[str, Any]:
        """:meth:`ActiveSubspaceLaplace.state_dict` plus the ``subnetwork_indices``."""
        return {**super().state_dict(), "subnetwork_indices": self.subnetwork_indices.cpu()}

    @unchanged_on_failure
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`ActiveSubspaceLaplace.load_state_dict`, refused for a state saved with
        other ``subnetwork_indices`` (a state without them loads with a warning).
        """
        check_subnetwork_indices(self.subnetwork_indices, state_dict)
        super().load_state_dict(state_dict)
        self._theta_map = None  # rebuilt from the state's subnetwork MAP when needed

    def optimize_prior_precision(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`ActiveSubspaceLaplace.optimize_prior_precision`; only a scalar prior."""
        structure = kwargs.get("prior_structure", args[5] if len(args) > 5 else "scalar")
        if str(getattr(structure, "value", structure)) != "scalar":
            raise ValueError(
                f"prior_structure={str(getattr(structure, 'value', structure))!r} is not "
                "implemented for SubnetActiveSubspaceLaplace (its directions are embedded "
                "in the network): use prior_structure='scalar'."
            )
        return super().optimize_prior_precision(*args, **kwargs)

    def _index_on_device(self) -> torch.Tensor:
        return self.subnetwork_indices.to(self._device)

    def _solve(self, problem: CurvatureProblem, *args: Any, **kwargs: Any) -> Any:
        """The whole network's solve (weights outside the subnetwork may get no graph)."""
        params = list(self.model.parameters())
        inside = torch.zeros(sum(p.numel() for p in params), dtype=torch.bool)
        inside[self.subnetwork_indices.cpu()] = True
        spans = inside.split([p.numel() for p in params])
        outside = [p for p, span in zip(params, spans, strict=True) if not span.any()]
        with outside_posterior(outside):
            return super()._solve(problem, *args, **kwargs)

    def _plan(self, problem: CurvatureProblem, k: int, ncv: int | None = None) -> Plan:
        """The whole network's plan, its operator restricted to the subnetwork."""
        plan = super()._plan(problem, k, ncv)
        return replace(
            plan,
            operator=SubsetOperator(plan.operator, self.subnetwork_indices, self._dtype),
            solver="block" if plan.solver == "block" else "lanczos",
            operator_name=f"{plan.operator_name}, subnetwork of {self.n_params}",
        )

    def _network_weights(self) -> torch.Tensor:
        if self._theta_map is None:  # loaded: the state's subnetwork MAP in the others
            theta = parameters_to_vector(self.params).detach().clone()
            theta[self._index_on_device()] = self.mean.detach().to(theta)
            self._theta_map = theta
        return self._theta_map

    def _network_directions(self) -> torch.Tensor:
        return self._network_directions_up_to(self._n_components)

    def _network_directions_up_to(self, k: int) -> torch.Tensor:
        return self._embed_directions(self.H[0][:, :k])

    def _embed_directions(self, V: torch.Tensor) -> torch.Tensor:
        full = V.new_zeros(self.n_params_model, V.shape[1])
        full[self._index_on_device()] = V
        return full

    def _embed_weight_draws(self, draws: torch.Tensor) -> torch.Tensor:
        full = draws.new_zeros(draws.shape[0], self.n_params_model)
        full[:, self._index_on_device()] = draws
        return full

    def _prior_gram(self, X: Any, theta: torch.Tensor, joint: bool = False) -> torch.Tensor:
        """``J_S J_S^T`` from ``D_S`` forward-mode JVPs along the embedded unit vectors."""
        eye = torch.eye(self.n_params, device=self._device, dtype=self._dtype)
        units = eye.new_zeros(self.n_params_model, self.n_params)
        units[self._index_on_device()] = eye
        _, J = jvp_directions(
            self.model,
            self._param_names,
            self._param_shapes,
            theta,
            X,
            units,
            chunk_size=self.jvp_chunk_size,
        )
        J = J.reshape(-1, J.shape[-2], J.shape[-1])  # (n, C, D_S)
        if joint:
            J = J.reshape(-1, J.shape[-1])
            return J @ J.T
        return J @ J.transpose(1, 2)

    def sample(
        self, n_samples: int = 100, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``(n_samples, D)`` whole-network weight vectors: the subnetwork drawn from
        the posterior, the other weights at the MAP (laplace-torch's convention).
        """
        draws = super().sample(n_samples, generator)  # (n, D_S) around the subnetwork's MAP
        full = self._network_weights().reshape(1, -1).repeat(draws.shape[0], 1)
        full[:, self._index_on_device()] = draws
        return full
