"""What a memory lever adds to a training step, timed directly: a recomputation's re-runs, a codec's casts.

The saved stage judges a recompute unit, and a codec of what an operator saves, by the operators' forward and
backward with and without it, in paired rounds. That ratio decides whether a unit is worth offering, but as a price
it is the difference of two times tens of milliseconds long for an addition of a few: on the default example
(CharGPT, an AVX2 EPYC, three searches one after another) the four GELU units' price read 7.4, 27.2 and 5.7 ms, and the
bf16 codec's cost model, fitted over every operator, 0.44, 0.63 and 0.23 ms per MiB; which levers fitted the room
followed them. :class:`DirectTimes` times the addition itself, step by step, by the search's clock: in each step of a
configuration, every backward unpack that re-runs a recipe (or reads its re-run)
(:attr:`~lightning_comp.execution.recompute.recomputer.Recomputer.unpack_timer`), or every compression in the forward
and decompression in backward (:attr:`~lightning_comp.execution.saved_tensors.SavedTensorCompressor.codec_timer`), is
charged to the operator whose forward or saved tensor it is. The re-runs of the default example's model, timed in
one process by the wall clock over 13 steps, read a median of 12.0 and 12.5 ms for nine LayerNorms in two runs and
18.5 and 17.6 ms for four GELUs, where the whole steps' paired differences read -3 to +69 ms.

What it does not count: a recipe's bookkeeping in the forward (capturing the RNG state and the inputs' versions, tens
of microseconds per call), the hooks' own calls, and any effect of the lever on other operators' times (memory
traffic, the allocator); the memory levers' whole-step check of the plan they build sees all of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning_comp.errors import UsageError
from lightning_comp.execution.saved_hooks import HookTimer
from lightning_comp.search.measurement.clocks import Clock
from lightning_comp.search.measurement.step_timing import entered

__all__ = ["DirectTimes"]


class DirectTimes:
    """Per measured step, the time each operator's timed work took (ms), by ``clock``.

    Args:
        clock: the clock the rest of the measurement counts with.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.steps: list[dict[str, float]] = []

    def around(self, install: Callable[[HookTimer | None], None], activate: Callable[[], Any],
               ) -> Callable[[], AbstractContextManager[None]]:
        """``activate`` (what puts a configuration in force for one step, as the profilers take it), with the work
        ``install`` hands its timer to (``None`` after the step) timed in the step run inside, one entry of
        :attr:`steps` per step that completes."""

        @contextmanager
        def timed() -> Iterator[None]:
            marks: list[tuple[str, Any, Any]] = []
            open_reads = [0]  # work inside timed work (a recipe's input that is itself a recipe) is the outer's time

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

            install(timer)
            try:
                with entered(activate()):
                    yield
            finally:
                install(None)
            self.clock.finish()
            step: dict[str, float] = {}
            for name, start, end in marks:
                step[name] = step.get(name, 0.0) + self.clock.elapsed_ms(start, end)
            self.steps.append(step)

        return timed

    def median_ms(self, names: Iterable[str], skip: int = 0) -> float | None:
        """The median, over the steps after the first ``skip`` (warm-up), of the time the work of ``names`` took per
        step (ms); ``None`` where no such step was timed."""
        per_step = self._per_step(names, skip)
        return float(statistics.median(per_step)) if per_step else None

    def median_share(self, names: Iterable[str], reference_ms: Sequence[float], skip: int = 0) -> float | None:
        """The median, over the steps after the first ``skip``, of the time the work of ``names`` took as a share of
        the reference step timed in the same round (``reference_ms``, one per step after ``skip``, in order: the
        plan without the lever, profiled beside it).

        A share is what the bound is in (a multiple of a step): times measured in other rounds than the step the
        bound is a multiple of follow the machine's load between them, shares measured within one round do not.

        Raises:
            UsageError: ``reference_ms`` does not hold one step per timed step (rounds not paired).
        """
        per_step = self._per_step(names, skip)
        if len(per_step) != len(reference_ms):
            raise UsageError(f"{len(reference_ms)} reference steps for {len(per_step)} timed steps (after {skip}"
                             " warm-up): the reference must be timed in the same rounds, one step each")
        shares = [ms / ref for ms, ref in zip(per_step, reference_ms, strict=True) if ref > 0]
        return float(statistics.median(shares)) if shares else None

    def _per_step(self, names: Iterable[str], skip: int) -> list[float]:
        wanted = set(names)
        return [sum(ms for name, ms in step.items() if name in wanted) for step in self.steps[skip:]]
