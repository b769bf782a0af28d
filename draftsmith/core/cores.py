"""Keep compute threads off CPU cores another process is using.

vLLM's CPU build and torch run one OpenMP thread per core, and each parallel region waits
for its slowest thread. When another process keeps one core of a 2-core machine busy, the
thread on that core gets a time slice now and then, and everything waits for it: measured
here, a busy loop on one core took vLLM's extraction from 125 to 24 stored tokens/s (5.2x
slower), where one thread on the free core would lose about half. ``avoid_busy_cores``
measures each core for a moment and, when some are busy and some are not, restricts this
process (and the processes it starts, vLLM's workers included: they bind to the allowed
cores) to the free ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

BUSY = 0.8  # a core this busy, while we are idle, belongs to someone else
_allowed: set[int] | None = None  # the cores this process could use when first asked


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """(total, idle) ticks of each core so far (Linux /proc/stat)."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks = [int(x) for x in fields]
                out[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])  # idle + iowait
    return out


def busy_between(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
                 ) -> dict[int, float]:  # fmt: skip
    """Busy fraction of each core between two ``cpu_ticks`` samples."""
    load = {}
    for cpu, (total, idle) in after.items():
        d_total, d_idle = total - before[cpu][0], idle - before[cpu][1]
        load[cpu] = 1.0 - d_idle / d_total if d_total > 0 else 0.0
    return load


def core_load(seconds: float = 0.5) -> dict[int, float]:
    """Busy fraction of each core over ``seconds`` (Linux /proc/stat; {} elsewhere)."""
    try:
        before = cpu_ticks()
        time.sleep(seconds)
        return busy_between(before, cpu_ticks())
    except OSError:
        return {}


def avoid_busy_cores(
    seconds: float = 0.5, measure: Callable[[float], dict[int, float]] = core_load
) -> str | None:
    """Restrict this process to the cores that are not busy (all of them when none or all
    are), measured now by ``measure`` (:func:`core_load`); returns a line saying what it
    did, or None when nothing changed. Call it while this process is idle (before an
    engine or a training run starts)."""
    global _allowed
    if not hasattr(os, "sched_setaffinity"):
        return None
    if _allowed is None:
        _allowed = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, _allowed)  # measure and decide afresh every time
    load = measure(seconds)
    busy = sorted(c for c in _allowed if load.get(c, 0.0) >= BUSY)
    free = sorted(_allowed - set(busy))
    if not busy or not free:
        return None
    os.sched_setaffinity(0, free)
    shown = ", ".join(f"{c} ({load[c]:.0%})" for c in busy)
    which = "cores" if len(busy) > 1 else "core"
    return f"{which} {shown} busy with another process: compute threads on {free} only"


def regain_cores(load: dict[int, float]) -> str | None:
    """Give this process back the cores ``avoid_busy_cores`` left out once none of them is
    busy in ``load`` (their load is other processes': this one is not on them); returns a
    line saying so, or None when nothing changed."""
    if _allowed is None or not hasattr(os, "sched_setaffinity"):
        return None
    left_out = _allowed - set(os.sched_getaffinity(0))
    if not left_out or any(load.get(c, 0.0) >= BUSY for c in left_out):
        return None
    os.sched_setaffinity(0, _allowed)
    return f"core(s) {sorted(left_out)} free again: compute threads on {sorted(_allowed)}"


def allowed_cores() -> set[int]:
    """The cores this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def producer_cores(cores: set[int] | None = None) -> set[int] | None:
    """The cores a streamed run's producer gets beside its trainer on one CPU machine: the
    upper half of ``cores`` (this process's, by default); None on a single core. The trainer
    keeps the rest while the producer writes and takes all of them while it waits
    (``draftsmith.train.share_cores``)."""
    ordered = sorted(allowed_cores() if cores is None else cores)
    if len(ordered) < 2:
        return None
    return set(ordered[len(ordered) // 2 :])
