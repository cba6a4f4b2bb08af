"""GGN products from a cached linearisation of the network at the MAP.

The factored operator (:mod:`~laplace_glas.curvature.operators.factored`) covers networks of
Linear, convolution, normalisation and embedding layers with few output rows per
example. Everything else (attention, recurrent layers, one output row per token of a
language model, custom modules) multiplies with the GGN by passes through the
network. curvlinops' operator runs a forward pass, then a Jacobian-vector and a
vector-Jacobian product through it, for every product. The network and its inputs do
not change between the products of one eigen-solve, so this operator runs the forward
pass once per batch and keeps its autograd graph:

.. math::

    G v = c \\sum_b J_b^\\top \\Lambda_b J_b v , \\qquad
    J_b^\\top u = \\frac{\\partial \\langle f_b, u \\rangle}{\\partial \\theta} ,
    \\qquad
    J_b v = \\frac{\\partial \\langle J_b^\\top u, v \\rangle}{\\partial u} ,
    \\qquad
    \\Lambda_b z = \\frac{\\partial \\langle \\nabla_{f} \\ell_b, z \\rangle}{\\partial f} ,

with ``f_b`` the outputs of batch ``b``, ``\\ell_b`` the loss of the batch and ``c``
curvlinops' normalisation (``|b| / num_data`` for ``reduction='mean'``, 1 for
``'sum'``). ``J_b^T u`` is built once with ``create_graph=True``; it is linear in the
dummy ``u``, so differentiating it against ``u`` gives ``J_b v`` (the double-backward
identity) and a product costs two backward passes over kept graphs and no forward
pass (about two forward passes' time against three for curvlinops; on the GPT-2 + LoRA
of ``benchmarks/linearized_cost.py`` single products 1.1-3.5x and Lanczos fits 1.5-3.5x
faster than curvlinops', at 0.61-0.68x its peak memory, 6 December 2026). The loss
Hessian ``Lambda_b`` comes from the loss itself, so any loss curvlinops takes works here
too, and the matrix is curvlinops' GGN of the same loss, to rounding.

Elementwise activation modules (GPT-2's GELU, ``nn.Tanh``, ...) enter the kept graph
with their derivative at the batch's point frozen
(:mod:`~laplace_glas.autodiff.frozen_activations`): a product then multiplies by ``f'(x)`` instead
of differentiating the activation's elementary ops again (on GPT-2 + LoRA over tokens
half of every product's time; the same first derivative, so the same matrix).
Layer and RMS normalisations likewise enter with their Jacobian frozen
(:mod:`~laplace_glas.autodiff.frozen_norms`): ``J v`` then differentiates a few
elementwise ops and reductions instead of torch's general second-order layer-norm
formula (GPT-2 + LoRA over tokens: ``J v`` 27 -> 23 ms a batch, products 8% faster,
the same kept bytes). peft's LoRA layers enter with their Jacobian frozen too
(:mod:`~laplace_glas.autodiff.frozen_lora`): the scaling acts on the rank side and
the rank terms join the base layer's product in one ``addmm`` (GPT-2 + LoRA over
tokens: products 45 -> 37 ms a batch, the same kept bytes). The frozen modules stay
switched while ``J_b^T u`` is recorded and are switched again whenever a product
passes over a batch's graphs: a segment under activation checkpointing runs its
forward again inside those backward passes, and must save what the recorded pass
saved.

Blocks of ``m`` columns go through ``torch.autograd.grad(..., is_grads_batched=True)``
(one vmapped backward pass per batch, in column chunks of about 512 MiB of temporaries);
a model whose backward pass vmap cannot batch goes one column at a time.

Memory: the kept graphs hold the activations of every batch and of its first
backward pass, plus per batch the outputs, the loss gradient and ``J_b^T u`` (``D``
numbers). The backward pass is recorded at ``u = 0``, so the gradients flowing back
through it are zero; its graph keeps none of its saved tensors that are zero in every
element, which unpack as zero-stride zeros (:mod:`~laplace_glas.autodiff.cotangents`;
kept graphs per batch, ``benchmarks/kept_graph_memory.py``: a GRU 16.6 -> 8.0 MiB, an
LSTM tagger 31.8 -> 11.8 MiB, a transformer encoder 21.4 -> 10.8 MiB; the same
products). :func:`build_linearized_ggn` counts them
(:class:`~laplace_glas.curvature.operators.graph_bytes.SavedBytes`: the tensors the graphs save
through ``torch.autograd.graph.saved_tensors_hooks`` and the ones it holds itself, each
storage once and whole, a batch's inputs by the rows they span, the model's own
parameters and buffers not counted; the heap's freed pages are handed back after each
batch and each product, so that temporaries do not stay resident beside the graphs) and gives up,
returning the reason, when they exceed ``budget_bytes`` (projected from the first
batch when the loader has a length); the planner then streams, rebuilding one batch's
graphs per product (:mod:`~laplace_glas.curvature.operators.relinearized`) where they fit
the budget, else curvlinops' products. The count is what the allocator keeps
(torch.profiler's record of the allocations a batch leaves live agrees to a few
scalars). On the host, the heap keeps more resident: about a page per kept storage,
shared with freed temporaries (:data:`~laplace_glas.curvature.memory.budget.HOST_PAGE_BYTES`),
which the estimate adds per batch, whatever its size (``benchmarks/
kept_graph_memory.py``: without them a batch's resident memory was 1.7-13.5% above its
count for the models of ``benchmarks/linearized_cost.py`` and a GRU regressor in
batches of 200, 34% for the GRU in batches of 32, whose storages are a few pages each;
with them 0.94-1.03 of it), and half a page per zero tensor not kept, a hole amid them
(measured 2.0-3.0 KB each). A process's first pass takes some MiB for itself; the
measured-peak warning reports what :data:`~laplace_glas.curvature.memory.budget.HOST_SLACK`
does not cover.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from laplace_glas.autodiff.checkpoints import watch_reentrant_checkpoints
from laplace_glas.autodiff.cotangents import zero_free_saving
from laplace_glas.autodiff.frozen_activations import Freezable, freezable_modules, switched_forwards
from laplace_glas.curvature.data.batches import batch_to_device
from laplace_glas.curvature.data.example_counts import BatchSizes
from laplace_glas.curvature.memory.budget import (
    HOST_PAGE_BYTES,
    OverBudget,
    format_bytes,
    return_freed_memory,
)
from laplace_glas.curvature.operators.curvlinops import LossOnData
from laplace_glas.curvature.operators.graph_bytes import SavedBytes
from laplace_glas.curvature.operators.torch_operator import NUMPY_DTYPES, TorchOperator
from laplace_glas.progress import progress

__all__ = [
    "COLUMN_BYTES",
    "Linearization",
    "LinearizedGGN",
    "adjoint_check",
    "build_linearized_ggn",
]

COLUMN_BYTES = 2**29  # batched backward passes: temporaries of about 512 MiB per batch
_TRIM_BATCH_BYTES = 8 * 2**20  # kept bytes a batch from which products trim the heap


@dataclass
class Linearization:
    """One batch's kept graphs.

    ``outputs`` are the network outputs ``f_b`` (graph to the parameters), ``dummy`` the
    ``u`` and ``pullback`` the ``J_b^T u`` built from it with ``create_graph=True`` (one
    tensor per used parameter, ``used`` their indices in the parameter list), ``leaf``
    a detached copy of ``f_b`` and ``loss_gradient`` ``c nabla_f l_b`` at it, with its
    graph. ``frozen``: the network's frozen modules
    (:func:`~laplace_glas.autodiff.frozen_activations.freezable_modules`), switched again while a
    product passes over the graphs, so that a checkpointed segment, whose forward the
    backward passes run again, saves what the recorded pass saved.
    """

    outputs: torch.Tensor
    dummy: torch.Tensor
    pullback: tuple[torch.Tensor, ...]
    used: tuple[int, ...]
    leaf: torch.Tensor
    loss_gradient: torch.Tensor
    frozen: tuple[Freezable, ...]


class LinearizedGGN(TorchOperator):
    """``G = c sum_b J_b^T Lambda_b J_b`` from kept graphs, as a SciPy operator (and in
    torch).

    Built by :func:`build_linearized_ggn`. ``matmat_torch(V)`` returns ``G V`` for
    ``V (D, m)`` in the parameters' dtype and device; the SciPy interface converts to
    and from NumPy. ``saved_bytes`` is the memory the graphs keep, ``heap_bytes`` what
    the host heap keeps resident beside them (a page per kept storage; 0 off the host),
    ``resident_bytes`` their sum.
    """

    def __init__(
        self,
        linearizations: Sequence[Linearization],
        params: Sequence[torch.Tensor],
        saved_bytes: int,
        column_bytes: int = COLUMN_BYTES,
        heap_bytes: int = 0,
    ):
        ref = params[0]
        n_params = sum(p.numel() for p in params)
        super().__init__(dtype=NUMPY_DTYPES[ref.dtype], shape=(n_params, n_params))
        self.linearizations = list(linearizations)
        self.params = list(params)
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.offsets = np.cumsum([0, *self.sizes])  # of each parameter in the D-vector
        self.torch_dtype = ref.dtype
        self.device = ref.device
        self.saved_bytes = int(saved_bytes)
        self.heap_bytes = int(heap_bytes)
        self.n_products = 0
        self.batched = True  # is_grads_batched until vmap refuses the backward pass
        # a batched backward pass needs about one batch's kept bytes per column
        per_batch = max(1, self.saved_bytes // max(1, len(self.linearizations)))
        self.column_chunk = max(1, min(column_bytes, COLUMN_BYTES) // per_batch)
        self._trims = self.device.type == "cpu" and per_batch >= _TRIM_BATCH_BYTES

    @property
    def resident_bytes(self) -> int:
        """The kept graphs' bytes and the host heap's pages beside them."""
        return self.saved_bytes + self.heap_bytes

    # -- torch
    def _product(self, lin: Linearization, V: torch.Tensor, batched: bool) -> torch.Tensor:
        """``c J_b^T Lambda_b J_b V`` for ``V (D, m)``, as ``(m, D)``."""
        m = V.shape[1]
        tangents = self.parameter_tangents(lin, V)
        if not batched:
            tangents = [t[0] for t in tangents]
        used = [self.params[i] for i in lin.used]
        with switched_forwards(lin.frozen):  # as recorded (see Linearization)
            (Jv,) = torch.autograd.grad(
                lin.pullback, lin.dummy, tangents, retain_graph=True, is_grads_batched=batched
            )
            (HJv,) = torch.autograd.grad(
                lin.loss_gradient, lin.leaf, Jv, retain_graph=True, is_grads_batched=batched
            )
            grads = torch.autograd.grad(
                lin.outputs, used, HJv, retain_graph=True, is_grads_batched=batched
            )
        out = torch.zeros(m, self.shape[0], dtype=self.torch_dtype, device=self.device)
        for i, grad in zip(lin.used, grads, strict=True):
            out[:, self.offsets[i] : self.offsets[i + 1]] = grad.reshape(m, -1)
        return out

    def parameter_tangents(self, lin: Linearization, V: torch.Tensor) -> list[torch.Tensor]:
        """The columns of ``V (D, m)`` as ``(m, *shape)`` tensors of the used parameters."""
        columns = V.T.split(self.sizes, dim=1)
        return [columns[i].reshape(V.shape[1], *self.shapes[i]) for i in lin.used]

    def batches(self) -> Iterable[Linearization]:
        """The batches' linearisations a product passes over (the kept ones)."""
        return self.linearizations

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``G V`` for ``V (D, m)``."""
        V = V.to(device=self.device, dtype=self.torch_dtype)
        m = V.shape[1]
        while True:  # again, in smaller chunks, where the device ran out of memory
            result = torch.zeros(m, self.shape[0], dtype=self.torch_dtype, device=self.device)
            batches = iter(self.batches())
            try:
                for lin in batches:
                    done = self._accumulate(lin, V, result)
                    del lin  # a rebuilt batch's graphs go before the next batch is linearised
                    if not done:
                        break
                else:
                    self.n_products += m
                    self._hand_back_freed_memory()
                    return result.T
            finally:
                close = getattr(batches, "close", None)  # a rebuilt pass: end its loader
                if close is not None:
                    close()
            del result

    def _hand_back_freed_memory(self) -> None:
        """Hand the heap's freed pages back after a product where a batch keeps at least
        ``_TRIM_BATCH_BYTES`` (on the host): such a product's freed temporaries,
        interleaved with the kept graphs, creep up over a solve (an LSTM tagger's fit,
        32 MiB a batch: 20-60 MiB; the trims cost it about 1%); for smaller batches the
        creep is a few MiB and the trim's page faults cost the next product more (a
        small MLP's fit, 3.3 MiB a batch: 15%).
        """
        if self._trims:
            return_freed_memory()

    def _accumulate(self, lin: Linearization, V: torch.Tensor, result: torch.Tensor) -> bool:
        """Add batch ``lin``'s ``c J_b^T Lambda_b J_b V`` to ``result (m, D)``, in column
        chunks; False where the device ran out of memory and the chunk was halved.
        """
        for start in range(0, V.shape[1], self.column_chunk):
            chunk = V[:, start : start + self.column_chunk]
            rows = result[start : start + self.column_chunk]
            if chunk.shape[1] > 1 and self.batched:
                try:
                    rows += self._product(lin, chunk, batched=True)
                    continue
                except torch.OutOfMemoryError:
                    if self.column_chunk == 1:
                        raise
                    self.column_chunk = max(1, self.column_chunk // 2)
                    return False
                except RuntimeError as err:  # vmap cannot batch this backward pass
                    self.batched = False
                    reason = str(err).splitlines()[0]
                    warnings.warn(
                        "The linearised GGN multiplies one column at a time: vmap "
                        f"cannot batch this model's backward pass ({reason}).",
                        UserWarning,
                        stacklevel=3,
                    )
            for j in range(chunk.shape[1]):
                rows[j] += self._product(lin, chunk[:, j : j + 1], batched=False)[0]
        return True


def linearize_batch(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[torch.Tensor],
    X: torch.Tensor | dict,
    y: torch.Tensor,
    *,
    num_data: int,
    batch_size_fn: Callable | None = None,
    device: torch.device | str = "cpu",
    counter: SavedBytes | None = None,
    drop_zeros: bool = True,
) -> Linearization | str:
    """One batch's kept graphs: its outputs ``f_b`` (a forward pass with the elementwise
    activations' and the layer / RMS norms' first derivatives frozen), ``J_b^T u`` built
    with ``create_graph=True`` and the loss gradient ``c nabla_f l_b``; or why the batch
    cannot be linearised.

    ``counter`` (a ``SavedBytes``) counts the bytes the graphs save and the ones
    the linearisation holds itself. ``drop_zeros``: the graph of ``J_b^T u``, recorded
    at ``u = 0``, keeps none of its saved tensors that are zero in every element (among
    them the gradients flowing back, linear in ``u``); they unpack as zero-stride zeros,
    their value (:mod:`~laplace_glas.autodiff.cotangents`).
    """
    counter = counter if counter is not None else SavedBytes(set())
    X = batch_to_device(X, device)
    y = y.to(device)
    counter.add_inputs(X, y)
    # frozen modules stay switched while J_b^T u is recorded (checkpoints recompute there)
    frozen = freezable_modules(model)
    with counter.hooks(), torch.enable_grad(), switched_forwards(frozen):
        with watch_reentrant_checkpoints() as watch:
            outputs = model(X)
        if not isinstance(outputs, torch.Tensor):
            return f"the model returned a {type(outputs).__name__}, not a tensor"
        if not outputs.requires_grad:
            watch.check(model, params)
            return "the model output does not depend on the parameters"
        dummy = torch.zeros_like(outputs, requires_grad=True)
        saving = zero_free_saving(counter.pack, counter.drop) if drop_zeros else counter.hooks()
        with saving:
            pullback = torch.autograd.grad(
                outputs, params, dummy, create_graph=True, allow_unused=True
            )
        used = tuple(i for i, g in enumerate(pullback) if g is not None)
        watch.check(model, [p for p, g in zip(params, pullback, strict=True) if g is None])
        cut = [i for i in used if not pullback[i].requires_grad]
        if cut:  # J^T u without a graph to u: its J v would silently be zero
            return (
                f"the backward pass of parameter {cut[0]} (of {len(params)}) has no graph "
                "of its own, so it cannot be differentiated twice (a custom function "
                "whose backward detaches?)"
            )
        leaf = outputs.detach().requires_grad_(True)
        scale = 1.0
        if getattr(loss_func, "reduction", None) == "mean":
            if batch_size_fn is None and not isinstance(X, torch.Tensor):
                return "reduction='mean' on mapping inputs needs batch_size_fn"
            n = batch_size_fn(X) if batch_size_fn is not None else X.shape[0]
            scale = n / num_data
        (loss_gradient,) = torch.autograd.grad(scale * loss_func(leaf, y), leaf, create_graph=True)
    pulled = tuple(pullback[i] for i in used)
    kept = Linearization(outputs, dummy, pulled, used, leaf, loss_gradient, frozen)
    for tensor in (outputs, leaf, loss_gradient, *kept.pullback):  # held, not saved
        counter.count(tensor)
    return kept


def build_linearized_ggn(
    loss: LossOnData,
    *,
    device: torch.device | str = "cpu",
    budget_bytes: int,
    column_bytes: int = COLUMN_BYTES,
    progress_bar: bool = False,
    batch_sizes: BatchSizes | None = None,
) -> LinearizedGGN | str:
    """One forward pass per batch of ``loss.data``: the linearised GGN operator, or why not.

    Parameters
    ----------
    loss : LossOnData
        The network (in eval mode, with differentiable kernels), its trainable
        parameters in the order of the ``D``-vector, the loss whose GGN is taken (with
        ``reduction`` ``'sum'`` or ``'mean'``, as for curvlinops' ``GGNLinearOperator``:
        the matrix is the same), the ``(X, y)`` batches, ``num_data`` (divides the
        batches' GGNs for ``reduction='mean'``, times the batch size) and
        ``batch_size_fn`` (default ``X.shape[0]``).
    device : torch.device or str
        Where the batches go (the model's device).
    budget_bytes : int
        Largest memory the kept graphs (and on the host the heap's page per kept
        storage) may hold, with one batch's more for a product's temporaries; above
        it the reason is returned, an
        :class:`~laplace_glas.curvature.memory.budget.OverBudget` with the projected bytes
        (``needed``, ``None`` for a loader without a length) and the first batch's.
    column_bytes : int
        Temporaries a batched product may take (at most 512 MiB): columns go through
        the backward passes in chunks of ``column_bytes`` over one batch's kept bytes
        (at least one column).
    progress_bar : bool
        A tqdm bar over the batches.
    batch_sizes : BatchSizes, optional
        The loader's batch sizes
        (:func:`~laplace_glas.curvature.data.example_counts.survey_batch_sizes`): the first
        batch's graphs are projected to all examples and, for a product's temporaries,
        to the largest batch, its pullback (``D`` numbers) to every batch as it is
        (without them: to the number of batches, and the first batch's).

    Returns
    -------
    LinearizedGGN or str
        The operator, or the reason it was not built (the caller streams).

    """
    model, loss_func, data = loss.model, loss.loss_func, loss.data
    num_data, batch_size_fn, params = loss.num_data, loss.batch_size_fn, list(loss.params)
    counter = SavedBytes.beside(model)
    page = HOST_PAGE_BYTES if torch.device(device).type == "cpu" else 0
    linearizations = []
    try:
        n_batches = len(data)
    except TypeError:
        n_batches = None
    for X, y in progress(data, "Linearising", progress_bar):
        kept = linearize_batch(
            model, loss_func, params, X, y, num_data=num_data, batch_size_fn=batch_size_fn,
            device=device, counter=counter,
        )  # fmt: skip
        if isinstance(kept, str):
            return kept
        linearizations.append(kept)
        # the batch's freed temporaries, interleaved on the heap with its kept graphs,
        # stay resident unless handed back (a GRU's: 6 MiB beside 17 MiB kept a batch)
        return_freed_memory()
        pages = counter.heap_bytes(page)  # the heap's pages beside the kept storages
        kept_bytes = counter.bytes + pages
        projected = kept_bytes
        if len(linearizations) == 1:  # give up before the pass, not after
            first_batch, whole = counter.bytes, None  # a product's share; all batches'
            if batch_sizes is not None:  # each batch's pullback is D numbers, whatever its size
                fixed = sum(t.numel() * t.element_size() for t in kept.pullback)
                first_batch = batch_sizes.to_largest(counter.bytes, fixed)
                # a batch keeps as many storages (pages) whatever its size
                whole = batch_sizes.to_loader(kept_bytes, fixed + pages)
            elif n_batches is not None:
                whole = kept_bytes * n_batches
            projected = kept_bytes if whole is None else whole
        if projected + first_batch > budget_bytes:  # and one product's temporaries
            known = n_batches is not None
            done = len(linearizations)
            of = f" of {n_batches}" if known and n_batches >= done else ""
            unit = getattr(data, "unit", "batch")  # "slice" where the planner cut them
            plural = {"batch": "batches", "slice": "slices"}.get(unit, unit + "s")
            return OverBudget(
                f"the kept graphs exceed the memory budget ({format_bytes(projected)} "
                f"{'after' if projected == kept_bytes else 'projected from'} "
                f"{done}{of} {plural if of or done > 1 else unit} and "
                f"{format_bytes(first_batch)} for a product; "
                f"{format_bytes(budget_bytes)} of the budget left for them)",
                needed=None if whole is None else max(whole, kept_bytes) + first_batch,
                batch_bytes=first_batch,
            )
    if not linearizations:
        return "the loader is empty"
    operator = LinearizedGGN(
        linearizations, params, counter.bytes, column_bytes, heap_bytes=counter.heap_bytes(page)
    )
    reason = adjoint_check(operator, linearizations[0])
    if reason is not None:
        return reason
    return operator


def adjoint_check(operator: LinearizedGGN, lin: Linearization) -> str | None:
    """Why the double-backward ``J v`` of the first batch cannot be trusted, or None.

    For random ``u`` and ``v``, ``<u, J v>`` (double backward) must equal
    ``<J^T u, v>`` (one backward pass), to ``tol`` times the sum of the absolute terms
    of both inner products (computed in float64). A backward pass that cannot be
    differentiated raises here; one that is cut from ``u`` on some path (a custom
    function marked ``@once_differentiable`` hands back a result without a graph)
    drops that path's share of ``J v`` and fails the identity. (A parameter whose
    whole ``J^T u`` has no graph is refused before, by name.) The check sees one batch
    and one random pair: a cut whose share is below about ``tol`` of the terms'
    magnitudes goes unnoticed (correct float32 models measured at most 2e-8).
    """
    generator = torch.Generator(device=operator.device).manual_seed(0)
    options = {"dtype": operator.torch_dtype, "device": operator.device}
    u = torch.randn(lin.outputs.shape, generator=generator, **options)
    v = torch.randn(operator.shape[0], 1, generator=generator, **options)
    tangents = [t[0] for t in operator.parameter_tangents(lin, v)]
    used = [operator.params[i] for i in lin.used]
    try:
        with switched_forwards(lin.frozen):  # as the products run (Linearization)
            (Jv,) = torch.autograd.grad(lin.pullback, lin.dummy, tangents, retain_graph=True)
            JTu = torch.autograd.grad(lin.outputs, used, u, retain_graph=True)
    except RuntimeError as err:
        return f"the backward pass cannot be differentiated twice ({str(err).splitlines()[0]})"
    left_terms = (u.double() * Jv.double()).flatten()
    right_terms = torch.cat(
        [(g.double() * t.double()).flatten() for g, t in zip(JTu, tangents, strict=True)]
    )
    left, right = left_terms.sum(), right_terms.sum()
    # rounding is relative to the terms' magnitudes, not to the (cancelling) sums
    size = left_terms.abs().sum() + right_terms.abs().sum()
    tol = 2e-6 if operator.torch_dtype == torch.float32 else 1e-13  # correct: <= 2e-8
    gap = left - right
    if not bool(torch.isfinite(gap)) or gap.abs() > tol * size:
        return (
            "the double-backward Jacobian-vector product fails the check "
            f"<u, J v> = <J^T u, v> ({float(left):.6g} against {float(right):.6g}): a "
            "backward pass without a graph of its own (e.g. @once_differentiable)?"
        )
    return None
