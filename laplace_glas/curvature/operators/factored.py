"""The mean-loss GGN in factored form: per-example Jacobians as per-layer outer products.

For an ``nn.Linear`` layer ``z = W a + b`` (applied over any leading positions ``t``)
the Jacobian of the network output row ``r`` of example ``n`` with respect to ``W`` is a
sum of outer products,

.. math::

    \\frac{\\partial f_{nr}}{\\partial W} = \\sum_t g_{nrt}\\, a_{nt}^\\top ,
    \\qquad g_{nrt} = \\frac{\\partial f_{nr}}{\\partial z_{nt}} .

One forward pass with hooks keeps the layer inputs ``a``; one batched backward pass
(``torch.autograd.grad(..., is_grads_batched=True)``) over the ``R`` rows of
``Lambda_n^{1/2}`` gives the output-side factors ``g``. With them,

.. math::

    S = \\frac{1}{\\sqrt N} \\begin{bmatrix} \\vdots \\\\ \\Lambda_n^{1/2} J_n \\\\
    \\vdots \\end{bmatrix} \\in \\mathbb{R}^{NR \\times D},
    \\qquad G_1 = S^\\top S = \\frac1N \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n ,

and a product ``G_1 V = S^T (S V)`` costs one pair of GEMMs per layer (about
``4 N T D`` flops per column) and no further pass through the network. ``Lambda_n^{1/2}``
is the identity for regression (unit noise) and, for softmax cross-entropy, the ``C - 1``
rows ``Q^T diag(sqrt p)`` (``Q``: a Householder basis of the complement of ``sqrt p``;
one row fewer than ``diag(sqrt p)(I - 1 p^T)``), one block per position of a sequence
output, zero for ``ignore_index`` targets.

Supported parameters: the weight and bias of ``nn.Linear`` (any leading dimensions),
``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``, zero padding; patches via ``unfold``; the
bias is the weight of a constant input 1, so it adds no factor of its own), the
elementwise affine parameters of ``nn.LayerNorm`` and of ``nn.BatchNorm1d/2d`` in eval
mode with running statistics (their Jacobians are stored explicitly, ``N R d`` numbers),
and ``nn.Embedding`` (one-hot input side: gather / ``index_add``). Any other trainable
parameter, a custom ``loss_fn``, factors above the budget or a layer called without
gradients: :func:`build_factored_ggn` returns the reason, and the planner moves on. A
forward-mode check of the first batch (``S v`` against ``Lambda^{1/2} J v``) catches a
weight also used outside its module and a batch axis that is not the first.

Memory: the factors hold ``N * sum_l T_l (d_in,l + R d_out,l)`` numbers for the weight
layers plus ``N R d`` for the explicit parameters (the activations times ``R``), built
while below ``budget_bytes`` (the planner's, from ``memory_budget``, checked against the
first batch's projection; a direct call: :func:`default_factor_budget`). A product
with ``m`` columns needs ``m N T d_out`` more per layer, in column chunks of at most
``FactoredGGN.chunk_elements`` numbers (the planner sets it from the budget;
``CHUNK_ELEMENTS`` by default) and, for speed, of at most ``2^22`` numbers where one
column takes fewer. Joining the batches' factors holds one layer's twice, not all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import jvp

from laplace_glas.autodiff.functional import module_call
from laplace_glas.curvature.data.batches import batch_copy, batch_size, split_batch_to
from laplace_glas.curvature.data.output_hessian import PosteriorAveragedHessian
from laplace_glas.curvature.memory.budget import OverBudget, format_bytes, return_freed_memory
from laplace_glas.curvature.operators.factor_join import (
    assemble_factors,
    concatenate_batches,
    factor_bytes,
    layer_factor_bytes,
    widest_product_columns,
)
from laplace_glas.curvature.operators.factors import (
    CONV_LAYERS,
    FACTORED_LAYERS,
    EmbeddingFactor,
    ExplicitFactor,
    ForwardRecorder,
    NotFactorable,
    OuterFactor,
    batch_factors,
    factor_jacobian,
    owning_modules,
    parameter_offsets,
)
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES, TorchOperator
from laplace_glas.progress import progress

__all__ = [
    "CHUNK_ELEMENTS",
    "EmbeddingFactor",
    "ExplicitFactor",
    "FactorSizes",
    "FactoredGGN",
    "OuterFactor",
    "build_factored_ggn",
    "check_first_batch",
    "default_factor_budget",
    "factored_jacobian",
    "factored_jacobian_directions",
    "unsupported_reason",
]

CHUNK_ELEMENTS = 2**25  # temporaries a product may take by default: 128 MiB in float32
_FAST_CHUNK_ELEMENTS = 2**22  # a column chunk's temporaries at most (larger ones were slower)
_PREDICTIVE_BUDGET = 2**29  # factors of one prediction batch: 512 MiB


def default_factor_budget(k: int, n_params: int, itemsize: int) -> int:
    """Bytes the factors may take where no budget is given (a direct call of
    :func:`build_factored_ggn`): ``max(2 GiB, 4 k D itemsize)``. A fit takes its budget
    from ``memory_budget`` instead (:mod:`~laplace_glas.curvature.memory.planner`).
    """
    return max(2 * 2**30, 4 * k * n_params * itemsize)


@dataclass(frozen=True)
class FactorSizes:
    """The factors of the first batch, for the planner's projection to the loader.

    Attributes
    ----------
    batch_bytes : int
        Bytes of the first batch's factors.
    layer_bytes : int
        Bytes of its largest layer's factors.
    widest : int
        Its largest ``B T d_out`` (numbers per column of a product's GEMM).
    rows : int
        ``B R``, its rows of ``S``.
    n_batches : int or None
        Batches in the loader (``None`` without a length).
    rows_per_example : int
        ``R``, the rows of ``Lambda^{1/2}`` per example.

    """

    batch_bytes: int
    layer_bytes: int
    widest: int
    rows: int
    n_batches: int | None
    rows_per_example: int = 1


# ---------------------------------------------------------------------- operator
class FactoredGGN(TorchOperator):
    """``G_1 = S^T S`` from per-layer factors, as a SciPy operator (and in torch).

    Parameters
    ----------
    factors : sequence
        :class:`OuterFactor`, :class:`EmbeddingFactor` and :class:`ExplicitFactor`
        blocks covering all ``D`` parameters once.
    n_params : int
        ``D``.
    n_rows : int
        ``R``, rows of ``Lambda^{1/2} J_n`` per example.

    Notes
    -----
    ``matmat_torch(V)`` returns ``G_1 V`` for ``V (D, m)`` in the factors' dtype and
    device; the SciPy interface converts to and from NumPy. ``apply_S`` and
    ``apply_transpose`` expose ``S X^T`` and ``S^T Y`` for the dual (Gram) solve.

    """

    def __init__(self, factors: Sequence, n_params: int, n_rows: int):
        ref = next(f.g if hasattr(f, "g") else f.J for f in factors)
        super().__init__(dtype=NUMPY_DTYPES[ref.dtype], shape=(n_params, n_params))
        self.factors = list(factors)
        self.n_rows = int(n_rows)
        self.n_examples = int(ref.shape[0])
        self.torch_dtype = ref.dtype
        self.device = ref.device
        self.n_products = 0
        self.chunk_elements = CHUNK_ELEMENTS  # temporaries of one product chunk

    @property
    def column_cost(self) -> int:
        """Flops of one product column ``G_1 v``."""
        return sum(f.cost() for f in self.factors)

    @functools.cached_property
    def widest(self) -> int:
        """The widest layer's GEMM temporaries of one column (``B T d_out`` numbers; the
        factors are fixed at construction, so it is computed once).
        """
        return max(
            (
                f.a.shape[0] * f.a.shape[1] * f.shape[0]
                for f in self.factors
                if isinstance(f, OuterFactor)
            ),
            default=1,
        )

    def product_elements(self) -> int:
        """Numbers a product's column chunk holds at most:
        ``min(chunk_elements, max(2^22, widest))`` (the allowance caps the chunk; beyond
        2^22 numbers larger chunks were slower: c1-k50's 50 eigenvectors took 146 ms in
        chunks of 6 columns, 201 ms in one).
        """
        return min(self.chunk_elements, max(_FAST_CHUNK_ELEMENTS, self.widest))

    def _chunk(self, m: int) -> int:
        return max(1, min(m, self.product_elements() // max(self.widest, 1)))

    def apply_S(self, X: torch.Tensor) -> torch.Tensor:
        """``(m, N, R)``: row ``i`` is ``S x_i`` for ``X (m, D)``."""
        chunk = self._chunk(X.shape[0])
        parts = []
        for start in range(0, X.shape[0], chunk):
            Xc = X[start : start + chunk]
            parts.append(sum(f.apply(Xc) for f in self.factors))
        return torch.cat(parts)

    def apply_transpose(self, Y: torch.Tensor) -> torch.Tensor:
        """``(m, D)``: row ``i`` is ``S^T y_i`` for ``Y (m, N, R)``."""
        out = torch.zeros(Y.shape[0], self.shape[0], dtype=Y.dtype, device=Y.device)
        chunk = self._chunk(Y.shape[0])
        for start in range(0, Y.shape[0], chunk):
            for f in self.factors:
                f.apply_transpose(Y[start : start + chunk], out[start : start + chunk])
        return out

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``G_1 V`` for ``V (D, m)``."""
        X = V.to(device=self.device, dtype=self.torch_dtype).T.contiguous()
        self.n_products += X.shape[0]
        return self.apply_transpose(self.apply_S(X)).T


