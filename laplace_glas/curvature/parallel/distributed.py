"""Data-parallel fits on ``torch.distributed``: every rank holds a shard of the data.

The mean-loss GGN is a sum over the data, so over the shards ``r = 1..W``:

.. math::

    G_1 = \\frac1N \\sum_{n=1}^N J_n^\\top \\Lambda_n J_n
        = \\sum_{r=1}^W \\underbrace{\\frac1N \\sum_{n \\in r} J_n^\\top \\Lambda_n J_n}_{G_r},
    \\qquad N = \\sum_r N_r .

Each rank builds its operator ``G_r`` with the *global* ``N`` (curvlinops' ``num_data``,
the factored operator's ``1/sqrt(N)``) and a product ``G_1 V`` is the local product
``G_r V`` followed by one ``torch.distributed.all_reduce`` (sum) of the ``(D, m)``
result. Likewise the loss at the MAP and ``N`` are summed once per fit, and the
calibration's coverage, width and NLL are weighted means whose numerators and counts
are summed once per sweep.

Communication per data pass: the ranks' status (one all-reduce of ``W`` int64 failure
flags), then one all-reduce of ``D * m`` numbers in the model's dtype (``m = 1`` for
Lanczos, ``block_size`` for the block solver), i.e. ``D m itemsize`` bytes of payload; a
ring all-reduce sends and receives ``2 (W - 1) / W`` times that per rank. Once per fit:
the agreement on settings and weights (an all-gather of ``1 + 5 S + 6`` float64 for
``S`` settings), the loss and ``N`` with one failure flag per rank (``2 + W`` float64),
the factored-operator agreement (``1 + W`` int64), the closing status of the solve
(``W`` int64) and the broadcast of the eigenpairs from rank 0 (``(D + 4) k`` numbers).

Faults: every collective carries one failure flag per rank, so that a rank whose data
pass or solve fails (its loader raises, ARPACK or the block solver fails between
products, its ``complement='diag'`` pass fails) raises its error and every other rank a
``RuntimeError`` naming it, at the next collective, while the failed process lives on;
the status sent before each product has the same size whatever the product's width, so
a rank that fails between products meets the others in it (or in the closing status).
A rank that exits or is killed closes its connections: the others' next collective
fails at once (gloo's "Connection closed by peer"), re-raised as a ``RuntimeError``
that says so. A rank that lives on but never reaches the next collective (a hung
loader) is only caught by the process group's ``timeout`` (``init_process_group(...,
timeout=datetime.timedelta(seconds=...))``; 30 minutes by default for gloo).

Identical eigenpairs: every rank runs the *same* dense steps (ARPACK's or the block
solver's Rayleigh-Ritz and restarts) on the *same* all-reduced products from the same
seeded start, so the solves follow the same path and call the all-reduce equally often;
no rank waits for another's dense work. The result is then broadcast from rank 0 once,
so that the ranks agree bit for bit even where BLAS differs between machines. Running
the solver on rank 0 alone would need a protocol of its own (the other ranks waiting for
vectors and a stop signal) for no gain in wall time.

The dual (Gram) solve is not distributed: ``K = S S^T`` has blocks ``S_r S_s^T`` between
shards, which would move the factors (``N R`` rows of ``D``) between ranks. A
distributed fit with ``solver='auto'`` or ``'dual'`` therefore runs Lanczos on the
all-reduced factored products (``D`` numbers per product), recorded in
``Eigenpairs.solver`` and ``Eigenpairs.operator``.

``fit(loader, override=False)`` adds the stored curvature, the same on every rank, to the
all-reduced products of the new shards.

``subsample_size`` draws that many points from each rank's shard (``W`` times as many in
all); ``N`` is then the sum of the subsamples.

Backends: any that supports ``all_reduce`` and ``broadcast`` on the model's device
(gloo on CPU, NCCL on CUDA; tested with gloo on one machine, NCCL and several machines
not). Every rank must call ``fit`` (and the other collective
methods) with a non-empty shard and the same settings: ``fit`` and
``compute_eigenpairs`` check both, and the weights, on every rank before their first
data pass (:mod:`laplace_glas.curvature.parallel.agreement`), and a failed pass at the MAP raises
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from laplace_glas.curvature.data.map_loss import MapLoss
from laplace_glas.curvature.operators.factored import FactoredGGN
from laplace_glas.curvature.operators.torch_operator import (
    NUMPY_DTYPES,
    ColumnChunks,
    TorchOperator,
)

__all__ = [
    "AllReducedGGN",
    "Shards",
    "agree_on_operator",
    "all_reduce_sum",
    "broadcast_eigenpairs",
    "data_parallel",
    "distribute_operator",
    "failed_ranks",
    "flag_failure",
    "flagged_sum",
    "reduce_map_loss",
    "sum_count",
]


@dataclass(frozen=True)
class Shards:
    """The process group a fit is spread over (``world_size >= 2``)."""

    group: Any
    """A ``torch.distributed`` process group (``None`` is the default group)."""
    world_size: int
    rank: int
    """This process's rank within ``group``."""

    @property
    def source(self) -> int:
        """The global rank of the group's rank 0 (the source of broadcasts)."""
        if self.group is None:
            return 0
        return dist.get_global_rank(self.group, 0)


