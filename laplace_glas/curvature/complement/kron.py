"""The Kronecker-factored summed GGN (KFAC), for the curvature-aware complement
(``complement='kron'``).

Per layer with weight ``W`` (``d_out x d_in``, flattened row-major) and bias ``b``:

.. math::

    K_W = B \\otimes A, \\qquad K_b = B, \\qquad
    A = \\frac1N \\sum_{n=1}^N a_n a_n^\\top, \\qquad
    B = \\sum_{n=1}^N \\sum_{c} g_{n,c} \\, g_{n,c}^\\top,

with ``a_n`` the layer's input and ``g_{n,c} = (\\partial f_n / \\partial s_n)^\\top
\\Lambda_n^{1/2} e_c`` the output's sensitivity to the layer's pre-activation ``s_n``
(``Lambda_n`` the unit-noise loss Hessian in the outputs: ``I`` for regression,
``diag(p) - p p^T`` for the softmax cross-entropy). This is the exact-GGN ("type-2")
KFAC with the 'expand' convention for weight sharing that laplace-torch's
``KronLaplace`` computes by default (curvlinops' ``KFACLinearOperator``, weights and
biases apart), taken over the whole loader at once: ``K`` approximates the summed GGN
``N G_1``, the convention of the stored eigenvalues ``h_j = N lambda_j(G_1)``. For a
loader of equal-sized batches it equals ``KronLaplace(...).fit(loader)``'s factors.

The result is laplace-torch's :class:`laplace.utils.matrix.Kron` with one block per
trainable parameter tensor, in the order of ``model.parameters()``: ``[B, A]`` for a
weight and ``[B]`` for a bias.

Where a fit's eigen-solve uses the factored operator
(:class:`~laplace_glas.curvature.operators.factored.FactoredGGN`), the same factors
come without a data pass (:func:`factored_kron`): it stores every layer's inputs
``a_{nt}`` (``N x T x d_in``) and output-side factors ``g_{nrt} = \\Lambda_n^{1/2}``-rows
of ``\\partial f_n / \\partial s_{nt}`` over ``sqrt(N)``, so, with ``T_c`` the positions
of one call of the layer (curvlinops' 'expand' convention: a sequence's or an image's
positions are examples of the layer, its input covariance divides by them),

.. math::

    A = \\frac{1}{N T_c} \\sum_{n,t} a_{nt} a_{nt}^\\top, \\qquad
    B = N \\sum_{n,r,t} g_{nrt} \\, g_{nrt}^\\top,

two GEMMs per layer on the stored tensors. :func:`factored_kron_refusal` says, before
the solve, whether the model and the data allow it (every trainable parameter the
weight, or the bias beside a trainable weight, of an ``nn.Linear`` or an
``nn.Conv2d`` with numeric padding; tensor inputs; one class label per input or
regression targets of the output's shape); :func:`factored_kron` then refuses what
only the operator shows (a subsample, padded targets, calls or batches whose
positions differ, another operator), and the caller falls back to :func:`ggn_kron`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from curvlinops import FisherType, KFACLinearOperator
from laplace.utils.matrix import Kron
from torch import nn
from torch.utils.hooks import RemovableHandle

from laplace_glas.curvature.complement.kfac_layers import (
    KFAC_LAYERS,
    blocks_over,
    check_kron_factors,
    kfac_parameters,
    kron_diag_refusal,
    kron_refusal,
)
from laplace_glas.curvature.data.batches import scored_pair, split_batch
from laplace_glas.curvature.data.losses import summed_unit_noise_loss
from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.factors import OuterFactor
from laplace_glas.curvature.parallel.distributed import (
    Shards,
    all_reduce_sum,
    flag_failure,
    sum_count,
)

__all__ = [
    "factored_kron",
    "factored_kron_refusal",
    "ggn_kron",
]


class _BatchError(ValueError):
    """A batch ``complement='kron'`` cannot take (raised as it is, not wrapped)."""


class _ScoredBatches:
    """The loader's ``(X, y)`` batches with padded classification targets left out
    (re-iterable: curvlinops passes over the data three times).
    """

    def __init__(
        self, loader: Iterable, likelihood: str, ignore_index: int, dict_key_y: str
    ) -> None:
        self.loader, self.likelihood = loader, likelihood
        self.ignore_index, self.dict_key_y = ignore_index, dict_key_y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        needs = (
            "complement='kron' needs tensor inputs (its Kronecker factors come from "
            "curvlinops' KFAC)"
        )
        for batch in self.loader:
            X, y = scored_pair(
                batch, self.likelihood, self.ignore_index, self.dict_key_y, needs, _BatchError
            )
            if X is not None:
                yield X, y


def ggn_kron(
    model: nn.Module,
    loader: Iterable,
    likelihood: str,
    *,
    ignore_index: int = -100,
    dict_key_y: str = "labels",
    shards: Shards | None = None,
    progress_bar: bool = False,
    partial: bool = False,
) -> Kron:
    """KFAC of the summed unit-noise GGN over the trainable parameters (see the module).

    With ``partial`` (``complement='kron_diag'``) the factors are those of the layers
    KFAC covers (:func:`kfac_parameters`) that the forward pass calls as modules; every
    other trainable parameter gets an empty block ``[]``, for the GGN diagonal to fill.

    In a data-parallel fit each rank computes its shard's share and the factors are
    summed over the ranks: ``B = sum_r B_r`` and ``A = sum_r A_r`` with each rank's
    ``A_r = sum_{n in shard r} a_n a_n^T / N`` normalised by the total ``N`` (one
    all-reduce of the counts first), which is the single-process ``A`` exactly.

    Parameters
    ----------
    model : torch.nn.Module
        The network at its MAP weights (every trainable parameter in an ``nn.Linear``
        or ``nn.Conv2d``).
    loader : iterable of batches
        ``(X, y)`` tuples with tensor inputs (moved to the parameters' device); in a
        data-parallel fit, this rank's shard.
    likelihood : {'regression', 'classification'}
        The curvature's likelihood.
    ignore_index : int
        Classification targets left out (padding).
    dict_key_y : str
        Key of the targets in mapping batches.
    shards : Shards, optional
        The ranks of a data-parallel fit (the factors are summed over them).
    progress_bar : bool
        Show curvlinops' progress bar over the batches.
    partial : bool
        ``complement='kron_diag'``: the covered layers' factors, ``[]`` for the rest.

    Raises
    ------
    ValueError
        For inputs that are not tensors, per-token targets, and parameters outside the
        layers KFAC covers (named with curvlinops' reason). In a data-parallel fit a
        failure on one rank is raised there and as a ``RuntimeError`` naming it on the
        others.

    """
    refusal = kron_diag_refusal(model) if partial else kron_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    trainable = [p for p in model.parameters() if p.requires_grad]
    covered = set(kfac_parameters(model))
    params = [p for n, p in model.named_parameters() if p.requires_grad and n in covered]
    data = _ScoredBatches(loader, likelihood, ignore_index, dict_key_y)
    if shards is None:
        blocks = _local_factors(model, params, likelihood, data, progress_bar, partial=partial)
        blocks = blocks_over(blocks, params, trainable)
        return Kron(check_kron_factors(blocks, [p.shape for p in trainable], partial=partial))
    device = params[0].device if params else "cpu"
    n_local, error = 0, None
    try:  # a rank whose count or pass fails still takes part in the collectives (flagged)
        n_local = sum(X.shape[0] for X, _ in data)
    except Exception as err:
        error = err
    n_total = sum_count(n_local, shards, device, error=error)
    blocks, error = [], None
    try:
        blocks = _local_factors(
            model, params, likelihood, data, progress_bar, n_total, partial=partial
        )
        blocks = blocks_over(blocks, params, trainable)
        blocks = check_kron_factors(blocks, [p.shape for p in trainable], partial=partial)
    except Exception as err:
        error = err
    step = "computing KFAC's factors of complement='kron'"
    flag_failure(shards, device, error, step, "no rank fits")
    flat = torch.cat([F.reshape(-1) for block in blocks for F in block])
    pieces = iter(all_reduce_sum(flat, shards).split([F.numel() for b in blocks for F in b]))
    return Kron([[next(pieces).view_as(F) for F in block] for block in blocks])


@contextlib.contextmanager
def _hooks_removed_on_failure(model: nn.Module) -> Iterator[None]:
    """Remove the module hooks registered inside the block if it raises.

    curvlinops' KFAC registers forward hooks on the layers and removes them only after
    a complete pass: a pass that raised left them on the model, and the next forward
    pass without gradients raised "cannot register a hook on a tensor that doesn't
    require gradient" (every predictive call after a fit whose ``complement='auto'``
    had moved on from ``'kron'``). The modules' registration methods are shadowed in
    the block to record the handles.
    """
    handles: list[RemovableHandle] = []
    names = ("register_forward_hook", "register_forward_pre_hook")
    modules = list(model.modules())

    def recording(register: Callable) -> Callable:
        def record(*args: Any, **kwargs: Any) -> RemovableHandle:
            handle = register(*args, **kwargs)
            handles.append(handle)
            return handle

        return record

    shadowed: list[tuple[nn.Module, str]] = []
    try:
        for module in modules:
            for name in names:
                setattr(module, name, recording(getattr(module, name)))
                shadowed.append((module, name))
        yield
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    finally:
        for module, name in shadowed:
            delattr(module, name)


def _local_factors(
    model: nn.Module,
    params: list[torch.Tensor],
    likelihood: str,
    data: _ScoredBatches,
    progress_bar: bool,
    num_data: int | None = None,
    partial: bool = False,
) -> list:
    """The ``[B, A]`` / ``[B]`` blocks of curvlinops' KFAC over ``data`` in the order of
    ``params`` (``num_data``: the ``N`` dividing ``A``; None: ``data``'s own count);
    ``partial``: a layer the forward pass never called as a module gets ``[]`` blocks
    instead of an error.
    """
    loss_fn, factor = summed_unit_noise_loss(likelihood)
    # one loss term per example: _ScoredBatches refuses per-token targets
    counts = {} if num_data is None else {"num_data": num_data, "num_per_example_loss_terms": 1}
    try:
        with _hooks_removed_on_failure(model):
            linop = KFACLinearOperator(
                model,
                loss_fn,
                params,
                data,
                progressbar=progress_bar,
                check_deterministic=False,
                fisher_type=FisherType.TYPE2,
                separate_weight_and_bias=True,
                **counts,
            )
            linop.compute_kronecker_factors()
    except _BatchError:
        raise
    except Exception as err:  # curvlinops' refusals come as several exception types
        raise ValueError(
            "complement='kron' needs KFAC's Kronecker factors, which curvlinops cannot "
            f"compute for this model ({type(err).__name__}: {err}); every trainable "
            "parameter must sit in an nn.Linear or nn.Conv2d. Use complement='diag', "
            "'zero' or 'prior'."
        ) from err
    # through curvlinops' public interface: the layer -> parameter-position mapping and
    # the factors of its state dict
    state = linop.state_dict()
    inputs, gradients = state["input_covariances"], state["gradient_covariances"]
    blocks: list[list[torch.Tensor] | None] = [None] * len(params)
    for name, positions in KFACLinearOperator.compute_parameter_mapping(params, model).items():
        if name not in gradients and partial:  # the diagonal takes its parameters
            for position in positions.values():
                blocks[position] = []
            continue
        if name not in gradients:  # curvlinops' hooks never saw the layer run
            raise ValueError(
                f"complement='kron' needs KFAC's factors of layer {name!r}, which the "
                "forward pass never called as a module (its weights used through a "
                "functional call?). Use complement='diag', 'zero' or 'prior'."
            )
        B = _symmetric(gradients[name].detach()) * factor
        for kind, position in positions.items():
            if kind == "weight":
                blocks[position] = [B, _symmetric(inputs[name].detach())]
            else:
                blocks[position] = [B]
    return blocks


def _symmetric(F: torch.Tensor) -> torch.Tensor:
    """``(F + F^T) / 2``: summed outer products, symmetric up to round-off."""
    return (F + F.T) / 2


def _gram(X: torch.Tensor) -> torch.Tensor:
    """``X^T X`` (symmetrised), summed over blocks of the ``M`` rows in float64.

    One float32 GEMM over all rows would round the sum of ``M`` products as a running
    sum (a relative error of ``1.8e-4`` at ``M = 16,000`` for one column). So:

    - a float32 ``X`` with more than 64 columns is summed in blocks of ``~sqrt(M)``
      rows (at least 1,024), each block's product added in float64;
    - a narrower or float64 ``X`` is summed in float64 blocks of
      :data:`GRAM_BLOCK_ROWS` rows (memory-bound, so the wider type costs no time).

    The second case covers a convolution's output-side factor, with ``N R T`` rows (724k
    on the digits CNN of the predictive benchmark, float64). Measured on the 2-core
    development machine:

    - blocks of 1,024 rows, 707 threaded GEMMs: 11-12 ms quiet, 104-694 ms beside two
      busy processes;
    - blocks of 8,192 rows: 7.1-7.4 ms quiet, 25-33 ms beside them.

    No factor shape was slower quiet with the larger blocks.
    """
    wide_float32 = X.dtype != torch.float64 and X.shape[1] > 64
    rows = max(1024, math.isqrt(X.shape[0]) + 1) if wide_float32 else GRAM_BLOCK_ROWS
    total = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64, device=X.device)
    for start in range(0, X.shape[0], rows):
        block = X[start : start + rows]
        block = block if wide_float32 else block.to(torch.float64)
        total += (block.T @ block).to(torch.float64)
    return _symmetric(total).to(X.dtype)


GRAM_BLOCK_ROWS = 8192
"""Rows of a float64 (or narrow float32) factor in one GEMM of ``_gram``."""


def factored_kron_refusal(
    model: nn.Module,
    params: Sequence[torch.Tensor],
    loader: Iterable,
    likelihood: str,
    out_shape: tuple[int, ...],
    dict_key_y: str = "labels",
) -> str | None:
    """Why :func:`factored_kron` cannot serve this fit, as far as the model and the
    first batch show (None: it may, depending on the operator the planner builds).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if {id(p) for p in trainable} != {id(p) for p in params}:
        return "the posterior's parameters are not the model's trainable ones"
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(p.requires_grad for p in own.values()):
            continue
        if not isinstance(module, KFAC_LAYERS):
            return f"a {type(module).__name__} ({name})"
        if isinstance(module, nn.Conv2d) and (
            isinstance(module.padding, str) or module.groups != 1
        ):
            return f"an nn.Conv2d with padding={module.padding!r}, groups={module.groups} ({name})"
        if not module.weight.requires_grad:
            return f"a trainable bias beside a frozen weight ({name})"
    X, y = split_batch(next(iter(loader)), dict_key_y)
    if not isinstance(X, torch.Tensor):
        return f"inputs of type {type(X).__name__}"
    if likelihood == "regression" and tuple(y.shape[1:]) != tuple(out_shape):
        return f"regression targets of shape {tuple(y.shape)} for outputs {tuple(out_shape)}"
    if likelihood != "regression" and y.ndim != 1:
        return f"targets of shape {tuple(y.shape)} (one class label per input)"
    return None


def factored_kron(
    operator: Any,
    model: nn.Module,
    params: Sequence[torch.Tensor],
    n_terms: int,
) -> Kron | str:
    """KFAC's factors of the summed unit-noise GGN from the factored operator's stored
    factors (see the module), equal to :func:`ggn_kron`'s; or why not.

    Parameters
    ----------
    operator : FactoredGGN or other
        The fit's operator, built on all of the loader's ``N`` examples.
    model : torch.nn.Module
        The network (for the order of its trainable parameters).
    params : sequence of torch.Tensor
        The parameters in the order of the operator's ``D``-vector.
    n_terms : int
        ``N``, the likelihood terms the operator averages over (its ``g`` carry
        ``1/sqrt(N)``); it must be the number of stored examples (no target left out).

    Returns
    -------
    Kron or str
        laplace-torch's ``Kron`` (blocks in the order of ``model.parameters()``), or a
        sentence saying why the operator does not give it (the caller runs
        :func:`ggn_kron`).

    """
    if type(operator) is not FactoredGGN:
        return f"the eigen-solve's operator is not the factored one ({type(operator).__name__})"
    if operator.n_examples != n_terms:
        return (
            f"the operator holds {operator.n_examples} examples for {n_terms} likelihood "
            "terms (targets left out, or a subsample)"
        )
    at: dict[int, torch.Tensor] = {}
    start = 0
    for p in params:
        at[start] = p
        start += p.numel()
    blocks: dict[int, list[torch.Tensor]] = {}
    for factor in operator.factors:
        if not isinstance(factor, OuterFactor) or factor.offset not in at:
            return f"a {type(factor).__name__} in the factored operator"
        if factor.positions is None:
            return "a layer whose calls or batches have different numbers of positions"
        d_out, d_in = factor.shape
        N = factor.a.shape[0]
        A = _gram(factor.a.reshape(-1, d_in)) / (N * factor.positions)
        B = _gram(factor.g.reshape(-1, d_out)) * n_terms
        blocks[id(at[factor.offset])] = [B, A]
        if factor.bias_offset is not None:
            blocks[id(at[factor.bias_offset])] = [B]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if set(blocks) != {id(p) for p in trainable}:
        return "the factored operator does not cover exactly the trainable parameters"
    ordered = [blocks[id(p)] for p in trainable]
    # symmetric and of the right sizes by construction (check_kron_factors' symmetry test
    # costs more than the Gram sums on small models); finiteness is the data's to break
    if not all(bool(torch.isfinite(F).all()) for block in ordered for F in block):
        return "the factored operator's KFAC factors hold NaN or inf"
    return Kron(ordered)
