"""Network outputs and their derivatives along weight-space directions.

* :func:`jvp_directions` computes ``f(x; theta)`` and ``J(x) V`` for a ``(D, k)``
  matrix ``V`` by ``k`` forward-mode Jacobian-vector products under ``vmap``: the
  ``C x D`` Jacobian is not formed, except where torch.func refuses the model (then
  one backward pass per output element forms it, and ``J V`` is a product).
* :func:`batched_outputs` evaluates ``f(x; theta_s)`` for a batch of weight vectors
  with ``torch.func.functional_call`` under ``vmap`` (a loop over
  ``functional_call`` where a module has no batching rule); the module's own
  parameters are never overwritten.
* :func:`jacobian_gram` computes ``J(x) J(x)^T`` per input, for the prior's share of
  the predictive variance when the complement of the subspace keeps the prior.

Weight vectors are flat, in the order of ``names`` (that of ``model.parameters()``
restricted to the parameters under inference).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import jacrev, jvp, vmap

from laplace_glas.autodiff.functional import module_call
from laplace_glas.curvature.data.batches import batch_input
from laplace_glas.validation import check_model_output

__all__ = [
    "batched_outputs",
    "jacobian_by_backward",
    "jacobian_gram",
    "jacobian_rows",
    "jvp_directions",
    "parameter_names",
    "row_chunks",
    "unflatten",
    "weighted_gram",
]


def parameter_names(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """Names of ``params`` in ``model.named_parameters()``, in the given order."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    try:
        return [by_id[id(p)] for p in params]
    except KeyError:
        raise ValueError("Every parameter under inference must belong to the model.") from None


def unflatten(
    vector: torch.Tensor, names: Sequence[str], shapes: Sequence[torch.Size]
) -> dict[str, torch.Tensor]:
    """Split a flat ``(..., D)`` tensor into a ``{name: (..., *shape)}`` dict."""
    out, offset = {}, 0
    lead = vector.shape[:-1]
    for name, shape in zip(names, shapes):
        n = shape.numel()
        out[name] = vector[..., offset : offset + n].reshape(*lead, *shape)
        offset += n
    if offset != vector.shape[-1]:
        raise ValueError(f"Vector of length {vector.shape[-1]} does not match D = {offset}.")
    return out


def _call(
    model: nn.Module, params: Mapping[str, torch.Tensor], x: Any, kwargs: dict
) -> torch.Tensor:
    return check_model_output(module_call(model, dict(params), (x,), kwargs or None))


