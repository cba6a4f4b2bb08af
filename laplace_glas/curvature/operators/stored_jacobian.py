"""The mean-loss GGN from explicitly stored per-example Jacobians.

Where ``N R D`` numbers fit the memory budget (LoRA adapters, a last layer, a
subnetwork, a small model), the rows of ``Lambda_n^{1/2} J_n`` are stored as one dense
matrix,

.. math::

    S = \\frac{1}{\\sqrt N} \\begin{bmatrix} \\vdots \\\\ \\Lambda_n^{1/2} J_n \\\\
    \\vdots \\end{bmatrix} \\in \\mathbb{R}^{NR \\times D},
    \\qquad G_1 = S^\\top S = \\frac1N \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

with the same ``Lambda_n^{1/2}`` as the factored operator
(:mod:`~laplace_glas.curvature.operators.factored`: the identity for unit-noise
regression, ``C - 1`` rows per position for softmax cross-entropy, zero rows for
``ignore_index`` targets). A product ``G_1 V = S^T (S V)`` is two GEMMs (``4 N R D``
flops per column), and the dual (Gram) solve
(:mod:`~laplace_glas.curvature.solvers.gram`) forms ``K = S S^T`` with one ``syrk``.

The Jacobians are built one batch at a time:

* for models the factored operator covers, from that batch's per-layer factors (one
  forward pass with hooks, one batched backward pass over the ``R`` rows): a weight's
  rows are ``sum_t g_{nrt} a_{nt}^T``, contracted over the positions ``t`` at once; the
  factors of the batch are dropped afterwards, so for sequence inputs (``T`` positions
  per example) the operator keeps ``N R D`` numbers instead of the factors'
  ``N T sum_l (d_in + R d_out)`` (GPT-2 LoRA over 32 tokens, 4 classes: 3.8x less);
* otherwise with ``torch.func``: ``vmap`` over the examples of ``jacrev`` of the
  functional model in the trainable parameters (models whose forward cannot be
  ``vmap``-ed over single examples, e.g. with data-dependent control flow, are not
  covered; :func:`build_jacobian_ggn` returns the reason).

The first batch is checked against forward mode (``S v`` against ``Lambda^{1/2} J v``
from ``torch.func.jvp``). Memory: ``N R D itemsize`` bytes
(:func:`~laplace_glas.curvature.operators.jacobian_estimates.jacobian_bytes`)
plus one batch's build (its factors and rows, or its full Jacobians and rows); the
previous batch's are let go before the next is built. The build stops, returning the
reason, once the Jacobians pass ``budget_bytes``, or before the first backward pass
when one forward pass of the first batch shows that they would take more than the
factors (then the factored operator is the leaner choice).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import jacrev, vmap

from laplace_glas.autodiff.functional import module_call
from laplace_glas.curvature.data.batches import batch_size, split_batch_to
from laplace_glas.curvature.data.example_counts import survey_batch_sizes
from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian
from laplace_glas.curvature.memory.budget import format_bytes
from laplace_glas.curvature.operators.factor_join import (
    assemble_factors,
)
from laplace_glas.curvature.operators.factored import (
    FactoredGGN,
    check_first_batch,
    unsupported_reason,
)
from laplace_glas.curvature.operators.factors import (
    ExplicitFactor,
    ForwardRecorder,
    NotFactorable,
    batch_factors,
    factor_jacobian,
    loss_hessian_rows,
    parameter_offsets,
)
from laplace_glas.progress import progress
from laplace_glas.validation import check_model_output

__all__ = [
    "DenseFactor",
    "JacobianGGN",
    "build_jacobian_ggn",
]


class DenseFactor(ExplicitFactor):
    """All ``D`` columns of ``S`` as one dense ``(N, R, D)`` tensor ``J`` (an
    :class:`~laplace_glas.curvature.operators.factors.ExplicitFactor` over
    ``index = 0..D-1``, without its gather and scatter).
    """

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)`` rows of ``S x`` for ``X (m, D)``."""
        N, R, D = self.J.shape
        return (X @ self.J.reshape(N * R, D).T).reshape(-1, N, R)

    def apply_transpose(self, Y: torch.Tensor, out: torch.Tensor) -> None:
        """Add ``S^T y`` to ``out (m, D)`` for ``Y (m, N, R)``."""
        N, R, D = self.J.shape
        out.addmm_(Y.reshape(-1, N * R), self.J.reshape(N * R, D))


