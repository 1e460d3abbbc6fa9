"""Which clock the batch stage measures with, and why: the answer to a busy machine.

On a quiet CPU, wall time with the user's intra-op threads is the truth: it is what a training step costs. Once
other processes compete for the CPUs, wall time measures them as much as the model, and no CPU clock can help while
several intra-op threads run (see :mod:`lightning_comp.search.measurement.clocks`). The batch stage then measures with
the CPU time of the measuring thread and one intra-op thread, which is blind to the neighbours. ``timing="auto"``
chooses from the load measured over the first fp32 steps, and the batch stage measures again while it works: if the
machine became busy during a wall-time measurement, that measurement is repeated with the CPU clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_comp.search.config import Timing
from lightning_comp.search.measurement.clocks import Clock, ClockKind, make_clock
from lightning_comp.search.measurement.machine_load import LoadMeter, MachineLoad

__all__ = ["BUSY_CPUS", "TimingChoice", "choose_timing", "is_busy", "sample_load"]

BUSY_CPUS = 0.5  # other processes using half a CPU or more, on average, make the machine busy
_SAMPLE_SECONDS = 0.25
_SAMPLE_MAX_STEPS = 20


@dataclass(frozen=True)
class TimingChoice:
    """The clock of a batch stage.

    Attributes:
        clock: what a millisecond counts.
        single_thread: whether measurements run with one intra-op thread.
        reason: why this clock (for the record).
        load: the load that decided it, if measured.
    """

    clock: ClockKind
    single_thread: bool
    reason: str
    load: MachineLoad | None = None

    def make_clock(self) -> Clock:
        """A clock of this kind."""
        return make_clock(self.clock)

    def to_dict(self) -> dict[str, Any]:
        """For the decision record."""
        load = self.load
        return {"clock": self.clock.value, "threads": 1 if self.single_thread else torch.get_num_threads(),
                "reason": self.reason,
                "others_cpus": None if load is None or load.others_cpus is None else round(load.others_cpus, 3),
                "cpus": None if load is None else load.cpus}


def is_busy(load: MachineLoad | None) -> bool:
    """Whether other processes took :data:`BUSY_CPUS` or more over the window."""
    return load is not None and load.others_cpus is not None and load.others_cpus >= BUSY_CPUS


def sample_load(step: Callable[[], None], agree: Callable[[bool], bool] = bool) -> MachineLoad:
    """The load while ``step`` runs repeatedly, for at least a quarter of a second (at most 20 steps).

    ``agree`` turns this rank's "one more step?" into every rank's (rank 0's): under a sharded strategy a step holds
    collectives, so every rank must run as many."""
    meter = LoadMeter()
    meter.start()
    started = time.perf_counter()
    steps = 0
    while steps < 1 or agree(time.perf_counter() - started < _SAMPLE_SECONDS and steps < _SAMPLE_MAX_STEPS):
        step()
        steps += 1
    if time.perf_counter() - started < _SAMPLE_SECONDS:  # short steps: let the tick counters see a real window
        time.sleep(_SAMPLE_SECONDS - (time.perf_counter() - started))
    return meter.stop()


def cpu_clock(reason: str, load: MachineLoad | None = None) -> TimingChoice:
    """The busy-machine clock."""
    return TimingChoice(ClockKind.THREAD_CPU, True, reason, load)


def choose_timing(setting: Timing, device_type: str, load: Callable[[], MachineLoad]) -> TimingChoice:
    """The clock for a batch stage on ``device_type`` (``load`` is called only when the choice depends on it)."""
    if device_type == "cuda":
        return TimingChoice(ClockKind.CUDA, False, "CUDA events (the GPU's own time)")
    if device_type != "cpu":
        return TimingChoice(ClockKind.WALL, False, f"wall time (no better clock for {device_type!r} devices)")
    if setting is Timing.WALL:
        return TimingChoice(ClockKind.WALL, False, "wall time, as asked (timing='wall')")
    if setting is Timing.CPU:
        return cpu_clock("this process's CPU time with one intra-op thread, as asked (timing='cpu')")
    measured = load()
    if is_busy(measured):
        return cpu_clock(f"this process's CPU time with one intra-op thread: the machine is busy"
                         f" ({measured.describe()})", measured)
    return TimingChoice(ClockKind.WALL, False, f"wall time: the machine is quiet ({measured.describe()})", measured)
