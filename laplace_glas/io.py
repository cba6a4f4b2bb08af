"""Saving and restoring a fitted GLAS posterior: the state dict and its checks.

The state is laplace-torch's (``mean``, ``H``, ``loss``, priors, noise, counts, ...)
plus the GLAS settings and the eigen-solve record. Here ``H = (U, h)`` with ``U`` the
``(D, K)`` computed eigenvectors and ``h = N * eig(G_1) >= 0``. Every entry holds
tensors or Python scalars only, so ``torch.load(..., weights_only=True)`` reads it.

:func:`check_state` validates a whole state before anything is assigned, so that a
refused ``load_state_dict`` leaves the posterior exactly as it was.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from laplace.utils.matrix import Kron

from laplace_glas.curvature.complement.kfac_layers import check_kron_factors
from laplace_glas.curvature.data.map_loss import loss_fn_name
from laplace_glas.curvature.solvers.eigenpairs import Eigenpairs
from laplace_glas.validation import (
    flag,
    homoscedastic_noise,
    positive_scalar,
    prior_precision_values,
    scalar_prior_precision,
    scalar_value,
)

__all__ = [
    "GLAS_KEYS",
    "LAPLACE_KEYS",
    "check_state",
    "check_state_kind",
    "check_subnetwork_indices",
    "eigenpair_record",
    "glas_state",
    "restore_glas_state",
]

LAPLACE_KEYS = (
    "mean",
    "H",
    "loss",
    "prior_mean",
    "prior_precision",
    "sigma_noise",
    "n_data",
    "n_outputs",
    "likelihood",
    "temperature",
    "enable_backprop",
    "cls_name",
)
"""Keys of laplace-torch's ``ParametricLaplace.state_dict``."""

GLAS_KEYS = ("loss_scaling", "complement", "n_components", "eigenpairs")
"""Keys GLAS adds (optional: ``loss_fn``, the name of a custom curvature loss, and for
``complement='auto'`` ``complement_setting`` and ``complement_reason``; ``complement``
then holds what ``fit`` resolved it to).
"""

_EIGENPAIR_KEYS = (
    "values",
    "vectors",
    "residuals",
    "below_threshold",
    "raw_values",
    "n_products",
    "n_requested",
    "n_converged",
    "wall_time",
    "n_data",
    "rank_threshold",
)


def _tensor(entry: str, value: Any, shape: tuple[int | None, ...] | None = None) -> torch.Tensor:
    """``value`` (the state's ``entry``) must be a finite floating tensor of ``shape``
    (None: any length).
    """
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"{entry} must be a floating-point tensor, got {value!r}.")
    if shape is not None and (
        value.ndim != len(shape)
        or any(want is not None and got != want for got, want in zip(value.shape, shape))
    ):
        wanted = tuple("any" if s is None else s for s in shape)
        raise ValueError(f"{entry} has shape {tuple(value.shape)}, expected {wanted}.")
    if not torch.isfinite(value).all():
        raise ValueError(f"{entry} contains NaN or inf.")
    return value


def _count(key: str, value: Any, low: int = 1) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"state_dict[{key!r}] must be an int >= {low}, got {value!r}.")
    return value


def _hyperparameter(key: str, check: Callable[[], Any]) -> None:
    """Run the setter's own check of ``state[key]``; its error names the entry."""
    try:
        check()
    except (TypeError, ValueError) as err:
        raise ValueError(f"state_dict[{key!r}]: {err}") from None


def _check_curvature(H: Any, n_params: int) -> int:
    """``state['H']`` must be ``(U, h)``: orthonormal ``(D, K)`` eigenvectors with
    ``1 <= K < D`` and ``K`` curvatures ``>= 0``; returns ``K``.
    """
    if not isinstance(H, (tuple, list)) or len(H) != 2:
        raise ValueError("state_dict['H'] must be the pair (eigenvectors, curvatures).")
    U = _tensor("state_dict['H'][0] (eigenvectors)", H[0], (n_params, None))
    h = _tensor("state_dict['H'][1] (curvatures)", H[1], (U.shape[1],))
    n_computed = U.shape[1]
    if not 1 <= n_computed < n_params:
        raise ValueError(
            f"state_dict['H'] holds {n_computed} eigenvectors; GLAS needs 1 <= K < D={n_params}."
        )
    gram = U.T.to(torch.float64) @ U.to(torch.float64)
    eye = torch.eye(n_computed, dtype=torch.float64, device=gram.device)
    if not torch.allclose(gram, eye, atol=1e3 * torch.finfo(U.dtype).eps * n_computed):
        raise ValueError(
            "state_dict['H'][0] holds eigenvectors that are not orthonormal "
            f"(max |U^T U - I| = {float((gram - eye).abs().max()):.2g})."
        )
    if (h < 0).any():
        raise ValueError(
            "state_dict['H'][1] holds negative curvatures: the GGN is positive "
            f"semi-definite (smallest value {float(h.min()):.3g})."
        )
    return n_computed


