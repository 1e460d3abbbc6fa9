"""How busy the machine is: the CPU time other processes take on the CPUs this process may run on.

Linux only (``/proc/stat`` per-CPU counters, restricted to ``os.sched_getaffinity``, minus this process's own CPU
time from ``os.times``); elsewhere the load is unknown (``None``). Steal time (a hypervisor running other guests)
counts as taken by others. The counters tick at ``SC_CLK_TCK`` (usually 100 Hz), so a window should last a few
tenths of a second.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_comp.errors import UsageError

__all__ = ["LoadMeter", "MachineLoad", "cpus_available"]

_STAT = Path("/proc/stat")


def cpus_available() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class MachineLoad:
    """The load over one window.

    Attributes:
        others_cpus: CPUs' worth of time other processes (and the hypervisor) took on this process's CPUs, on
            average; ``None`` where it cannot be read.
        own_cpus: CPUs' worth of time this process took.
        cpus: CPUs this process may run on.
        seconds: the window's length.
    """

    others_cpus: float | None
    own_cpus: float
    cpus: int
    seconds: float

    def describe(self) -> str:
        """E.g. ``"other processes used 1.9 of 2 CPUs"``."""
        if self.others_cpus is None:
            return "the load of other processes is unknown here"
        return f"other processes used {self.others_cpus:.2f} of {self.cpus} CPUs"


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy ticks (user, nice, system, irq, softirq, steal) summed over ``cpus``; ``None`` if unreadable."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    total = 0
    found = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *values = line.split()
        try:
            index = int(name[3:])
        except ValueError:
            continue
        if index not in cpus:
            continue
        ticks = [int(v) for v in values]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
        total += ticks[0] + ticks[1] + ticks[2] + sum(ticks[5:8])
        found += 1
    return total if found else None


class LoadMeter:
    """Measures :class:`MachineLoad` between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        try:
            self._cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            self._cpus = set()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: tuple[int | None, float, float] | None = None

    def start(self) -> None:
        """Open the window."""
        own = os.times()
        self._start = (_busy_ticks(self._cpus), own.user + own.system, time.perf_counter())

    def stop(self) -> MachineLoad:
        """Close the window and return its load.

        Raises:
            UsageError: if :meth:`start` was not called.
        """
        if self._start is None:
            raise UsageError("LoadMeter.stop() was called before start().")
        busy0, own0, wall0 = self._start
        busy1 = _busy_ticks(self._cpus)
        own = os.times()
        seconds = max(time.perf_counter() - wall0, 1e-9)
        own_seconds = own.user + own.system - own0
        others: float | None = None
        if busy0 is not None and busy1 is not None:
            # ticks and os.times() are both quantised to a tick per CPU: never report less than nothing
            others = max(0.0, ((busy1 - busy0) / self._tick - own_seconds) / seconds)
        return MachineLoad(others, own_seconds / seconds, len(self._cpus) or cpus_available(), seconds)