class JacobianGGN(FactoredGGN):
    """``G_1 = S^T S`` with ``S`` stored explicitly: a
    :class:`~laplace_glas.curvature.operators.factored.FactoredGGN` of one
    :class:`DenseFactor`, so Lanczos, the block solver and the dual solve serve it.

    Parameters
    ----------
    J : torch.Tensor
        ``(N, R, D)``: row ``r`` of example ``n`` is row ``r`` of
        ``Lambda_n^{1/2} J_n / sqrt(N)``.

    """

    def __init__(self, J: torch.Tensor):
        R, D = J.shape[1:]
        index = torch.arange(D, device=J.device)
        super().__init__([DenseFactor(index, J)], D, R)

    @property
    def J(self) -> torch.Tensor:
        """The stored ``(N, R, D)`` rows of ``S``."""
        return self.factors[0].J


# ---------------------------------------------------------------------- from factors
def _larger_than_factors(model, recorder, X, likelihood: str, n_params: int) -> str | None:
    """Why not, when one batch's Jacobian rows (``B R D``) would take more memory than
    the factored operator's factors of it (``sum_calls B T (d_in + R_f d_out)``, read off
    the hooked layers' inputs and outputs in one forward pass without gradients).
    """
    recorder.reset()
    with torch.no_grad():
        out = check_model_output(model(X))
    C = out.shape[-1]
    rows_f = out[0].numel()  # the factored operator's rows: P C
    rows_j = rows_f if likelihood == "regression" or C < 2 else rows_f // C * (C - 1)
    factors = sum(
        x.numel() + rows_f * z.numel() for calls in recorder.calls.values() for x, z in calls
    )
    recorder.reset()
    jacobians = out.shape[0] * rows_j * n_params
    if jacobians <= factors:
        return None
    size = out.element_size()
    return (
        f"explicit Jacobians larger than the factors ({format_bytes(jacobians * size)} "
        f"against {format_bytes(factors * size)} per batch)"
    )


def _factored_batches(model, params, loader, likelihood, n_terms, options):
    """Per-batch ``(B, R, D)`` Jacobian rows from the factors; yields strings to stop."""
    offsets, names, n_params = parameter_offsets(model, list(params))
    scale = float(n_terms) ** -0.5
    recorder = ForwardRecorder(offsets)
    first = options["first"]  # the loader's first item where known: checked before a pass
    try:
        if first is not None:
            X = split_batch_to(first, options["device"], options["dict_key_y"])[0]
            reason = _larger_than_factors(model, recorder, X, likelihood, n_params)
            if reason is not None:
                yield reason
                return
        for i, data in enumerate(progress(loader, "[GLAS] Jacobians", options["progress_bar"])):
            X, y = split_batch_to(data, options["device"], options["dict_key_y"])
            if i == 0 and first is None:
                reason = _larger_than_factors(model, recorder, X, likelihood, n_params)
                if reason is not None:
                    yield reason
                    return
            out, rows, layers, explicit, R = batch_factors(
                model,
                recorder,
                X,
                y,
                likelihood,
                options["ignore_index"],
                scale,
                offsets,
                options["dict_key_x"],
                options["output_hessian"],
            )
            factors = assemble_factors(layers, explicit)
            B = out.shape[0]
            if i == 0:
                recorder.remove()
                try:
                    check_first_batch(
                        model, params, names, X, out, rows, factors, n_params, out.dtype
                    )
                finally:
                    recorder = ForwardRecorder(offsets)
            del layers, explicit
            yield factor_jacobian(factors, B, R, n_params, out.dtype, out.device)
            del factors, out, rows  # not held beside the next batch's build
    finally:
        recorder.remove()