def failed_ranks(flags: torch.Tensor) -> list[int]:
    """The ranks whose entry of an all-reduced one-hot failure vector is set."""
    return [int(r) for r in torch.nonzero(flags.detach().cpu() != 0).reshape(-1)]


def data_parallel(process_group: Any = None) -> Shards | None:
    """The shards of a fit, or ``None`` for a single-process fit.

    ``process_group=None`` takes the default group when ``torch.distributed`` is
    initialised; a group of one rank (e.g. ``dist.new_group([rank])``) or an
    uninitialised ``torch.distributed`` means a single-process fit.

    Raises
    ------
    ValueError
        If a group is passed but ``torch.distributed`` is not initialised, or this
        process is not a member of it.
    TypeError
        If ``process_group`` is not a process group.

    """
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError(
                "process_group was given but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group first (e.g. under torchrun)."
            )
        return None
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("This process is not a member of the given process_group.")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed process group (e.g. from "
            f"torch.distributed.new_group) or None, got {type(process_group).__name__}."
        )
    world_size = dist.get_world_size(process_group)
    if world_size < 0:
        raise ValueError("This process is not a member of the given process_group.")
    if world_size == 1:
        return None
    return Shards(process_group, world_size, dist.get_rank(process_group))


def _collective(call: Any, name: str) -> None:
    """``call()``, a ``torch.distributed`` collective; a backend failure (a rank that
    exited or lost its connection: gloo's "Connection closed by peer") is re-raised as a
    ``RuntimeError`` that says so. A rank that lives on but never arrives is only caught
    by the process group's ``timeout`` (``init_process_group(timeout=...)``).
    """
    try:
        call()
    except Exception as err:
        head = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise RuntimeError(
            f"torch.distributed's {name} failed ({type(err).__name__}: {head}): another "
            "rank has probably exited or lost its connection (see its output); no rank "
            "returns a result."
        ) from err


def _all_reduce(tensor: torch.Tensor, shards: Shards, op=dist.ReduceOp.SUM) -> torch.Tensor:
    _collective(lambda: dist.all_reduce(tensor, op=op, group=shards.group), "all-reduce")
    return tensor