# ---------------------------------------------------------------------- support
def _module_issue(module: nn.Module) -> str | None:
    if not isinstance(module, FACTORED_LAYERS):
        return f"{type(module).__name__} parameters"
    if isinstance(module, CONV_LAYERS):
        if module.groups != 1:
            return f"{type(module).__name__} with groups={module.groups}"
        if module.padding_mode != "zeros":
            return f"{type(module).__name__} with padding_mode={module.padding_mode!r}"
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if module.training or not module.track_running_stats or module.running_mean is None:
            return "BatchNorm outside eval mode with running statistics"
    if isinstance(module, nn.Embedding) and (
        module.max_norm is not None or module.scale_grad_by_freq
    ):
        return "nn.Embedding with max_norm or scale_grad_by_freq"
    return None


def unsupported_reason(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    likelihood: str,
    loss_fn: nn.Module | None = None,
) -> str | None:
    """Why the factored operator cannot serve this model (``None`` if it can).

    Checks the loss and that every parameter in ``params`` is the weight or bias of a
    supported layer; what the layer list cannot see is checked numerically while the
    factors are built.
    """
    if loss_fn is not None:
        return "a custom loss_fn"
    if likelihood not in ("regression", "classification"):
        return f"likelihood {likelihood!r}"
    owners = owning_modules(model)
    for p in params:
        if id(p) not in owners:
            return "a parameter that is not one of the model's"
        name, module, attr = owners[id(p)]
        issue = _module_issue(module)
        if issue is not None:
            return f"{issue} ({name})"
        if attr not in ("weight", "bias"):
            return f"parameter {name}"
    return None