# ---------------------------------------------------------------------- torch.func
def _func_batches(model, params, loader, likelihood, n_terms, options):
    """Per-batch Jacobian rows by ``vmap(jacrev)`` over the examples."""
    names = {id(p): n for n, p in model.named_parameters()}
    if any(id(p) not in names for p in params):
        yield "a parameter that is not one of the model's"
        return
    keys = [names[id(p)] for p in params]
    base = {n: p.detach() for n, p in model.named_parameters()}
    base.update({n: b for n, b in model.named_buffers()})
    scale = float(n_terms) ** -0.5

    def single(ps: tuple, x):
        x = {k: v.unsqueeze(0) for k, v in x.items()} if isinstance(x, Mapping) else x[None]
        out = module_call(model, {**base, **dict(zip(keys, ps))}, (x,))
        return check_model_output(out)[0]

    jacobian = vmap(jacrev(single), in_dims=(None, 0))
    if options["first"] is not None:  # a model vmap cannot batch: refused before a pass
        X = split_batch_to(options["first"], options["device"], options["dict_key_y"])[0]
        try:
            jacobian(tuple(p.detach() for p in params), _first_example(X))
        except Exception as err:
            yield f"torch.func.vmap over the examples failed ({type(err).__name__})"
            return
    for i, data in enumerate(progress(loader, "[GLAS] Jacobians", options["progress_bar"])):
        X, y = split_batch_to(data, options["device"], options["dict_key_y"])
        with torch.no_grad():
            out = check_model_output(model(X))
        B = batch_size(X, options["dict_key_x"])
        if out.shape[0] != B:
            yield f"model outputs whose first axis ({out.shape[0]}) is not the batch ({B})"
            return
        try:
            jac = jacobian(tuple(p.detach() for p in params), X)
        except Exception as err:  # vmap cannot batch this model's forward
            yield f"torch.func.vmap over the examples failed ({type(err).__name__})"
            return
        jac = torch.cat([j.reshape(B, out[0].numel(), -1) for j in jac], -1)  # (B, O, D)
        rows = loss_hessian_rows(
            X, out, y, likelihood, options["ignore_index"], scale, options["output_hessian"]
        )
        J = torch.einsum("rbo,bod->brd", rows.reshape(rows.shape[0], B, -1), jac)
        del jac
        if i == 0:  # examples that interact (a batch statistic) break the per-example vmap
            factor = DenseFactor(torch.arange(J.shape[-1], device=J.device), J)
            check_first_batch(model, params, keys, X, out, rows, [factor], J.shape[-1], J.dtype)
            del factor
        yield J
        del J, out, rows  # not held beside the next batch's build


def _first_example(X: torch.Tensor | Mapping) -> torch.Tensor | Mapping:
    """The first example of a batch's inputs (a mapping's 0-dim entries as they are)."""
    if isinstance(X, Mapping):
        return {k: _first_example(v) for k, v in X.items()}
    return X[:1] if isinstance(X, torch.Tensor) and X.ndim else X