def flagged_sum(
    values: torch.Tensor,
    shards: Shards,
    *,
    error: Exception | None = None,
    step: str,
    result: str = "no rank returns a result",
) -> torch.Tensor:
    """``sum_r values_r`` with one failure flag per rank in the same all-reduce.

    A rank that failed (``error``; its ``values`` are zeros of the agreed shape) sets
    its flag and raises ``error`` after the all-reduce; the other ranks raise a
    ``RuntimeError`` naming it (``step``: what they were doing), so that no rank waits
    for a collective the failed one never joins.
    """
    n = values.numel()
    packed = torch.cat([values.reshape(-1), values.new_zeros(shards.world_size)])
    if error is not None:
        packed[n + shards.rank] = 1
    _all_reduce(packed, shards)
    if error is not None:
        raise error
    failed = failed_ranks(packed[n:])
    if failed:
        raise RuntimeError(
            f"Rank(s) {', '.join(map(str, failed))} failed (see the error there) while this "
            f"rank was {step}: {result}."
        )
    return packed[:n].reshape(values.shape)


def all_reduce_sum(tensor: torch.Tensor, shards: Shards | None) -> torch.Tensor:
    """``sum_r tensor_r`` over the ranks (``tensor`` itself for a single process)."""
    if shards is None:
        return tensor
    return _all_reduce(tensor.clone(), shards)


def _flagged_sum(
    value: int,
    shards: Shards,
    device: Any,
    error: Exception | None,
    step: str,
    result: str = "no rank returns eigenpairs",
) -> int:
    """``sum_r value_r`` from one all-reduce of ``1 + W`` int64 with a failure flag per
    rank: a rank that failed (``error``) sets its flag and raises ``error`` after the
    all-reduce; the other ranks raise a ``RuntimeError`` naming it. Every once-per-fit
    count and agreement of the solve has this layout, so that a rank that fails before
    one of them meets the others at whichever they are in.
    """
    flags = torch.zeros(1 + shards.world_size, dtype=torch.int64, device=device)
    flags[0] = int(value)
    if error is not None:
        flags[1 + shards.rank] = 1
    _all_reduce(flags, shards)
    if error is not None:
        raise error
    failed = failed_ranks(flags[1:])
    if failed:
        raise RuntimeError(
            f"Rank(s) {', '.join(map(str, failed))} failed (see the error there) while this "
            f"rank was {step}: {result}."
        )
    return int(flags[0])


def flag_failure(
    shards: Shards, device: Any, error: Exception | None, step: str, result: str
) -> None:
    """The once-per-fit status of the ranks (one all-reduce of ``1 + W`` int64, the
    layout of :func:`sum_count` and :func:`agree_on_operator`): ``error`` is raised on
    this rank and a ``RuntimeError`` naming it on the others (``step``: what they were
    doing; ``result``: what no rank returns).
    """
    _flagged_sum(0, shards, device, error, step, result)


def sum_count(
    n: int,
    shards: Shards | None,
    device: torch.device | str = "cpu",
    *,
    error: Exception | None = None,
) -> int:
    """``sum_r n_r`` over the ranks (``n`` itself for a single process).

    ``error``: counting failed on this rank; raised on every rank (a ``RuntimeError``
    naming it on the others).
    """
    if shards is None:
        if error is not None:
            raise error
        return int(n)
    return _flagged_sum(n, shards, device, error, "counting the likelihood terms")


def reduce_map_loss(
    local: MapLoss | None,
    shards: Shards | None,
    *,
    error: Exception | None = None,
    device: torch.device | str = "cpu",
) -> MapLoss:
    """The loss at the MAP and ``N`` summed over the ranks (one all-reduce of ``2 + W``
    float64).

    ``L = sum_r L_r``, ``N = sum_r N_r``; the output shape per point is the local one
    (every rank has the same model). ``error``: this rank's pass failed (``local`` is
    ``None``); it still takes part in the all-reduce, with its entry of the ``W``
    failure flags set, and raises ``error`` after it, while the other ranks raise a
    ``RuntimeError`` naming it.
    """
    if shards is None:
        if error is not None:
            raise error
        return local
    packed = torch.zeros(2 + shards.world_size, dtype=torch.float64, device=device)
    if error is None:
        packed[0] = local.loss.detach().to(torch.float64).reshape(())
        packed[1] = float(local.n_terms)
    else:
        packed[2 + shards.rank] = 1.0
    _all_reduce(packed, shards)
    if error is not None:
        raise error
    failed = failed_ranks(packed[2:])
    if failed:
        raise RuntimeError(
            f"The pass at the MAP failed on rank(s) {', '.join(map(str, failed))} (see the "
            "error there): no rank fits."
        )
    loss = packed[0].to(device=local.loss.device, dtype=local.loss.dtype)
    return MapLoss(loss, round(float(packed[1])), local.out_shape)


