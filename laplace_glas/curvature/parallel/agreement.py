"""The ranks' agreement before a data-parallel fit, and faults that reach every rank.

A data-parallel fit sums every rank's GGN products, so it is only the GGN of one model
when every rank holds the same weights and solves the same problem (the same ``k``,
solver, Lanczos settings, random start, ...) with the same curvature (the backend's
matrix, the loss function) and the same collectives (the complement whose passes it runs,
which ``'auto'`` decides from the model, the loss and the prior's shape). Before the
first data pass the ranks exchange, in one ``all_gather`` of a short float64 vector each,

* a status: this rank is ready, its shard is empty, or a local check failed (the
  rank still takes part in the exchange, so that no other rank waits for it);
* the settings that must match (:class:`Setting`, encoded as numbers);
* a checksum of the model's weights (:func:`weights_checksum`).

Every rank then raises the same error when any rank failed, any shard is empty, any
setting differs or the weights differ, so that no rank returns eigenpairs of a GGN mixed
from different problems. A rank whose own check failed raises its own error.

The checksum is ``sum theta``, ``sum theta^2``, the sum weighted by the parameter
tensor's position and the lag-one sum ``sum theta_i theta_{i+1}`` within each tensor (over
the parameters and floating-point buffers, in float64); two ranks' checksums differ when
they differ by more than ``1e-10`` of their scale (``sum |theta|`` or ``sum theta^2``), so
that the rounding of float64 sums on different machines is no fault.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from laplace_glas.curvature.parallel.distributed import Shards

__all__ = [
    "LOSS_SETTINGS",
    "FitAgreement",
    "Setting",
    "agree_on_fit",
    "generator_checksum",
    "loss_description",
    "loss_settings",
    "shard_is_empty",
    "weights_checksum",
]

READY, FAILED, EMPTY = 0.0, 1.0, 2.0
WEIGHTS_RTOL = 1e-10
_CHECKSUM = ("sum", "sum of squares", "position-weighted sum", "lag-one sum")
_NONE, _NUMBER, _TEXT = 0.0, 1.0, 2.0
_TEXT_SLOTS, _SLOT_BYTES = 3, 6  # 18 bytes of text, 48 bits per float64 (exact)


@dataclass(frozen=True)
class Setting:
    """One setting the ranks must share, encoded as ``WIDTH`` float64.

    ``[kind, a, b, c, crc]``: ``None``; a number (``a``); or text (``str(value)`` for
    anything else, e.g. a dtype or a bool): its first 18 UTF-8 bytes in ``a, b, c`` and
    the CRC-32 of all of it in ``crc``, so that every rank can name every rank's value.
    """

    name: str
    value: Any

    WIDTH = 2 + _TEXT_SLOTS

    def encode(self) -> list[float]:
        """The value as ``WIDTH`` float64."""
        value = self.value
        if value is None:
            return [_NONE] + [0.0] * (self.WIDTH - 1)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return [_NUMBER, float(value)] + [0.0] * (self.WIDTH - 2)
        data = str(value).encode()
        head = data[: _TEXT_SLOTS * _SLOT_BYTES].ljust(_TEXT_SLOTS * _SLOT_BYTES, b"\0")
        slots = [
            float(int.from_bytes(head[i : i + _SLOT_BYTES], "big"))
            for i in range(0, len(head), _SLOT_BYTES)
        ]
        return [_TEXT, *slots, float(zlib.crc32(data))]

    def decode(self, codes: Sequence[float]) -> str:
        """A value encoded by :meth:`encode` (on any rank), as text."""
        kind, *slots, crc = (float(c) for c in codes)
        if kind == _NONE:
            return "None"
        if kind == _NUMBER:
            return str(int(slots[0])) if slots[0].is_integer() else repr(slots[0])
        data = b"".join(int(v).to_bytes(_SLOT_BYTES, "big") for v in slots).rstrip(b"\0")
        text = repr(data.decode(errors="replace"))
        return text if zlib.crc32(data) == int(crc) else f"{text[:-1]}...{text[-1]}"


def weights_checksum(tensors: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The checksum of the flattened ``tensors`` in float64 on ``device``.

    ``(sum, sum of squares, position-weighted sum, lag-one sum)`` and the scales of the
    first and third, ``sum |theta|`` and its position-weighted sum.
    """
    total = torch.zeros(6, dtype=torch.float64, device=device)
    for j, tensor in enumerate(tensors):
        x = tensor.detach().reshape(-1).to(device=device, dtype=torch.float64)
        s, a = x.sum(), x.abs().sum()
        lag = (x[1:] * x[:-1]).sum()
        total += torch.stack([s, (x * x).sum(), (j + 1) * s, lag, a, (j + 1) * a])
    return total


