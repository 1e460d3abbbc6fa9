"""Clocks for the batch stage: what a measurement of an operator or a step counts.

- :class:`WallClock`: elapsed real time (``time.perf_counter``) with the user's intra-op threads. What a training
  step really costs on a quiet machine; on a busy one it also counts the time other processes took.
- :class:`CudaClock`: CUDA events on the current stream: the GPU's own time, whatever the CPU is doing.
- :class:`ThreadCpuClock`: CPU time of the measuring thread (``time.thread_time``), used with the intra-op thread
  pool reduced to one thread (:func:`single_intra_op_thread`). It counts this process's work only: time the thread
  spends preempted by other processes is not counted. With several intra-op threads no CPU clock can do that, since
  a thread that waits at a parallel region's barrier for a preempted peer spins, and spinning is CPU time; measured
  on a 2-core CPU beside a competing process, both the process and the thread CPU time of a 2-thread step were
  inflated 30-100x by that spinning, and per-operator ratios inverted.

Each clock's timestamps also carry the wall time, so a CPU-time measurement can be reported beside wall time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any, Protocol

import torch

from lightning_comp.errors import UnsupportedSetupError

__all__ = ["Clock", "ClockKind", "CudaClock", "ThreadCpuClock", "WallClock", "make_clock", "single_intra_op_thread"]


class ClockKind(str, Enum):
    """Which clock a batch stage measured with."""

    WALL = "wall"  # real time, the user's intra-op threads
    CUDA = "cuda"  # CUDA events
    THREAD_CPU = "thread-cpu"  # CPU time of the measuring thread, one intra-op thread


class Clock(Protocol):
    """Timestamps and the milliseconds between two of them."""

    kind: ClockKind

    def now(self) -> Any:
        """A timestamp."""

    def finish(self) -> None:
        """Wait until the timestamps taken so far can be read (CUDA: synchronise)."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two timestamps, as this clock counts them."""

    def wall_ms(self, start: Any, end: Any) -> float:
        """Real milliseconds between two timestamps."""


class WallClock:
    """``time.perf_counter``."""

    kind = ClockKind.WALL

    def now(self) -> float:
        return time.perf_counter()

    def finish(self) -> None:
        return None

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    wall_ms = elapsed_ms


class CudaClock:
    """CUDA events recorded on the current stream (the GPU's time; also the wall time that is reported)."""

    kind = ClockKind.CUDA

    def now(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        torch.cuda.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))

    wall_ms = elapsed_ms


class ThreadCpuClock:
    """CPU time of the calling thread, with the wall time beside it (timestamps are ``(cpu, wall)`` pairs).

    Autograd runs a CPU backward in the thread that calls ``backward()``, so forward hooks and gradient hooks read
    the same thread's clock.
    """

    kind = ClockKind.THREAD_CPU

    def now(self) -> tuple[float, float]:
        return time.thread_time(), time.perf_counter()

    def finish(self) -> None:
        return None

    def elapsed_ms(self, start: tuple[float, float], end: tuple[float, float]) -> float:
        return (end[0] - start[0]) * 1e3

    def wall_ms(self, start: tuple[float, float], end: tuple[float, float]) -> float:
        return (end[1] - start[1]) * 1e3


def make_clock(kind: ClockKind) -> Clock:
    """The clock of ``kind``.

    Raises:
        UnsupportedSetupError: for the CUDA clock when CUDA is not available.
    """
    if kind is ClockKind.CUDA:
        if not torch.cuda.is_available():
            raise UnsupportedSetupError("The CUDA clock was asked for, but torch.cuda.is_available() is False.")
        return CudaClock()
    if kind is ClockKind.THREAD_CPU:
        return ThreadCpuClock()
    return WallClock()


@contextmanager
def single_intra_op_thread(enabled: bool = True) -> Iterator[None]:
    """Run the block with one intra-op thread (``torch.set_num_threads(1)``), then restore the user's count."""
    before = torch.get_num_threads()
    if enabled and before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