def agree_on_operator(
    factored: bool,
    shards: Shards,
    device: torch.device | str,
    *,
    error: Exception | None = None,
) -> bool:
    """True when the factored operator could be built on *every* rank (one all-reduce of
    ``1 + W`` int64): a rank whose shard exceeds the factor budget makes all ranks fall
    back to curvlinops, so that all ranks run the same solve.

    ``error``: building this rank's operator failed; the rank still takes part, with
    its failure flag set, and raises ``error`` after the all-reduce, while the other
    ranks raise a ``RuntimeError`` naming it.
    """
    step = "agreeing on the GGN operator"
    return _flagged_sum(int(not factored), shards, device, error, step) == 0


class AllReducedGGN(TorchOperator):
    """``G_1 V = sum_r G_r V``: a rank's operator followed by an all-reduce.

    Parameters
    ----------
    local : curvlinops operator or FactoredGGN
        This rank's ``G_r`` (built with the global ``N``), applied in torch.
    shards : Shards
        The process group.
    dtype, device : torch.dtype, torch.device
        The model's; the all-reduce runs on ``device`` (CUDA for NCCL).

    Notes
    -----
    Each call moves the ranks' status (``W`` flags) and one ``(D, m)`` all-reduce:
    ``D m itemsize`` bytes of payload, counted in ``bytes_reduced``; ``n_reductions``
    counts the calls (data passes). :meth:`close` ends the solve on every rank.
    ``to_scipy`` returns the operator itself so that the block solver keeps torch
    tensors and Lanczos gets NumPy arrays.

    """

    def __init__(self, local: Any, shards: Shards, dtype: torch.dtype, device: torch.device | str):
        super().__init__(dtype=NUMPY_DTYPES[dtype], shape=tuple(local.shape))
        self.local = local
        self.shards = shards
        self.torch_dtype = dtype
        self.device = torch.device(device)
        self.n_reductions = 0
        self.bytes_reduced = 0
        self.reported = False

    def to_scipy(self, dtype: Any = None) -> AllReducedGGN:
        """The operator itself (it already speaks NumPy and torch)."""
        return self

    def _status(self, error: Exception | None, where: str) -> None:
        """One all-reduce of ``W`` int64 failure flags: raises ``error`` on the rank that
        failed and a ``RuntimeError`` naming it on the others (after which every rank
        leaves the solve: ``reported``).
        """
        flags = torch.zeros(self.shards.world_size, dtype=torch.int64, device=self.device)
        if error is not None:
            flags[self.shards.rank] = 1
        _all_reduce(flags, self.shards)
        failed = failed_ranks(flags)
        self.reported = bool(failed)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"The eigen-solve failed on rank(s) {', '.join(map(str, failed))} (see the "
                f"error there) {where}: no rank returns eigenpairs."
            )

    def matmat_torch(self, V: torch.Tensor) -> torch.Tensor:
        """``sum_r G_r V`` for ``V (D, m)``: the ranks' status (``W`` flags), then the
        product (one all-reduce of ``D m`` numbers).

        A rank whose local product fails (e.g. its loader raises) sets its flag in the
        status and raises its error; the other ranks raise a ``RuntimeError`` naming it,
        so that no rank waits for the next product.
        """
        V = V.to(device=self.device, dtype=self.torch_dtype)
        shape, error = (self.shape[0], V.shape[1]), None
        try:
            if isinstance(self.local, FactoredGGN):
                GV = self.local.matmat_torch(V)
            else:  # curvlinops' operators answer in torch, SciPy operators in NumPy
                GV = torch.as_tensor(self.local @ V)
            GV = GV.to(device=self.device, dtype=self.torch_dtype).reshape(shape).contiguous()
        except Exception as err:
            error = err
        self._status(error, f"at GGN product {self.n_reductions + 1}")
        _all_reduce(GV, self.shards)
        self.n_reductions += 1
        self.bytes_reduced += GV.numel() * GV.element_size()
        return GV

    def close(self, error: Exception | None = None) -> None:
        """Every rank calls this once after its solve (one status all-reduce).

        ``error``: the solve failed on this rank outside a product (in ARPACK's or the
        block solver's own arithmetic, or the residual check): it reaches the other
        ranks, which are then waiting in their next product's status or in this one.
        An error that the ranks already exchanged (``reported``) is raised as it is.
        """
        if error is not None and self.reported:
            raise error
        self._status(error, f"after GGN product {self.n_reductions} on this rank")