def generator_checksum(generator: torch.Generator) -> int:
    """An exact checksum of a generator's state (its bytes weighted by position)."""
    state = generator.get_state().to(torch.int64)
    return int((state * torch.arange(1, len(state) + 1)).sum())


def shard_is_empty(loader: Iterable) -> bool:
    """True when ``loader`` has no batch (its length, else its first batch)."""
    try:
        return len(loader) == 0  # type: ignore[arg-type]
    except TypeError:
        return next(iter(loader), None) is None


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _weights_differ(rows: torch.Tensor, offset: int) -> bool:
    sums = rows[:, offset : offset + 4]
    abs_sum, weighted = rows[:, offset + 4 :].max(0).values.tolist()
    squares = float(rows[:, offset + 1].max())
    scale = torch.tensor([abs_sum, squares, weighted, squares], dtype=rows.dtype)
    spread = sums.max(0).values - sums.min(0).values
    return bool((spread > WEIGHTS_RTOL * scale).any())


def _weights_text(row: torch.Tensor, offset: int) -> str:
    values = row[offset : offset + 4].tolist()
    return ", ".join(f"{name} {v:.12g}" for name, v in zip(_CHECKSUM, values, strict=True))


def agree_on_fit(
    shards: Any,
    settings: Sequence[Setting],
    weights: torch.Tensor,
    device: torch.device | str,
    *,
    empty: bool = False,
    error: BaseException | None = None,
) -> None:
    """Exchange status, settings and weights checksum; raise on every rank on a fault.

    Parameters
    ----------
    shards : Shards
        The process group of the fit.
    settings : sequence of Setting
        The same names, in the same order, on every rank.
    weights : torch.Tensor
        :func:`weights_checksum` of the model.
    device : torch.device or str
        Where the collective runs (CUDA for NCCL).
    empty : bool, default=False
        This rank's shard is empty.
    error : Exception, optional
        A local check that failed on this rank: raised here after the exchange (on an
        empty rank, the cause of the empty shard's error).

    Raises
    ------
    ValueError
        On every rank, if a shard is empty, a setting differs or the weights differ.
    RuntimeError
        On the other ranks, if a rank's local check failed (that rank raises ``error``).

    """
    status = EMPTY if empty else FAILED if error is not None else READY
    row = [status, *(code for s in settings for code in s.encode()), *weights.tolist()]
    local = torch.tensor(row, dtype=torch.float64, device=device)
    rows = [torch.empty_like(local) for _ in range(shards.world_size)]
    dist.all_gather(rows, local, group=shards.group)
    if status == FAILED:
        raise error
    rows = torch.stack(rows).cpu()
    empties = [r for r in range(len(rows)) if rows[r, 0] == EMPTY]
    if empties:  # on an empty rank, its failed checks are the consequence
        raise ValueError(
            f"The training shard of {_ranks(empties)} is empty: a data-parallel fit needs "
            "data on every rank (give every rank a non-empty shard, or fit on a process "
            "group of the ranks that have data)."
        ) from error
    failed = [r for r in range(len(rows)) if rows[r, 0] == FAILED]
    if failed:
        raise RuntimeError(
            f"{_ranks(failed)} failed before the data-parallel fit (see the error there): "
            "no rank fits."
        )
    differ = []
    for i, setting in enumerate(settings):
        codes = rows[:, 1 + i * Setting.WIDTH : 1 + (i + 1) * Setting.WIDTH]
        if bool((codes != codes[0]).any()):
            values = ", ".join(f"rank {r}: {setting.decode(c)}" for r, c in enumerate(codes))
            differ.append(f"{setting.name} ({values})")
    if differ:
        raise ValueError(
            f"The ranks' settings differ: {'; '.join(differ)}. A data-parallel fit needs "
            "the same settings on every rank."
        )
    offset = 1 + len(settings) * Setting.WIDTH
    if _weights_differ(rows, offset):
        values = "; ".join(f"rank {r}: {_weights_text(rows[r], offset)}" for r in range(len(rows)))
        raise ValueError(
            f"The ranks' model weights differ ({values}): a data-parallel fit needs the same "
            "weights on every rank (e.g. broadcast rank 0's state_dict before fit)."
        )


LOSS_SETTINGS = (
    "reduction",
    "ignore_index",
    "label_smoothing",
    "beta",
    "delta",
    "margin",
    "eps",
    "full",
    "log_input",
)
"""The attributes of torch's loss modules that change the loss (those a module has are
compared across ranks; other attributes, e.g. a logged last value, are state)."""


