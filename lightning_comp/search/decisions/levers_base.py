"""The plan the memory levers build on (their *base*), and which of two bases' ends is kept.

Where the memory or balanced objective spends memory levers on its plan (a ``saved``, ``state`` or ``master`` dimension
is searched), the whole-step plan it builds on is chosen for what it will end at once the levers are spent, not for its
own bytes alone: the levers buy bytes with the time left under the bound, so a faster plan is worth the bytes that time
buys. :func:`base_for_the_levers` prices that time at the incumbent's (the candidates') own saved bytes per millisecond
of its step, a plan's *cost* being its saved bytes plus the incumbent's times its step relative to the incumbent's (by
the median of their paired rounds): a plan displaces the candidates where it costs less and is not slower than them by
more than the margin. Bytes are exact and only the time is noisy, and it is weighed by the bytes it buys: on the default
example the compute-only plan keeps 21 MiB more than the candidates and would have to be x0.79 of their step to displace
them, where the rule before (the leanest of the plans the fastest does not beat by the margin) took it at x0.93 in one
of four runs and ended 22 MiB fatter. A base chosen as the leanest within the bound (the rule before that) left the
levers little time: all-low's plan (x1.10-1.19 of the pace) left them 14 ms where the candidates' left 43 ms.

That price is still a guess: the levers buy bytes at 2-10x the candidates' average rate. Where it chooses another
plan than the candidates and they are in the contest, or keeps them by less than the margin of cost over the
runner-up (:func:`measured_beside`), the batch stage spends the levers on both plans and keeps the better end
(:func:`better_end`).
"""

from __future__ import annotations

from typing import Protocol

from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.decisions.cheapest_bytes import MemorySpending
from lightning_comp.search.decisions.whole_step import ComparedPlan, StepComparison
from lightning_comp.search.measurement.estimates import Verdict

__all__ = ["BaseJudge", "base_for_the_levers", "better_end", "measured_beside"]

FP32, CANDIDATES = ComparedPlan.FP32, ComparedPlan.CANDIDATES


class BaseJudge(Protocol):
    """What the base rule reads of an objective's policy
    (:class:`~lightning_comp.search.decisions.objectives.ObjectivePolicy`)."""

    config: SearchConfig

    @property
    def spends_levers(self) -> bool: ...

    def bound_holds(self, steps: StepComparison, plan: ComparedPlan) -> Verdict: ...

    def leaves_room(self, steps: StepComparison, plan: ComparedPlan) -> bool: ...

    def candidates_pay(self, steps: StepComparison) -> Verdict: ...


def base_for_the_levers(judge: BaseJudge, steps: StepComparison, saved: dict[ComparedPlan, float],
                        labels: list[ComparedPlan], have_candidates: bool) -> ComparedPlan | None:
    """Where levers are spent, the plan (of those not past the bound beyond doubt; of all where every one is) that
    should end leanest once they are, by cost (see the module docstring; ``None``: the candidates, or FP32).

    An alternative whose median step is at or past the bound (``leaves_room``) is no base while the candidates or
    another plan are in the contest: the room the levers get is measured by the medians, so it would leave them none,
    whatever it saves. Seen on the default example: all-low's plan, 24 MiB leaner than the candidates and x1.153 of
    the pace by the median (1.15 allowed, the interval straddling it), displaced them; the levers had 0.3 ms and the
    plan ended at 118 MiB where the candidates' ended at 79 in the run before.

    The rule filters only where some plan leaves room, the candidates included: where none does, every plan is in
    the contest and the cost decides. Seen on cnn (balanced, the pace Lightning's bf16-mixed): the candidates at x1.06
    of the pace by the median and AMP's plan at the bound too, 4 MiB leaner; the filter left the candidates alone in
    the contest (they are never filtered), whose levers then had no room, and the plan ended 1.03x AMP's step peak at
    0.97x its throughput: worse than AMP's plan on both. The candidates stay in the contest where they are past the
    bound and another plan is not: on gpt (balanced, seed 1) the only plan within 1.05x of the pace was the pace
    itself, the plan of compute operators only, 46 MiB fatter than the candidates (x1.10 of it); built on for its room
    it ended at 0.98x AMP's step peak where the candidates end near 0.6x."""
    labels, have_candidates = _contest(judge, steps, labels, have_candidates)
    ranked = _ranked_bases(steps, saved, labels, have_candidates, judge.config.measurement.speed_margin)
    incumbent = CANDIDATES if have_candidates else FP32
    return None if not ranked or ranked[0][0] == incumbent else ranked[0][0]


