"""Spending a step-time allowance on the cheapest bytes first (the memory objective, with or without a budget).

Every memory lever the batch stage measured (an operator's saved precision, a recompute unit, an operator's
optimizer state and master weights) is a :class:`Lever`: a few mutually exclusive :class:`LeverOption` values, each
with the bytes it frees from the step's peak and the time it adds per step (the median of its paired
rounds). :func:`take_cheapest` ranks the options of all levers together by bytes freed per millisecond added and
takes them, cheapest bytes first, while the step stays within the time allowed, until the bytes wanted are freed.
An option that adds no time is taken even where the step starts past the allowance (the base plan, timed once more
with the update added, can end just past it): it cannot carry the step further past.

The options of one lever are climbed as increments along their lower convex hull (bytes against time): a larger
option is reached through the smaller ones when that is the cheaper way to its bytes, and an option that frees fewer
bytes per millisecond than a larger one is skipped, so the increments of one lever come in falling order of value and
the ranking over all levers stays consistent (the greedy rule of the multiple-choice knapsack). Options that free
bytes at no measured cost come first. Each step taken is a point of the *frontier* (bytes against step time) the
record keeps and the figure draws.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.codec_costs import CodecCost
from lightning_comp.search.decisions.update_costs import UpdateCost
from lightning_comp.search.measurement.process_memory import StepPeak

__all__ = ["FrontierPoint", "Lever", "LeverOption", "MemorySpending", "OtherBase", "Selection", "levers_past",
           "take_cheapest"]


@dataclass(frozen=True)
class LeverOption:
    """One value a lever may take.

    Attributes:
        value: the value in the plan's words (``"fp8"``, ``"recompute"``, ``"8bit"``, ``"8bit+bf16 master"``).
        bytes_saved: bytes it frees from the step's peak.
        extra_ms: time it adds per step (ms; 0 or less: free).
    """

    value: str
    bytes_saved: float
    extra_ms: float


@dataclass(frozen=True)
class Lever:
    """One memory lever: what the search may change in one dimension of one operator (or unit of operators).

    Attributes:
        label: its name in the record, e.g. ``"saved:blocks.*.mlp.fc1"`` or ``"state:head"``.
        options: its values, mutually exclusive.
        forced: ``CoMPSearch(include_dimensions=...)`` named it: its largest option is taken first, whatever it costs.
    """

    label: str
    options: tuple[LeverOption, ...]
    forced: bool = False

    def increments(self) -> list[tuple[LeverOption, float, float]]:
        """The options climbed along the lower convex hull: ``(option, bytes added, ms added)``, best value first."""
        options = sorted((o for o in self.options if o.bytes_saved > 0), key=lambda o: (o.bytes_saved, o.extra_ms))
        steps: list[tuple[LeverOption, float, float]] = []
        at_bytes, at_ms = 0.0, 0.0
        while True:
            ahead = [o for o in options if o.bytes_saved > at_bytes]
            if not ahead:
                return steps
            best = max(ahead, key=lambda o: (_value(o.bytes_saved - at_bytes, o.extra_ms - at_ms), o.bytes_saved))
            steps.append((best, best.bytes_saved - at_bytes, best.extra_ms - at_ms))
            at_bytes, at_ms = best.bytes_saved, best.extra_ms


@dataclass(frozen=True)
class FrontierPoint:
    """The step after one more increment is taken.

    Attributes:
        lever: the lever it changed.
        value: the value that lever now takes.
        step_bytes: the step's bytes (peak accounting) after it.
        step_ms: the step's time after it.
        bytes_per_ms: what the increment freed per millisecond it added (``inf``: free; ``nan``: forced).
        past_bound: taken past the time allowed, for a budget not met within it.
    """

    lever: str
    value: str
    step_bytes: float
    step_ms: float
    bytes_per_ms: float
    past_bound: bool = False


@dataclass
class Selection:
    """What :func:`take_cheapest` took.

    Attributes:
        chosen: lever label -> the option it takes (levers left out keep their own value).
        frontier: the step before anything was taken, then after each increment taken, in order.
        skipped: lever label -> why its next increment was not taken.
        stopped: why the selection ended, in words.
        met: whether the bytes wanted were freed (``True`` with no target).
    """

    chosen: dict[str, LeverOption] = field(default_factory=dict)
    frontier: list[FrontierPoint] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    stopped: str = ""
    met: bool = True


@dataclass(frozen=True)
class OtherBase:
    """The end the levers reached on the plan not kept as their base.

    Attributes:
        base: that plan, in words.
        start_bytes: its step bytes before the levers.
        final_bytes: its step bytes with its levers.
        end_ms: its step time with them.
        max_ms: the slowest step it was allowed.
        met: whether it met the budget (``True`` with none).
        why: why the kept base's end is the better one, in words.
    """

    base: str
    start_bytes: float
    final_bytes: float
    end_ms: float
    max_ms: float
    met: bool
    why: str


@dataclass
class MemorySpending:
    """What the memory objective spent its step time on (the record's ``memory_spending``).

    Attributes:
        start_bytes: the candidate plan's step bytes (weights, gradients, optimizer state, saved for backward).
        start_ms: its step time (forward, backward and the optimizer's own update), ms.
        max_ms: the slowest step allowed (``inf``: no bound).
        bound_of: what ``max_ms`` is ``max_slowdown_vs_fastest`` of, in words: the pace (the fastest fixed policy), or
            the plan before the levers where the batch stage's rounds could not tell its step from the pace's.
        target_bytes: the step bytes ``memory_budget`` asks for (``None``: no budget).
        amp_step_bytes: AMP's step bytes, the same accounting (what a fractional budget is a fraction of).
        selection: what was taken, the frontier, and why it stopped.
        final_bytes: the chosen plan's step bytes, after anything given back.
        forecast_ms: the chosen plan's step as the levers' measurements add up.
        measured_ms: the same step timed whole (forward and backward measured, updates added; ``None``: not timed).
        measured_fast_ms: the same at the fast end of the whole-step rounds' interval: levers are given back only
            where it is past ``max_ms`` (``None``: not timed).
        given_back: levers the whole-step check gave back (the forecast was too kind), in the order they were taken.
        levers: lever label -> the candidates (dimension and operator) it changes.
        options: lever label -> its options, as measured.
        process_peaks: the peak the process needed for one step (rank 0's), of the plan before the levers
            (``"start"``), with them (``"plan"``) and, for a fractional budget, of AMP's plan (``"amp"``); empty
            where nothing was taken and no budget is set.
        process_target_bytes: a budget is judged by the plan's measured peak (a budget in bytes by the allocator's
            reserved peak on CUDA, the live heap on a CPU; a fraction by the tensor peaks of the plan's and AMP's
            steps): the step bytes the levers were taken down to so that the measured peak meets it (``None``: no
            budget, or the accounting's target sufficed).
        process_met: whether the plan's measured peak meets the budget (``None``: no budget, or the peak could not
            be measured here).
        process_limit_bytes: what the plan's measured peak was held to: a budget in bytes, or the fraction of AMP's
            step's measured tensor peak (``None``: not judged by a measured peak).
        process_reference: whose measured tensor peak a fractional budget was a fraction of: ``"amp"`` (AMP's plan)
            or ``"start"`` (the plan before the levers, where AMP's was not timed); ``None``: a budget in bytes, or
            none judged.
        update_costs: update variant (``"8bit"``, ``"bf16"``, ``"master"``) -> what it adds to an update, fitted
            over every operator (:mod:`~lightning_comp.search.decisions.update_costs`): the state and master levers'
            prices.
        codec_costs: saved codec (``"bf16"``, ``"fp8"``) -> what it adds to a step, fitted over every operator
            (:mod:`~lightning_comp.search.decisions.codec_costs`): the codec levers' prices.
        other_base: where the levers were also spent on another plan before these (the candidates beside an
            alternative the base rule chose): that plan's end, :class:`OtherBase` (``None``: none; kept while the run
            lives, not in a checkpoint).
    """

    start_bytes: float
    start_ms: float
    max_ms: float
    target_bytes: float | None
    amp_step_bytes: float | None
    selection: Selection
    final_bytes: float = 0.0
    forecast_ms: float = 0.0
    measured_ms: float | None = None
    measured_fast_ms: float | None = None
    given_back: list[str] = field(default_factory=list)
    levers: dict[str, list[Candidate]] = field(default_factory=dict)
    options: dict[str, list[LeverOption]] = field(default_factory=dict)
    process_peaks: dict[str, StepPeak] = field(default_factory=dict)
    process_target_bytes: float | None = None
    process_met: bool | None = None
    process_limit_bytes: float | None = None
    process_reference: str | None = None
    update_costs: dict[str, UpdateCost] = field(default_factory=dict)
    codec_costs: dict[str, CodecCost] = field(default_factory=dict)
    bound_of: str = ""
    other_base: OtherBase | None = field(default=None, init=False)

    @property
    def end_ms(self) -> float:
        """The step's time with the levers kept (after any given back), as their measurements add up."""
        return self.start_ms + sum(option.extra_ms for option in self.selection.chosen.values())

    @property
    def within_bound(self) -> bool:
        """Whether the step with the levers kept is within the time allowed (by the levers' forecast)."""
        return self.end_ms <= self.max_ms * (1 + 1e-9)


def take_cheapest(levers: list[Lever], step_bytes: float, step_ms: float, max_ms: float,
                  target_bytes: float | None = None, past_bound: bool = False, weigh_time: bool = False) -> Selection:
    """Take the levers' options, most bytes per millisecond first, within ``max_ms`` and until ``target_bytes``.

    Args:
        levers: what may be taken.
        step_bytes: the step's bytes before anything is taken.
        step_ms: the step's time before anything is taken.
        max_ms: the slowest step allowed (``inf``: no bound).
        target_bytes: stop once the step's bytes are at most this (``None``: take every lever that fits).
        past_bound: where ``target_bytes`` is not met within ``max_ms``, go on past it, still cheapest first (a
            budget the job needs to fit at all); the frontier marks those points.
        weigh_time: take an increment only where it makes the step better in time x memory (the balanced
            objective): the step's bytes times its time fall, i.e. the share of the step's bytes it frees exceeds the
            share of time it adds (a free increment always does). A lever whose increment does not is left where it
            is (its larger options cost more still).

    Returns:
        The options taken, the frontier, and why it stopped.
    """
    selection = Selection(frontier=[FrontierPoint("", "", step_bytes, step_ms, math.inf)])
    queue: list[tuple[float, int, int]] = []  # (-value, lever index, increment index)
    steps = [lever.increments() for lever in levers]
    for index, lever in enumerate(levers):
        if lever.forced and steps[index]:  # forced: its largest option at once
            largest = steps[index][-1][0]  # the hull ends at the option freeing the most bytes
            step_bytes -= largest.bytes_saved
            step_ms += max(largest.extra_ms, 0.0)
            selection.chosen[lever.label] = largest
            selection.frontier.append(FrontierPoint(lever.label, largest.value, step_bytes, step_ms, math.nan))
        elif steps[index]:
            heapq.heappush(queue, (-_value(steps[index][0][1], steps[index][0][2]), index, 0))
    bound = max_ms
    deferred: list[tuple[float, int, int]] = []
    while queue or deferred:
        if not queue:  # what the bound deferred: taken past it only for a budget not met
            if not (past_bound and target_bytes is not None and step_bytes > target_bytes):
                break
            bound, queue, deferred = math.inf, deferred, []
            heapq.heapify(queue)
            for label in [levers[i].label for _, i, _ in queue]:
                selection.skipped.pop(label, None)
        if target_bytes is not None and step_bytes <= target_bytes:
            break
        negative, index, at = heapq.heappop(queue)
        lever = levers[index]
        option, added_bytes, added_ms = steps[index][at]
        if added_ms > 0 and step_ms + added_ms > bound:  # one that adds no time is taken even past the bound
            selection.skipped[lever.label] = (f"{option.value} would add {added_ms:.3f} ms, past the"
                                              f" {max_ms:.3f} ms allowed (the step at {step_ms:.3f} ms)")
            deferred.append((negative, index, at))  # its larger options cost more still: the lever stays there
            continue
        if weigh_time and added_ms > 0 and (step_bytes - added_bytes) * (step_ms + added_ms) >= step_bytes * step_ms:
            selection.skipped[lever.label] = (
                f"{option.value} would free {100 * added_bytes / step_bytes:.1f} % of the step's bytes for"
                f" {100 * added_ms / step_ms:.1f} % more time: not better in time x memory")
            continue
        step_bytes -= added_bytes
        step_ms += added_ms
        selection.chosen[lever.label] = option
        selection.frontier.append(FrontierPoint(lever.label, option.value, step_bytes, step_ms, -negative,
                                                past_bound=added_ms > 0 and step_ms > max_ms))
        if at + 1 < len(steps[index]):
            _, more_bytes, more_ms = steps[index][at + 1]
            heapq.heappush(queue, (-_value(more_bytes, more_ms), index, at + 1))
    selection.met = target_bytes is None or step_bytes <= target_bytes
    mib = f"{step_bytes / 2**20:.1f} {'<=' if selection.met else '>'} {(target_bytes or 0) / 2**20:.1f} MiB"
    beyond = any(point.past_bound for point in selection.frontier)
    if target_bytes is not None and selection.met:
        selection.stopped = f"the budget is met ({mib})" + (
            f", past the {max_ms:.3f} ms allowed (the step at {step_ms:.3f} ms)" if beyond else "")
    elif selection.skipped and weigh_time and not deferred:
        selection.stopped = "every lever left costs more time than it frees bytes (time x memory)"
    elif selection.skipped:
        selection.stopped = (f"the time allowed is spent ({step_ms:.3f} of {max_ms:.3f} ms)" +
                             ("" if target_bytes is None else f"; the budget is not met ({mib})"))
    else:
        selection.stopped = "every lever that frees bytes is taken" + (
            "" if selection.met else f"; the budget is not met ({mib})")
    return selection


def levers_past(selection: Selection, start_ms: float, max_ms: float, measured_ms: float,
                measured_fast_ms: float | None = None) -> dict[str, str | None]:
    """The levers to step back when the plan, timed whole, ran at ``measured_ms`` (by the median of its rounds;
    ``measured_fast_ms`` at their interval's fast end) rather than the frontier's forecast: the forecast's error (the
    time the levers added, measured over forecast) shrinks the time allowance in proportion, and every increment taken
    past the shrunk allowance is given back (forced levers stay, and so do increments measured to add no time).

    Returns:
        lever label -> the value it falls back to (its last increment within the allowance), or ``None`` where it
        gives back everything; empty when the plan is within ``max_ms`` as measured, or within the rounds' doubt of
        it (``measured_fast_ms`` not past ``max_ms``: the forecast stands).
    """
    if measured_ms <= max_ms or (measured_fast_ms is not None and measured_fast_ms <= max_ms):
        return {}
    forecast_ms = selection.frontier[-1].step_ms
    error = max((measured_ms - start_ms) / max(forecast_ms - start_ms, 1e-9), 1.0)
    allowance = (max_ms - start_ms) / error
    within: dict[str, str] = {}
    past: dict[str, str | None] = {}
    for point in selection.frontier[1:]:
        if math.isnan(point.bytes_per_ms):
            continue  # forced
        if math.isinf(point.bytes_per_ms) or point.step_ms - start_ms <= allowance:
            within[point.lever] = point.value
        else:
            past[point.lever] = within.get(point.lever)
    return past


def _value(added_bytes: float, added_ms: float) -> float:
    """Bytes freed per millisecond added (``inf`` where it adds no time)."""
    if added_ms <= 0:
        return math.inf
    return added_bytes / added_ms