# ---------------------------------------------------------------------- build
def build_jacobian_ggn(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    loader: Iterable,
    likelihood: str,
    n_terms: int,
    *,
    ignore_index: int = -100,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    device: torch.device | str = "cpu",
    budget_bytes: int = 2 * 2**30,
    loss_fn: nn.Module | None = None,
    progress_bar: bool = False,
    n_examples: int | None = None,
    first_batch: Any = None,
    output_hessian: PosteriorAveragedHessian | None = None,
) -> JacobianGGN | str:
    """One pass over ``loader``: the unit-noise mean-loss GGN from stored Jacobians, or
    why not.

    Parameters
    ----------
    model, params : nn.Module, sequence of tensors
        The network (in eval mode) and the trainable parameters, in the order of the
        ``D``-vector.
    loader : iterable
        ``(X, y)`` batches or mappings (the target under ``dict_key_y``).
    likelihood : {'regression', 'classification'}
        Unit-noise Gaussian (``Lambda = I``) or softmax cross-entropy.
    n_terms : int
        ``N``, the likelihood terms the GGN averages over.
    ignore_index : int
        Classification targets left out (zero rows).
    dict_key_x, dict_key_y : str
        Keys of the input (batch size) and the target of mapping batches.
    device : torch.device or str
        Where the batches go (the model's device).
    budget_bytes : int
        Largest size of the stored Jacobians; above it the reason is returned.
    loss_fn : nn.Module, optional
        A custom loss is not covered (the reason is returned).
    progress_bar : bool
        Show a ``tqdm`` bar over the batches.
    n_examples : int, optional
        The loader's examples where the caller has surveyed them (the planner); else
        surveyed here where they are known before the pass.
    first_batch : any, optional
        The loader's first item where the caller has it (the planner): the check
        whether one batch's Jacobians outweigh its factors (the factored route) or
        whether ``vmap`` batches the model (on its first example; the ``torch.func``
        route) runs on it, so that a build refused for that starts no iterator of the
        loader.
    output_hessian : PosteriorAveragedHessian, optional
        The rows of ``Lambda_n^{1/2}`` (default: the softmax Hessian at the outputs).

    Returns
    -------
    JacobianGGN or str
        The operator of ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n``, or a sentence saying
        why it was not built.

    """
    if loss_fn is not None:
        return "a custom loss_fn"
    if likelihood not in ("regression", "classification"):
        return f"likelihood {likelihood!r}"
    options = dict(
        ignore_index=ignore_index, dict_key_x=dict_key_x, dict_key_y=dict_key_y, device=device
    )
    # the bar (an iterator) starts with the pass, after the checks on the first batch
    options.update(progress_bar=progress_bar, first=first_batch, output_hessian=output_hessian)
    if unsupported_reason(model, params, likelihood) is None:
        route = _factored_batches(model, params, loader, likelihood, n_terms, options)
    else:
        route = _func_batches(model, params, loader, likelihood, n_terms, options)
    try:
        if n_examples is None:
            n_examples = _examples(loader, dict_key_x, dict_key_y)
        return _collect(route, n_examples, budget_bytes)
    except NotFactorable as err:
        return str(err)
    finally:
        route.close()


def _collect(route, capacity: int | None, budget_bytes: int) -> JacobianGGN | str:
    """Join the batches' Jacobian rows into one ``(N, R, D)`` tensor, written in place
    when the number of examples is known (no second copy), else concatenated.
    """
    buffer, parts, filled, used = None, [], 0, 0
    for J in route:
        if isinstance(J, str):
            return J
        if buffer is None and capacity is not None:  # the buffer holds every batch
            used = max(used + J.numel() * J.element_size(), capacity * J[0].nbytes)
        elif buffer is None or filled + J.shape[0] > capacity:
            used += J.numel() * J.element_size()
        if used > budget_bytes:
            return f"explicit Jacobians above the memory budget ({format_bytes(budget_bytes)})"
        if buffer is None and capacity is not None and capacity >= J.shape[0]:
            buffer = J.new_empty(capacity, *J.shape[1:])
        if buffer is not None and J.shape[1:] != buffer.shape[1:]:
            return "a number of output rows that changes between batches"
        if buffer is not None and filled + J.shape[0] <= capacity:
            buffer[filled : filled + J.shape[0]] = J
            filled += J.shape[0]
        else:
            parts.append(J)
        del J  # the batch's rows are in the buffer: not held beside the next batch's build
    if buffer is None and not parts:
        return "an empty loader"
    if buffer is not None:
        parts.insert(0, buffer[:filled])
    if len({J.shape[1:] for J in parts}) > 1:
        return "a number of output rows that changes between batches"
    J = parts[0] if len(parts) == 1 else torch.cat(parts)
    return JacobianGGN(J)


def _examples(loader: Iterable, dict_key_x: str, dict_key_y: str) -> int | None:
    """The number of examples of ``loader`` where it is known before the pass (a
    ``DataLoader`` over a sized dataset, a list of batches, ... : see
    :func:`~laplace_glas.curvature.data.example_counts.survey_batch_sizes`), else None.

    Known, the rows are written into one buffer as they come; unknown, the batches' rows
    are concatenated at the end, beside themselves (a list of batches was: 2.2 GiB
    measured for 0.9 GiB of rows).
    """
    sizes = survey_batch_sizes(loader, dict_key_x, dict_key_y)
    return None if sizes is None else sizes.examples