def check_first_batch(model, params, names, X, out, rows, factors, n_params, dtype) -> None:
    """``S v`` from the factors against ``Lambda^{1/2} J v`` by forward mode."""
    gen = torch.Generator().manual_seed(1234)
    v = torch.randn(n_params, generator=gen, dtype=torch.float64).to(dtype=dtype, device=out.device)
    owners = owning_modules(model)
    tangents, start = [], 0
    for p in params:
        t = v[start : start + p.numel()].view_as(p).clone()
        module = owners[id(p)][1]
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            t[module.padding_idx] = 0  # backward mode leaves the padding row out; so do we
        tangents.append(t)
        start += p.numel()
    v = torch.cat([t.reshape(-1) for t in tangents])
    base = {n: p.detach() for n, p in model.named_parameters()}

    def f(*ps):
        return module_call(model, {**base, **dict(zip(names, ps))}, (X,))

    try:  # an autograd.Function that torch.func cannot transform: refused
        with torch.no_grad():
            _, Jv = jvp(f, tuple(p.detach() for p in params), tuple(tangents))
    except RuntimeError as err:
        raise NotFactorable(f"forward mode fails on the first batch ({err!s:.100})") from err
    reference = torch.einsum("rb...,b...->br", rows, Jv)
    op = FactoredGGN(factors, n_params, rows.shape[0])
    ours = op.apply_S(v.unsqueeze(0))[0]
    err = torch.linalg.vector_norm(ours - reference) / torch.linalg.vector_norm(
        reference
    ).clamp_min(torch.finfo(dtype).tiny)
    if not err <= 10 * torch.finfo(dtype).eps ** 0.5:
        raise NotFactorable(
            f"the factored Jacobian of the first batch differs from forward mode (rel. {err:.1e}):"
            " a weight used outside its layer, or a batch axis that is not the first"
        )


