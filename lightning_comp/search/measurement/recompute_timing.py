"""What re-running a recompute operator's forward in backward adds to a training step, timed directly.

The saved stage judges a recompute unit by its members' and consumers' forward and backward, saving as computed
against recomputing, in paired rounds. That ratio decides whether a unit is worth offering, but as a price it is the
difference of two times tens of milliseconds long for an addition of a few: on the default example (CharGPT, an AVX2
EPYC, three searches one after another) the four GELU units' price read 7.4, 27.2 and 5.7 ms, and which levers fitted
the room followed it. :class:`RecomputeTimes` times the addition itself: in each step of the configuration that
recomputes, every backward unpack that re-runs a recipe (or reads its re-run) is timed by the search's clock and
charged to the operator whose forward it re-runs
(:attr:`~lightning_comp.execution.recompute.recomputer.Recomputer.unpack_timer`). The same re-runs, timed in one
process by the wall clock over 13 steps, read a median of 12.0 and 12.5 ms for nine LayerNorms in two runs and
18.5 and 17.6 ms for four GELUs, where the whole steps' paired differences read -3 to +69 ms.

What it does not count: the recipe's bookkeeping in the forward (capturing the RNG state and the inputs' versions,
tens of microseconds per call) and any effect of the recomputation on other operators' times; the memory levers'
whole-step check of the plan they build sees both.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning_comp.execution.recompute import Recomputer
from lightning_comp.search.measurement.clocks import Clock
from lightning_comp.search.measurement.step_timing import entered

__all__ = ["RecomputeTimes"]


class RecomputeTimes:
    """Per measured step, the time each recompute operator's re-run took (ms), by ``clock``.

    Args:
        clock: the clock the rest of the measurement counts with.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.steps: list[dict[str, float]] = []

    def around(self, recomputer: Recomputer, activate: Callable[[], Any]) -> Callable[[], AbstractContextManager[None]]:
        """``activate`` (what puts a configuration in force for one step, as the profilers take it), with the
        re-runs of the step run inside timed, one entry of :attr:`steps` per step that completes."""

        @contextmanager
        def timed() -> Iterator[None]:
            marks: list[tuple[str, Any, Any]] = []
            open_reads = [0]  # a read inside a read (a recipe's input that is itself a recipe) is the outer's time

            @contextmanager
            def timer(name: str) -> Iterator[None]:
                if open_reads[0]:
                    yield
                    return
                open_reads[0] += 1
                start = self.clock.now()
                try:
                    yield
                finally:
                    open_reads[0] -= 1
                    marks.append((name, start, self.clock.now()))

            recomputer.unpack_timer = timer
            try:
                with entered(activate()):
                    yield
            finally:
                recomputer.unpack_timer = None
            self.clock.finish()
            step: dict[str, float] = {}
            for name, start, end in marks:
                step[name] = step.get(name, 0.0) + self.clock.elapsed_ms(start, end)
            self.steps.append(step)

        return timed

    def median_ms(self, names: Iterable[str], skip: int = 0) -> float | None:
        """The median, over the steps after the first ``skip`` (warm-up), of the time re-running ``names`` took per
        step (ms); ``None`` where no such step was timed."""
        wanted = set(names)
        per_step = [sum(ms for name, ms in step.items() if name in wanted) for step in self.steps[skip:]]
        return float(statistics.median(per_step)) if per_step else None