def distribute_operator(plan: Any, problem: Any, error: Exception | None = None) -> Any:
    """The plan of a distributed fit: its operator all-reduced over ``problem.shards``
    (``plan`` itself for a single process).

    ``plan`` (a :class:`~laplace_glas.curvature.memory.planner.Plan`) is what
    :func:`~laplace_glas.curvature.memory.planner.plan_solve` chose on this rank for
    ``problem`` (a :class:`~laplace_glas.curvature.data.problem.CurvatureProblem`) within
    this rank's memory budget. Every rank uses curvlinops' operator of the problem
    (streaming, in the column chunks this rank's plan allows) unless the factored
    operator was built on all of them. The dual solve becomes Lanczos on the all-reduced factored
    products (see the module docstring). ``error``: planning failed on this rank
    (``plan`` is ``None``); raised on every rank (:func:`agree_on_operator`).
    """
    shards = problem.shards
    if shards is None:
        if error is not None:
            raise error
        return plan
    if error is not None:
        agree_on_operator(False, shards, problem.device, error=error)  # raises
    operator, scale, solver, name = plan.operator, plan.scale, plan.solver, plan.operator_name
    factored = isinstance(operator, FactoredGGN)
    # every rank calls this collective once, whatever its own outcome
    changes = {}
    if not agree_on_operator(factored, shards, problem.device) and factored:
        operator = problem.reference_operator()
        if plan.max_columns is not None:  # streaming within this rank's budget
            operator = ColumnChunks(operator, plan.max_columns, problem.dtype, problem.device)
        scale = problem.scale
        name = "curvlinops (not factored: the factors exceed a budget on another rank)"
        factored = False
        changes = {"strategy": "streaming", "estimated_peak": plan.streaming_peak}
    if factored and solver in ("auto", "dual"):
        name = f"{name} (dual solve not distributed: Lanczos on its products)"
    if solver in ("auto", "dual"):
        solver = "lanczos"
    name = f"{name}, all-reduced over {shards.world_size} ranks"
    operator = AllReducedGGN(operator, shards, problem.dtype, problem.device)
    return replace(
        plan, operator=operator, scale=scale, solver=solver, operator_name=name, **changes
    )


def broadcast_eigenpairs(eig: Any, shards: Shards | None) -> Any:
    """Rank 0's eigenpairs on every rank (one broadcast of ``(D + 4) k`` numbers).

    The ranks have run identical solves; the broadcast makes them agree bit for bit
    even where floating-point kernels differ between machines.
    """
    if shards is None:
        return eig
    values = torch.stack(
        [eig.values, eig.residuals, eig.raw_values, eig.below_threshold.to(eig.values.dtype)]
    )
    packed = torch.cat([values, eig.vectors]).contiguous()  # (4 + D, k)
    _collective(lambda: dist.broadcast(packed, src=shards.source, group=shards.group), "broadcast")
    return replace(
        eig,
        values=packed[0].clone(),
        residuals=packed[1].clone(),
        raw_values=packed[2].clone(),
        below_threshold=packed[3] > 0,
        vectors=packed[4:].clone(),
    )