def build_factored_ggn(
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
    budget_bytes: int | None = None,
    loss_fn: nn.Module | None = None,
    progress_bar: bool = False,
    first_batch_check: Callable[[FactorSizes], str | None] | None = None,
    output_hessian: PosteriorAveragedHessian | None = None,
) -> FactoredGGN | str:
    """One pass over ``loader``: the factored unit-noise mean-loss GGN, or why not.

    Parameters
    ----------
    model, params : nn.Module, sequence of tensors
        The network (in eval mode) and the trainable parameters, in the order of the
        ``D``-vector (laplace-torch's ``la.params``).
    loader : iterable
        ``(X, y)`` batches or mappings (the target under ``dict_key_y``).
    likelihood : {'regression', 'classification'}
        Unit-noise Gaussian (``Lambda = I``) or softmax cross-entropy.
    n_terms : int
        ``N``, the number of likelihood terms (points, or tokens that are not
        ``ignore_index``) the GGN averages over.
    ignore_index : int
        Classification targets left out (their rows of ``Lambda^{1/2}`` are zero).
    dict_key_x, dict_key_y : str
        Keys of the input (for the batch size) and target of mapping batches.
    device : torch.device or str
        Where the batches go (the model's device).
    budget_bytes : int, optional
        Largest size of the factors (default ``2 GiB``); above it, the reason is
        returned and the caller falls back to curvlinops.
    loss_fn : nn.Module, optional
        A custom loss is not factored (the reason is returned).
    progress_bar : bool
        Show a ``tqdm`` bar over the batches.
    first_batch_check : callable, optional
        Called with the first batch's :class:`FactorSizes`; a returned reason stops
        the pass and is returned (the planner's projection to its budget).
    output_hessian : PosteriorAveragedHessian, optional
        The rows of ``Lambda_n^{1/2}`` (default: the softmax Hessian at the outputs,
        :func:`~laplace_glas.curvature.operators.factors.row_vectors`).

    Returns
    -------
    FactoredGGN or str
        The operator of ``G_1 = (1/N) sum_n J_n^T Lambda_n J_n``, or a sentence saying
        why the model does not qualify.

    """
    reason = unsupported_reason(model, params, likelihood, loss_fn)
    if reason is not None:
        return reason
    params = list(params)
    offsets, names, n_params = parameter_offsets(model, params)
    budget = default_factor_budget(1, n_params, 4) if budget_bytes is None else budget_bytes
    scale = float(n_terms) ** -0.5
    recorder = ForwardRecorder(offsets)
    all_layers: dict[nn.Module, list] = {}
    all_explicit: list = []
    used, R = 0, None
    try:
        batches = progress(loader, "[GLAS] factored GGN", progress_bar)
        for i, data in enumerate(batches):
            X, y = split_batch_to(data, device, dict_key_y)
            X = batch_copy(X)  # the first layer's factor is X: not the loader's own tensor
            out, rows, layers, explicit, R = batch_factors(
                model,
                recorder,
                X,
                y,
                likelihood,
                ignore_index,
                scale,
                offsets,
                dict_key_x,
                output_hessian,
            )
            if i == 0:
                recorder.remove()
                try:
                    check_first_batch(
                        model,
                        params,
                        names,
                        X,
                        out,
                        rows,
                        assemble_factors(layers, explicit),
                        n_params,
                        out.dtype,
                    )
                finally:
                    recorder = ForwardRecorder(offsets)
            used += factor_bytes(layers, explicit)
            if i == 0 and first_batch_check is not None:
                reason = first_batch_check(_sizes(loader, layers, explicit, out, R))
                if reason is not None:
                    return reason
            if used > budget:
                return OverBudget(
                    f"factors above the memory budget ({format_bytes(budget)}) for the "
                    "factored operator"
                )
            for module, calls in layers.items():
                all_layers.setdefault(module, []).append(calls)
            all_explicit.append(explicit)
    except NotFactorable as err:
        return str(err)
    finally:
        recorder.remove()
    if R is None:
        return "an empty loader"
    return_freed_memory()  # the batches' temporaries, before the join
    return FactoredGGN(
        concatenate_batches(all_layers, all_explicit, return_freed_memory), n_params, R
    )


def _sizes(loader: Iterable, layers: dict, explicit: list, out: torch.Tensor, R: int):
    """The first batch's :class:`FactorSizes`."""
    try:
        n_batches = len(loader)
    except TypeError:
        n_batches = None
    largest = max([layer_factor_bytes(calls) for calls in layers.values()], default=0)
    largest = max([largest, *(J.numel() * J.element_size() for _, J in explicit)])
    rows = out.shape[0] * R
    sizes = (
        factor_bytes(layers, explicit),
        largest,
        widest_product_columns(layers),
        rows,
        n_batches,
        R,
    )
    return FactorSizes(*sizes)