def measured_beside(judge: BaseJudge, steps: StepComparison, saved: dict[ComparedPlan, float],
                    labels: list[ComparedPlan], have_candidates: bool,
                    base: ComparedPlan | None) -> ComparedPlan | None:
    """The alternative whose levers are spent too, beside the candidates', where :func:`base_for_the_levers` chose
    ``base`` (``None``: none; the base kept is then the one whose own levers end better, :func:`better_end`): where
    levers are spent and the candidates are in the contest, ``base`` itself where it is an alternative, and where it
    is the candidates, the runner-up where its cost is within ``speed_margin`` of theirs (the rule cannot tell them
    apart).

    The rule prices the time a plan gains at the candidates' own bytes per millisecond of their step, a guess the
    levers beat by 2-10x: on the default example it chose all-low's plan (25 MiB leaner than the candidates, 4 %
    slower) in one search of three, whose levers then had 1.8 ms of room and ended at 87.5 MiB, where the candidates'
    ended at 52.5 MiB in another; a plan chosen so must now show it by its own levers. On litgpt (balanced) it kept
    the candidates by under 1 % of cost over the compute-only plan, whose levers had ended 4 MiB leaner in the other
    seed's search."""
    if not judge.spends_levers or not have_candidates or judge.candidates_pay(steps) is Verdict.ABOVE:
        return None
    if base is not None:
        return None if base == CANDIDATES else base
    labels, have_candidates = _contest(judge, steps, labels, have_candidates)
    margin = judge.config.measurement.speed_margin
    ranked = _ranked_bases(steps, saved, labels, have_candidates, margin)
    if len(ranked) < 2 or ranked[0][0] != CANDIDATES:
        return None
    (_, cost), (runner_up, its_cost) = ranked[:2]
    return runner_up if its_cost <= cost * (1 + margin) else None


def better_end(objective: Objective, kept: MemorySpending, other: MemorySpending) -> str | None:
    """Why the levers' end on another base (``other``) is better than on the base kept so far (``kept``) for
    ``objective``, in words; ``None`` where it is not (a tie keeps ``kept``). An end within its bound beats one past
    it; then, with a budget, one that meets it beats one that does not, and of two that meet it the faster;
    otherwise the leaner (memory), or the one of the better balanced score, the lower product of step bytes and step
    time (balanced)."""
    if other.within_bound != kept.within_bound:
        return "within its bound where the other is not" if other.within_bound else None
    if objective is Objective.BALANCED:
        ours, theirs = other.final_bytes * other.end_ms, kept.final_bytes * kept.end_ms
        return (f"better in time x memory ({other.final_bytes / 2**20:.1f} MiB at {other.end_ms:.2f} ms against"
                f" {kept.final_bytes / 2**20:.1f} MiB at {kept.end_ms:.2f} ms)" if ours < theirs else None)
    if kept.target_bytes is not None and other.selection.met != kept.selection.met:
        return "meets the budget where the other does not" if other.selection.met else None
    if kept.target_bytes is not None and other.selection.met:
        return (f"meets the budget faster ({other.end_ms:.2f} against {kept.end_ms:.2f} ms)"
                if other.end_ms < kept.end_ms else None)
    return (f"leaner ({other.final_bytes / 2**20:.1f} against {kept.final_bytes / 2**20:.1f} MiB)"
            if other.final_bytes < kept.final_bytes else None)


def _contest(judge: BaseJudge, steps: StepComparison, labels: list[ComparedPlan],
             have_candidates: bool) -> tuple[list[ComparedPlan], bool]:
    """The alternatives, and whether the candidates, in :func:`base_for_the_levers`'s contest."""
    kept = [plan for plan in labels if judge.bound_holds(steps, plan) is not Verdict.ABOVE]
    candidates_kept = have_candidates and judge.candidates_pay(steps) is not Verdict.ABOVE
    roomy = [plan for plan in kept if judge.leaves_room(steps, plan)]
    if roomy or (candidates_kept and judge.leaves_room(steps, CANDIDATES)):
        kept = roomy
    if kept or candidates_kept:
        return kept, candidates_kept
    return labels, have_candidates


def _ranked_bases(steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
                  have_candidates: bool, margin: float) -> list[tuple[ComparedPlan, float]]:
    """The plans to spend memory levers on, best first, with their cost: the incumbent (the candidates, or FP32
    without them) and the plans of ``labels`` not slower than it by more than ``margin`` (by the median of their
    paired rounds), by *cost*: a plan's saved bytes plus the incumbent's saved bytes times its step relative to the
    incumbent's. The time a plan gains is priced at the incumbent's own bytes per millisecond, as the levers will buy
    bytes with it; a tie goes to the incumbent. Empty where ``labels`` is.

    By the median, not beyond doubt: a load spike in a few rounds widens every interval (to x2.6 of the median in one
    run of the default example), and a slow plan's would then reach the incumbent's."""
    if not labels:
        return []
    incumbent = CANDIDATES if have_candidates else FP32
    price = saved[incumbent]  # bytes per step of the incumbent's

    def relative(plan: ComparedPlan) -> float:
        return 1.0 if plan == incumbent else steps.ratio(plan, incumbent).ratio

    contenders = [incumbent, *(plan for plan in labels if relative(plan) <= 1 + margin)]
    costs = {plan: saved[plan] + price * relative(plan) for plan in contenders}
    return sorted(costs.items(), key=lambda item: (item[1], item[0] != incumbent))