def check_state_kind(state: Any, cls_name: str) -> None:
    """``state`` is a GLAS state dict (a mapping with every key of :data:`LAPLACE_KEYS`
    and :data:`GLAS_KEYS`) saved by the class ``cls_name``; a ``ValueError`` naming what
    it is instead otherwise (the first check of every load, before any entry is read).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"A GLAS state dict is a mapping, got {type(state).__name__}.")
    missing = [key for key in (*LAPLACE_KEYS, *GLAS_KEYS) if key not in state]
    if missing:
        raise ValueError(
            f"Not a GLAS state dict: the key(s) {', '.join(map(repr, missing))} are missing."
        )
    if state["cls_name"] != cls_name:
        raise ValueError(
            f"The state dict is of a {state['cls_name']!r}, not of a {cls_name!r}: make sure "
            "`subset_of_weights` and `hessian_structure` are correct."
        )


def check_state(
    state: Mapping[str, Any],
    *,
    cls_name: str,
    n_params: int,
    likelihood: str,
    loss_scalings: tuple[str, ...],
    complements: tuple[str, ...],
    dtype: torch.dtype | None = None,
    n_layers: int | None = None,
    param_shapes: list[torch.Size] | None = None,
) -> None:
    """Validate a GLAS state dict against the posterior it is loaded into.

    With ``n_layers``, a prior precision of one value per parameter tensor or per
    weight is accepted as well (positive and finite). With ``param_shapes``, the
    Kronecker factors of ``complement='kron'`` are checked block by block against them.

    Raises
    ------
    ValueError
        Naming the first missing key or invalid entry: a state of another class,
        likelihood or number of parameters; non-finite tensors; negative eigenvalues
        ``h``; eigenvectors not of shape ``(D, K)``; ``n_components`` outside
        ``[1, K]``; an unknown loss scaling or complement; a prior precision, noise
        or temperature that is not a finite positive number.

    """
    check_state_kind(state, cls_name)
    if str(getattr(state["likelihood"], "value", state["likelihood"])) != likelihood:
        raise ValueError(
            f"Different likelihoods detected: the state dict's is {state['likelihood']!r}, "
            f"this posterior's {likelihood!r}."
        )
    mean = _tensor("state_dict['mean']", state["mean"], (None,))
    if mean.numel() != n_params:
        raise ValueError(
            f"The state dict is of a model with a different number of parameters: its mean "
            f"has {mean.numel()} entries, this model D={n_params} under inference; use the "
            "same model and the same requires_grad switches."
        )
    n_computed = _check_curvature(state["H"], n_params)
    n_components = _count("n_components", state["n_components"])
    if n_components > n_computed:
        raise ValueError(
            f"state_dict['n_components']={n_components} exceeds the {n_computed} "
            "eigenpairs the state holds."
        )
    for key, allowed in (("loss_scaling", loss_scalings), ("complement", complements)):
        if state[key] not in allowed:
            raise ValueError(f"state_dict[{key!r}] must be one of {allowed}, got {state[key]!r}.")
    setting = state.get("complement_setting", state["complement"])
    if setting not in ("auto", state["complement"]):
        raise ValueError(
            f"state_dict['complement_setting'] must be 'auto' or the complement "
            f"{state['complement']!r}, got {setting!r}."
        )
    if not isinstance(state.get("complement_reason", ""), str):
        raise ValueError("state_dict['complement_reason'] must be a str.")
    kron_blocks = _check_ggn_kron(state, n_params, param_shapes)
    _check_ggn_diagonal(state, n_params, kron_blocks)
    _count("n_data", state["n_data"])
    _count("n_outputs", state["n_outputs"])
    if not math.isfinite(scalar_value("state_dict['loss']", state["loss"])):
        raise ValueError("state_dict['loss'] is not finite.")
    # the checks the setters run when the state is assigned, in the model's dtype, so
    # that no setter can refuse a value halfway through the load
    prior_precision, sigma_noise = state["prior_precision"], state["sigma_noise"]
    _hyperparameter(
        "prior_precision",
        lambda: (
            scalar_prior_precision(prior_precision, dtype)
            if n_layers is None
            else prior_precision_values(prior_precision, n_layers, n_params, dtype)
        ),
    )
    _hyperparameter("sigma_noise", lambda: homoscedastic_noise(sigma_noise, dtype, likelihood))
    _hyperparameter(
        "temperature", lambda: positive_scalar("temperature", state["temperature"], dtype=dtype)
    )
    _hyperparameter("enable_backprop", lambda: flag("enable_backprop", state["enable_backprop"]))
    prior_mean = state["prior_mean"]
    if isinstance(prior_mean, torch.Tensor):
        if prior_mean.numel() not in (1, n_params) or not torch.isfinite(prior_mean).all():
            raise ValueError("state_dict['prior_mean'] must be finite, scalar or of length D.")
    _check_eigenpairs(eigenpair_record(state), state["H"][0])


def eigenpair_record(state: Mapping[str, Any]) -> dict[str, Any]:
    """The eigen-solve record of a state as ``Eigenpairs.to_dict()``'s dict.

    States store it as a tuple of ``(field, value)`` pairs without the eigenvectors
    (``H[0]`` holds them); states of version 0.1 as a dict with them. Both are read.
    """
    record = state["eigenpairs"]
    if isinstance(record, (tuple, list)):
        try:
            record = dict(record)
        except (TypeError, ValueError):
            raise ValueError(
                "state_dict['eigenpairs'] must be a tuple of (field, value) pairs."
            ) from None
    if not isinstance(record, Mapping):
        raise ValueError(
            "state_dict['eigenpairs'] must be a tuple of (field, value) pairs "
            "(or the dict Eigenpairs.to_dict() returns)."
        )
    record = dict(record)
    H = state.get("H")
    if "vectors" not in record and isinstance(H, (tuple, list)) and len(H) == 2:
        record["vectors"] = H[0]
    return record


def _check_eigenpairs(record: Mapping[str, Any], U: torch.Tensor) -> None:
    missing = [key for key in _EIGENPAIR_KEYS if key not in record]
    if missing:
        raise ValueError(
            f"state_dict['eigenpairs'] lacks the key(s) {', '.join(map(repr, missing))}."
        )
    vectors = record["vectors"]
    if not isinstance(vectors, torch.Tensor) or vectors.shape != U.shape:
        raise ValueError(
            "state_dict['eigenpairs']['vectors'] must have the shape of the eigenvectors "
            f"in state_dict['H'], {tuple(U.shape)}."
        )
    for key in ("values", "residuals", "raw_values", "below_threshold"):
        value = record[key]
        if not isinstance(value, torch.Tensor) or value.shape != (U.shape[1],):
            raise ValueError(
                f"state_dict['eigenpairs'][{key!r}] must be a tensor of shape ({U.shape[1]},)."
            )
        if key in ("values", "raw_values") and not torch.isfinite(value).all():
            raise ValueError(f"state_dict['eigenpairs'][{key!r}] contains NaN or inf.")


def _check_ggn_diagonal(
    state: Mapping[str, Any], n_params: int, kron_blocks: list | None = None
) -> None:
    """``complement='diag'`` needs the summed GGN diagonal: ``(D,)``, finite, ``>= 0``;
    ``'kron_diag'`` that of the parameters whose Kronecker block is empty (their sizes).
    """
    diagonal = state.get("ggn_diagonal")
    if diagonal is None:
        if state["complement"] in ("diag", "kron_diag"):
            raise ValueError(
                "state_dict['ggn_diagonal'] is missing: complement="
                f"{state['complement']!r} needs the GGN diagonal that its fit computed."
            )
        return
    size = n_params
    if state["complement"] == "kron_diag" and kron_blocks is not None:
        size = n_params - sum(
            math.prod(F.shape[0] for F in block) for block in kron_blocks if block
        )
    diagonal = _tensor("state_dict['ggn_diagonal']", diagonal, (size,))
    if (diagonal < 0).any():
        raise ValueError("state_dict['ggn_diagonal'] holds negative values: a GGN's diagonal.")


def _check_ggn_kron(
    state: Mapping[str, Any], n_params: int, shapes: list[torch.Size] | None
) -> list | None:
    """``complement='kron'`` needs KFAC's factors: one ``(B, A)`` / ``(B,)`` block per
    parameter tensor, square, symmetric and finite, of Kronecker sizes summing to ``D``
    (``'kron_diag'``: also ``[]`` for a parameter the GGN diagonal covers; the parameter
    shapes are then needed). Returns the checked blocks (None where there are none).
    """
    blocks, partial = state.get("ggn_kron"), state["complement"] == "kron_diag"
    if blocks is None:
        if state["complement"] in ("kron", "kron_diag"):
            raise ValueError(
                f"state_dict['ggn_kron'] is missing: complement={state['complement']!r} "
                "needs the Kronecker factors that its fit computed."
            )
        return None
    if partial and shapes is None:
        raise ValueError(
            "A complement='kron_diag' state is checked against the posterior's parameter "
            "shapes (the sizes of the parameters the GGN diagonal covers); none were given."
        )
    if shapes is None:  # the blocks' own sizes, which must then sum to D
        shapes = [
            torch.Size([math.prod(F.shape[0] for F in block)])
            if isinstance(block, (list, tuple))
            and all(isinstance(F, torch.Tensor) and F.ndim == 2 for F in block)
            else torch.Size([0])
            for block in (blocks if isinstance(blocks, (list, tuple)) else [])
        ]
        if sum(math.prod(shape) for shape in shapes) != n_params:
            raise ValueError(f"state_dict['ggn_kron'] does not cover the D={n_params} weights.")
    checked = check_kron_factors(blocks, shapes, "state_dict['ggn_kron']", partial=partial)
    for i, block in enumerate(checked):  # sums of outer products: positive semi-definite
        for F in (F for F in block if F.numel()):
            values = torch.linalg.eigvalsh(F.double())
            rounding = math.sqrt(torch.finfo(F.dtype).eps) * max(float(values.abs().max()), 1e-30)
            if float(values.min()) < -rounding:
                raise ValueError(
                    f"state_dict['ggn_kron']: block {i} holds a factor with a negative "
                    f"eigenvalue ({float(values.min()):.3g}); KFAC's factors are positive "
                    "semi-definite."
                )
    return checked


def restored_complement(
    state: Mapping[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor | None, Kron | None]:
    """The checked state's GGN diagonal and KFAC factors (None where it holds none) on
    ``device`` in ``dtype``.
    """
    diagonal, blocks = state.get("ggn_diagonal"), state.get("ggn_kron")
    if diagonal is not None:
        diagonal = diagonal.to(device, dtype)
    if blocks is not None:
        blocks = Kron([[F.to(device, dtype) for F in block] for block in blocks])
    return diagonal, blocks


def glas_state(la: Any, base_state: dict[str, Any]) -> dict[str, Any]:
    """laplace-torch's ``base_state`` of the fitted ``la`` plus the GLAS entries.

    Its top-level values are tensors, Python scalars, strings and tuples only
    (laplace-torch's rule for a state without pickled objects), so
    ``torch.load(..., weights_only=True)`` reads it back. The eigen-solve record is
    stored as a tuple of ``(field, value)`` pairs without its eigenvectors, which
    ``H[0]`` holds.
    """
    state = dict(base_state)
    state["likelihood"] = str(getattr(la.likelihood, "value", la.likelihood))
    state["H"] = tuple(la.H)
    state["loss_scaling"] = la.loss_scaling
    state["complement"] = la.complement
    state["n_components"] = la.n_components
    record = la.lanczos_info.to_dict()
    del record["vectors"]  # the same tensor as H[0]
    state["eigenpairs"] = tuple(record.items())
    state["loss_fn"] = loss_fn_name(la.loss_fn)
    view = la.posterior
    if view.ggn_diagonal is not None:
        state["ggn_diagonal"] = view.ggn_diagonal
    if view.ggn_kron is not None:
        state["ggn_kron"] = tuple(tuple(block) for block in view.ggn_kron.kfacs)
    return state


def restore_glas_state(
    la: Any,
    state: Mapping[str, Any],
    *,
    loss_scalings: tuple[str, ...],
    complements: tuple[str, ...],
    dtype: torch.dtype,
) -> Eigenpairs:
    """Validate ``state`` for ``la`` (:func:`check_state`) and return its eigen-solve
    record; ``la``'s ``load_state_dict`` then assigns the state.

    Settings of ``la`` that the state replaces (loss scaling, complement,
    ``n_components``, a different custom loss) are named in a warning. Nothing is read
    from ``la`` but its public settings, and nothing is assigned here: a refused state
    leaves ``la`` as it was.
    """
    check_state(
        state,
        cls_name=type(la).__name__,
        n_params=la.n_params,
        likelihood=str(getattr(la.likelihood, "value", la.likelihood)),
        loss_scalings=loss_scalings,
        complements=complements,
        dtype=dtype,
        n_layers=la.n_layers,
        param_shapes=[p.shape for p in la.params],
    )
    if la.loss_scaling != state["loss_scaling"]:
        warnings.warn(
            f"loss_scaling {la.loss_scaling!r} is replaced by the saved {state['loss_scaling']!r}.",
            stacklevel=3,
        )
    if la.complement not in (state["complement"], state.get("complement_setting")):
        warnings.warn(
            f"complement {la.complement!r} is replaced by the saved {state['complement']!r}.",
            stacklevel=3,
        )
    if la.n_components != state["n_components"]:
        warnings.warn(
            f"n_components {la.n_components} is replaced by the saved {state['n_components']}.",
            stacklevel=3,
        )
    saved_loss = state.get("loss_fn", "")
    if saved_loss != loss_fn_name(la.loss_fn):
        warnings.warn(
            f"The saved eigenpairs are those of loss_fn {saved_loss or None!r}; this "
            f"object has {loss_fn_name(la.loss_fn) or None!r}. The loaded curvature "
            "is used as saved.",
            stacklevel=3,
        )
    try:
        eigenpairs = Eigenpairs.from_dict(eigenpair_record(state))
    except TypeError as err:
        raise ValueError(f"state_dict['eigenpairs'] is not an eigen-solve record: {err}") from None
    return eigenpairs


def check_subnetwork_indices(indices: torch.Tensor, state: Mapping[str, Any]) -> None:
    """The saved ``subnetwork_indices`` of a subnetwork posterior's ``state`` must be
    ``indices``, those of the object it is loaded into.

    Parameters
    ----------
    indices : torch.Tensor
        The subnetwork's weight indices of the receiving object.
    state : mapping
        The state dict to load.

    Raises
    ------
    ValueError
        When the saved indices differ (the eigenvectors would be put on other weights).

    Warns
    -----
    UserWarning
        When the state holds no indices (saved before they were stored): they cannot be
        checked.

    """
    if not isinstance(state, Mapping):
        return  # check_state names the problem
    saved = state.get("subnetwork_indices")
    if saved is None:
        warnings.warn(
            "The state holds no subnetwork_indices (saved by an older version): that its "
            "eigenvectors belong to this object's subnetwork cannot be checked.",
            UserWarning,
            stacklevel=3,
        )
        return
    if not isinstance(saved, torch.Tensor) or saved.is_floating_point() or saved.is_complex():
        raise ValueError(f"subnetwork_indices must be an integer tensor, got {saved!r}.")
    saved = saved.detach().cpu().reshape(-1).long()
    mine = indices.detach().cpu().reshape(-1).long()
    if saved.shape != mine.shape or not torch.equal(saved, mine):
        differ = "different sizes" if saved.numel() != mine.numel() else "the same size"
        raise ValueError(
            f"The state was saved with other subnetwork_indices ({differ}: "
            f"{saved.numel()} saved, {mine.numel()} here): its eigenvectors are over "
            "other weights. Load it into a SubnetActiveSubspaceLaplace constructed with "
            "the saved subnetwork_indices (state_dict['subnetwork_indices'])."
        )