def _one_batch_factors(
    model: nn.Module, params: Sequence[torch.Tensor], x: Any, dict_key_x: str, budget_bytes: int
) -> tuple[torch.Tensor, list, int, int] | str:
    """``(f(x), factors, D, R)`` of one input batch with the regression rows
    (``Lambda = I``, scale 1, so ``S = J``), checked against forward mode, or why not.
    """
    reason = unsupported_reason(model, params, "regression")
    if reason is not None:
        return reason
    params = list(params)
    offsets, names, start = parameter_offsets(model, params)
    recorder = ForwardRecorder(offsets)
    try:
        B = batch_size(x, dict_key_x)
        y = torch.zeros(B)  # unused by the regression rows
        out, rows, layers, explicit, R = batch_factors(
            model, recorder, x, y, "regression", -100, 1.0, offsets, dict_key_x
        )
        recorder.remove()
        if factor_bytes(layers, explicit) > budget_bytes:
            return f"factors above the predictive's budget ({format_bytes(budget_bytes)})"
        factors = assemble_factors(layers, explicit)
        check_first_batch(model, params, names, x, out, rows, factors, start, out.dtype)
    except NotFactorable as err:
        return str(err)
    finally:
        recorder.remove()
    return out, factors, start, R


def factored_jacobian_directions(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    x: torch.Tensor | dict,
    directions: torch.Tensor,
    *,
    dict_key_x: str = "input_ids",
    budget_bytes: int = _PREDICTIVE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``f(x)`` and ``J(x) V`` from the factors of one batch, or why not.

    The 'glm' predictive's ``J(x) U`` at the model's current weights: one forward pass
    with hooks and one batched backward pass over the ``R`` output rows give the
    per-example Jacobian in factored form (:class:`FactoredGGN` with ``Lambda = I``,
    ``N = 1``, so ``S = J``); then ``J(x) V = S V`` is one pair of GEMMs per layer
    instead of ``k`` forward-mode JVPs, each a pass through the network. The same
    forward-mode check as for the fit guards the factorisation. Factors above
    ``budget_bytes`` (default 512 MiB; ``B R`` times the activations) are not built.

    Parameters
    ----------
    model, params : nn.Module, sequence of tensors
        The network in eval mode at the weights to linearise at, and the parameters
        in the order of ``V``'s rows.
    x : torch.Tensor or mapping
        One input batch (on the model's device).
    directions : torch.Tensor
        ``(D, k)`` directions ``V``.
    dict_key_x : str
        Key of the input in mapping batches (for the batch size).
    budget_bytes : int
        Largest size of the factors.

    Returns
    -------
    (f, JV) or str
        ``f`` of shape ``(batch, *out)`` and ``JV`` of shape ``(batch, *out, k)``, or a
        sentence saying why the model does not qualify (the caller then uses JVPs).

    """
    built = _one_batch_factors(model, params, x, dict_key_x, budget_bytes)
    if isinstance(built, str):
        return built
    out, factors, start, R = built
    S = FactoredGGN(factors, start, R)
    JV = S.apply_S(directions.T.to(dtype=out.dtype).contiguous())  # (k, B, R)
    return out, JV.permute(1, 2, 0).reshape(*out.shape, directions.shape[1])


def factored_jacobian(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    x: torch.Tensor | dict,
    *,
    dict_key_x: str = "input_ids",
    budget_bytes: int = _PREDICTIVE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``f(x)`` and the Jacobian ``J(x)`` ``(batch, *out, D)`` formed from the factors of
    one batch, or why not.

    The Jacobian the 'glm' predictive's ``J B J^T`` needs (the prior's or KFAC's
    complement): one forward pass with hooks, one batched backward pass over the
    ``R`` output rows (:func:`factored_jacobian_directions`' factors), then
    ``J = sum_t g_t a_t^T`` per layer
    (:func:`~laplace_glas.curvature.operators.factors.factor_jacobian`), where reverse
    mode over the weights (``torch.func.jacrev``) differentiates every weight once per
    output row. Same arguments and refusals as :func:`factored_jacobian_directions`.
    """
    built = _one_batch_factors(model, params, x, dict_key_x, budget_bytes)
    if isinstance(built, str):
        return built
    out, factors, start, R = built
    J = factor_jacobian(factors, out.shape[0], R, start, out.dtype, out.device)
    return out, J.reshape(*out.shape, start)