def loss_description(loss_fn: Any) -> str | None:
    """``loss_fn``'s class (its qualified name), or None without one."""
    if loss_fn is None:
        return None
    return f"{type(loss_fn).__module__}.{type(loss_fn).__qualname__}"


def loss_settings(loss_fn: Any) -> list[Setting]:
    """The settings of ``loss_fn`` the ranks must share, as many on every rank whatever
    the loss (the agreement's rows must have one length): its class, each of
    :data:`LOSS_SETTINGS` (None where it has none) and two checksums of its tensors (e.g.
    class weights; None without tensors).
    """
    module = loss_fn if isinstance(loss_fn, torch.nn.Module) else None
    settings = [Setting("loss_fn", loss_description(loss_fn))]
    for name in LOSS_SETTINGS:
        value = getattr(module, name, None)
        simple = isinstance(value, bool | int | float | str)
        settings.append(Setting(f"loss_fn.{name}", value if simple else None))
    tensors = [] if module is None else [*module.parameters(), *module.buffers()]
    tensors = [t for t in tensors if t.is_floating_point()]
    squares = weighted = None
    if tensors:  # on the CPU in float64: the same tensors give the same sums on every rank
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
        positions = torch.arange(1, len(flat) + 1, dtype=torch.float64)
        squares, weighted = float(flat.square().sum()), float((positions * flat).sum())
    settings.append(Setting("loss_fn's tensors (sum of squares)", squares))
    settings.append(Setting("loss_fn's tensors (position-weighted sum)", weighted))
    return settings


class FitAgreement:
    """The ranks' agreement of a data-parallel fit, as a mixin of
    :class:`~laplace_glas.curvature.fit.SubspaceFit` (its settings and weights).
    """

    def _agree(
        self,
        shards: Shards | None,
        loader: Any,
        *,
        error: Exception | None = None,
        **settings: Any,
    ) -> None:
        """The ranks' agreement before a data-parallel fit
        (:func:`~laplace_glas.curvature.parallel.agreement.agree_on_fit`): nothing for one
        process; ``error`` (a failed local check) is raised after the exchange.
        """
        if shards is None:
            return
        empty = False
        try:
            empty = shard_is_empty(loader)
        except Exception as err:  # a loader that cannot start still agrees
            error = error or err
        weights = [*self.model.parameters(), *self.model.buffers()]
        agree_on_fit(
            shards,
            self._shared_settings(**settings),
            weights_checksum((w for w in weights if w.is_floating_point()), self._device),
            self._device,
            empty=empty,
            error=error,
        )

    def _passes_complement(self, update: bool) -> str:
        """The complement whose passes this rank will run (see
        :meth:`~laplace_glas.curvature.complement.passes.ComplementPass._complement_before_data`);
        a rank whose own checks failed may not know it (its status says so first).
        """
        try:
            return self._complement_before_data(update)
        except Exception:  # the failed rank raises its own error
            return "not known"

    def _shared_settings(
        self,
        k: int | None = None,
        update: bool = False,
        generator: torch.Generator | None = None,
        subsample_size: Any = None,
        tol: Any = None,
        maxiter: Any = None,
        ncv: Any = None,
    ) -> list[Setting]:
        """The settings every rank of a data-parallel fit must share (``None``: the
        constructor's).
        """
        pick = {"tol": tol, "maxiter": maxiter, "ncv": ncv, "subsample_size": subsample_size}
        pick = {name: getattr(self, name) if v is None else v for name, v in pick.items()}
        start = None if generator is None else generator_checksum(generator)
        return [
            Setting("n_components", k),
            Setting("override=False (an update)", update),
            Setting("solver", self.solver),
            Setting("likelihood", self.likelihood),
            Setting("loss_scaling", self.loss_scaling),
            Setting("complement", self.complement),
            Setting("complement's passes ('auto' before data)", self._passes_complement(update)),
            *loss_settings(self.loss_fn),
            Setting("diagonal_estimator", getattr(self, "diagonal_estimator", "exact")),
            Setting("curvature (the backend's matrix)", self.curvature.kind),
            Setting("prior precision's shape", tuple(torch.as_tensor(self.prior_precision).shape)),
            Setting("dtype", self._dtype),
            Setting("the number of parameters D", self.n_params),
            *(Setting(name, value) for name, value in pick.items()),
            Setting("block_size", self.block_size),
            Setting("rank_threshold", self.rank_threshold),
            Setting("ignore_index", self.ignore_index),
            Setting("the random start (generator state checksum)", start),
        ]
