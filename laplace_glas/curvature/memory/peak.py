"""The measured peak memory of a fit, and the warning when it passes the budget.

:class:`PeakMemory` measures the peak of a fit above the memory in use when it starts:
on CUDA ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``
(so a caller's own peak statistics restart there too); on the host the resident set's
high-water mark ``VmHWM`` of ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs`` (Linux). Where the reset is not permitted the peak is known
only when it exceeds the process's earlier high-water mark; otherwise, and off Linux,
it is ``None`` (recorded as ``-1``). ``tracemalloc`` is no substitute: it sees neither
torch's nor BLAS's allocations. The host figure counts the whole process (other
threads, libraries loaded during the fit, memory the allocator keeps), so it can
exceed the estimate, by up to :data:`~laplace_glas.curvature.memory.budget.HOST_SLACK`. A fit
whose measured peak exceeds its budget by more (on CUDA: at all) warns
(:func:`with_measured_peak`): the estimates are projections, and a model whose later
batches or backward passes take more than they project is told rather than left to
find out.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import replace

import torch

from laplace_glas.curvature.memory.budget import HOST_SLACK, format_bytes

__all__ = ["PeakMemory", "reset_high_water_mark", "status_bytes", "with_measured_peak"]


def status_bytes(key: str) -> int | None:
    """The ``key`` line of ``/proc/self/status`` (``'VmRSS'``, ``'VmHWM'``) in bytes, or
    ``None`` where it cannot be read (off Linux).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_high_water_mark() -> bool:
    """Reset the process's ``VmHWM`` to its current resident set (write ``5`` to
    ``/proc/self/clear_refs``); False where that is not permitted.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Context manager: the peak bytes in use above the start (see the module).

    After the block, ``bytes`` is the measured peak (``None`` where it cannot be
    measured) and ``method`` says how: ``'cuda'``, ``'VmHWM'`` or ``'none'``.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self.method = "none"

    def __enter__(self) -> PeakMemory:
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._high_before = status_bytes("VmHWM")
        self._reset = reset_high_water_mark()
        self._start = status_bytes("VmRSS")
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: types.TracebackType):
        if self._cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.bytes, self.method = max(0, int(peak - self._start)), "cuda"
            return
        high = status_bytes("VmHWM")
        if high is None or self._start is None:
            return
        if self._reset or (self._high_before is not None and high > self._high_before):
            self.bytes, self.method = max(0, high - self._start), "VmHWM"


def with_measured_peak(eig, peak: PeakMemory):
    """``eig`` (an :class:`~laplace_glas.curvature.solvers.eigenpairs.Eigenpairs`) with the
    measured peak in its plan: ``measured_peak_bytes`` (``-1``: not measurable) and
    ``peak_method`` (``'cuda'``, ``'VmHWM'`` or ``'none'``).

    Warns where the peak exceeds the plan's budget by more than the process's own
    allocations may (:data:`~laplace_glas.curvature.memory.budget.HOST_SLACK` on the host,
    nothing on CUDA), naming the strategy's estimate and, where the overrun is at most
    half the budget, a budget that would leave the missing room.
    """
    measured = {
        "measured_peak_bytes": -1 if peak.bytes is None else int(peak.bytes),
        "peak_method": peak.method,
    }
    plan = {**(eig.plan or {}), **measured}
    budget = int(plan.get("budget_bytes", -1))
    slack = HOST_SLACK if peak.method == "VmHWM" else 0
    if peak.bytes is not None and budget > 0 and peak.bytes > budget + slack:
        estimate = int(plan.get("estimated_peak_bytes", -1))
        smaller = budget - (peak.bytes - budget)
        advice = (
            f"Where the budget is a hard limit, memory_budget={smaller} "
            f"({format_bytes(smaller)}) leaves the missing room."
            if 2 * smaller >= budget
            else "The estimate missed by more than half the budget, so no smaller budget "
            "is sure to hold: give the fit a loader whose first batch is as large as the "
            "rest, or a budget the measured peak fits."
        )
        warnings.warn(
            f"The fit's measured peak {format_bytes(peak.bytes)} exceeded memory_budget="
            f"{budget} ({format_bytes(budget)}) by {format_bytes(peak.bytes - budget)}: "
            f"the {plan.get('strategy') or 'chosen'} strategy's estimate"
            + (f" ({format_bytes(estimate)})" if estimate >= 0 else "")
            + " was low for this model and data (later batches larger than the first, "
            "a backward pass that takes more than its graph, or on the host memory "
            "the process took for itself during its first pass). " + advice,
            UserWarning,
            stacklevel=3,
        )
    return replace(eig, plan=plan)