# Models whose forward failed under vmap (e.g. nn.LSTM: no batching rule for aten::lstm),
# so that the sampling predictive does not retry vmap on every chunk.
_NO_BATCHING_RULE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def jvp_directions(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    theta: torch.Tensor,
    x: Any,
    directions: torch.Tensor,
    chunk_size: int | None = None,
    model_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``f(x; theta)`` and ``J(x) V`` by forward-mode AD.

    Parameters
    ----------
    model : nn.Module
        The network; its own parameters are not modified.
    names, shapes : sequences
        Names and shapes of the parameters that ``theta`` holds.
    theta : torch.Tensor
        ``(D,)`` point of linearisation.
    x : torch.Tensor or mapping
        Model input.
    directions : torch.Tensor
        ``(D, k)`` directions ``V``.
    chunk_size : int, optional
        Number of JVPs vectorised at once (``vmap`` chunking, bounds memory).
    model_kwargs : dict, optional
        Extra keyword arguments of the model's forward.

    Returns
    -------
    f : torch.Tensor
        ``(batch, *out)`` outputs at ``theta``.
    JV : torch.Tensor
        ``(batch, *out, k)``: ``J(x) V``.

    """
    kwargs = model_kwargs or {}
    primals = unflatten(theta, names, shapes)
    tangents = unflatten(directions.T, names, shapes)  # {name: (k, *shape)}

    def f(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return _call(model, params, x, kwargs)

    def push(tangent: dict[str, torch.Tensor]) -> torch.Tensor:
        return jvp(f, (primals,), (tangent,))[1]

    out = f(primals)
    try:
        JV = vmap(push, chunk_size=chunk_size)(tangents)  # (k, batch, *out)
    except RuntimeError as err:  # what torch.func refuses, plain autograd may take
        try:
            J = jacobian_by_backward(f, primals, names)  # (batch * ..., C, D)
        except Exception:
            raise err from None
        JV = J.to(directions.dtype) @ directions  # (batch * ..., C, k)
        return out, JV.reshape(*out.shape, directions.shape[1])
    return out, JV.movedim(0, -1)


def batched_outputs(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    thetas: torch.Tensor,
    x: Any,
    chunk_size: int | None = None,
    model_kwargs: dict | None = None,
) -> torch.Tensor:
    """``f(x; theta_s)`` for every row of ``thetas`` ``(S, D)``; returns ``(S, batch, *out)``.

    Vectorised with ``vmap`` over the samples; modules without a batching rule fall
    back to a loop of ``functional_call`` (still without touching the module's own
    weights).
    """
    kwargs = model_kwargs or {}

    def f(theta: torch.Tensor) -> torch.Tensor:
        return _call(model, unflatten(theta, names, shapes), x, kwargs)

    if model not in _NO_BATCHING_RULE:
        try:
            return vmap(f, chunk_size=chunk_size, randomness="same")(thetas)
        except (RuntimeError, NotImplementedError):
            # the loop raises the caller's own errors (e.g. a wrong input shape); only
            # when it works did vmap lack a batching rule, and later calls go straight
            # to the loop
            outputs = torch.stack([f(theta) for theta in thetas])
            _NO_BATCHING_RULE.add(model)
            return outputs
    return torch.stack([f(theta) for theta in thetas])


def jacobian_rows(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    theta: torch.Tensor,
    x: Any,
    model_kwargs: dict | None = None,
) -> torch.Tensor:
    """``(b * ..., C, D)``: the Jacobian of the outputs of ``x`` (leading axes flattened)
    over the weights ``names`` at ``theta``, by reverse mode (``torch.func.jacrev``;
    plain autograd, one backward pass per output row, where torch.func refuses).
    """
    kwargs = model_kwargs or {}
    primals = unflatten(theta, names, shapes)

    def f(params):
        return _call(model, params, x, kwargs)

    try:
        J = jacrev(f)(primals)  # {name: (b, ..., C, *shape)}
    except RuntimeError as err:  # what torch.func refuses, plain autograd may take
        try:
            return jacobian_by_backward(f, primals, names)
        except Exception:
            raise err from None
    first = J[names[0]]
    n_out = first.shape[first.ndim - len(shapes[0]) - 1]
    flat = [J[n].reshape(-1, n_out, s.numel()) for n, s in zip(names, shapes)]
    return torch.cat(flat, dim=-1)


def jacobian_gram(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    theta: torch.Tensor,
    x: torch.Tensor | Mapping[str, Any],
    joint: bool = False,
    chunk_size: int = 32,
    model_kwargs: dict | None = None,
    dict_key_x: str = "input_ids",
    weights: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``J J^T`` at ``theta``: ``(batch, C, C)``, or ``(batch*C, batch*C)`` if ``joint``.

    With ``weights`` ``w`` ``(D,)``: ``J diag(w) J^T`` (a diagonal prior's covariance);
    with a callable ``B`` (a symmetric ``D x D`` operator applied to the last axis):
    ``J B J^T``; a callable with a ``root`` method ``J -> J R`` (``B = R R^T``, e.g. the
    projected KFAC inverse of ``complement='kron'``) gives ``(J R) (J R)^T``, which stays
    positive semi-definite in floating point.

    For outputs ``(batch, ..., C)`` the leading axes are flattened: ``(batch * ..., C, C)``.

    Forms the Jacobian of at most ``chunk_size`` inputs at a time (``joint`` needs
    all of them), so memory stays ``O(chunk_size * C * D)``. A mapping input is cut
    into chunks along the batch axis of ``x[dict_key_x]`` (every tensor entry with that
    leading size; other entries are passed whole).
    """

    def jac(x_chunk: Any) -> torch.Tensor:
        return jacobian_rows(model, names, shapes, theta, x_chunk, model_kwargs)

    if joint:
        J = jac(x)
        return weighted_gram(J.reshape(-1, J.shape[-1]), weights)
    return torch.cat(
        [weighted_gram(jac(rows), weights) for rows in row_chunks(x, chunk_size, dict_key_x)]
    )


def weighted_gram(
    J: torch.Tensor, weights: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None
) -> torch.Tensor:
    """``J B J^T`` over the last axis of Jacobian rows ``J`` ``(..., R, D)``: ``B = I``
    (``weights`` None), ``diag(w)`` (a ``(D,)`` tensor), an operator ``J -> J B`` (a
    callable), or ``(J R)(J R)^T`` for a callable with a ``root`` method ``J -> J R``
    (``B = R R^T``, positive semi-definite in floating point).
    """
    if hasattr(weights, "root"):
        R = weights.root(J)
        return R @ R.transpose(-1, -2)
    if weights is None:
        return J @ J.transpose(-1, -2)
    return (weights(J) if callable(weights) else J * weights) @ J.transpose(-1, -2)


def jacobian_by_backward(
    f: Callable[[dict], torch.Tensor], primals: Mapping[str, torch.Tensor], names: Sequence[str]
) -> torch.Tensor:
    """``(b * ..., C, D)`` Jacobian rows of ``f``'s outputs, one backward pass each: for
    models torch.func refuses (non-reentrant activation checkpointing saves its tensors
    through hooks, which ``jacrev`` does not support; an ``autograd.Function`` without
    ``setup_context``, such as a reentrant checkpoint around a frozen segment, is
    refused by every transform). Each output element depends on its own example only,
    so its gradient is its Jacobian row.
    """
    leaves = {n: p.detach().requires_grad_(True) for n, p in primals.items()}
    with torch.enable_grad():
        out = f(leaves)
        flat = out.reshape(-1)
        rows = []
        for i in range(flat.numel()):
            grads = torch.autograd.grad(
                flat[i], [leaves[n] for n in names], retain_graph=True, allow_unused=True
            )
            row = [torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)]
            rows.append(torch.cat([g.reshape(-1) for g in row]))
    return torch.stack(rows).reshape(-1, out.shape[-1], len(rows[0]))


def row_chunks(x: Any, size: int | None, dict_key_x: str = "input_ids") -> Iterator[Any]:
    """Consecutive slices of at most ``size`` rows of a batch (all rows if None).

    ``x`` is a tensor, or a mapping whose batch axis is that of ``x[dict_key_x]``: every
    tensor entry with that leading size is sliced, other entries are passed whole.
    """
    n_rows = batch_input(x, dict_key_x).shape[0]
    step = size or max(n_rows, 1)
    for start in range(0, n_rows, step):
        if not isinstance(x, Mapping):
            yield x[start : start + step]
            continue
        yield {
            key: value[start : start + step]
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == n_rows
            else value
            for key, value in x.items()
        }
