"""Refinement of the trialled plan by whole steps: one group of operators flipped at a time, kept where it pays.

Runs after the batch stage has picked the fastest measured plan (throughput objective;
:mod:`lightning_comp.search.decisions.refinement` holds the rule). Each flip times the plan with and without it as
whole training steps, interleaved, taking more rounds while the two cannot be told apart, all from the whole-step
budget the batch stage's comparison left (``measurement.extra_profile_time``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.refinement import GroupFlip, PlannedFlip, flip_order, keeps_flip
from lightning_comp.search.measurement.estimates import ExtraRounds, Verdict, paired_ratio
from lightning_comp.search.measurement.step_timing import StepTimer, StepTimes
from lightning_comp.search.stages.context import StageContext

__all__ = ["Refiner"]

_WITHOUT, _WITH = "without", "with"


class Refiner:
    """Flips groups of the trialled plan one at a time and keeps the flips the whole step says pay.

    Args:
        ctx: the batch stage's context.
        budget: the whole-step budget (what the comparison of the measured plans left of it).
        step_ms: a whole step's time (ms, real time), to price the first flip.
    """

    def __init__(self, ctx: StageContext, budget: ExtraRounds, step_ms: float) -> None:
        self.ctx = ctx
        self.budget = budget
        self.rounds = max(ctx.config.measurement.profile_steps, 2)
        self.cost = 2 * (self.rounds + 1) * step_ms / 1e3  # seconds a flip takes: two plans, a warm-up round each

    def plan(self, lowered: set[str]) -> PrecisionPlan:
        """The plan lowering exactly ``lowered``."""
        return PrecisionPlan.from_dict(dict.fromkeys(sorted(lowered), self.ctx.low.value))

    def refine(self, lowered: set[str], groups: Sequence[OperatorGroup],
               decisions: dict[str, OperatorDecision]) -> tuple[set[str], list[GroupFlip]]:
        """Try the flips of :func:`flip_order` from the plan lowering ``lowered`` while the budget lasts.

        Returns:
            What the refined plan lowers, and every flip measured (kept or not), in the order tried.
        """
        ctx = self.ctx
        current, flips = set(lowered), []
        for planned in ctx.agree(flip_order(groups, decisions, current)):
            if not ctx.agree(self.budget.affords(self.cost)):
                break
            started = time.perf_counter()
            flip = self._measure(planned, current)
            self.cost = time.perf_counter() - started  # what the next flip will take, about
            flips.append(flip)
            if flip.kept:
                members = set(planned.group.members)
                current = current | members if planned.to_low else current - members
        return current, flips

    def _measure(self, planned: PlannedFlip, current: set[str]) -> GroupFlip:
        ctx = self.ctx
        members = set(planned.group.members)
        flipped = current | members if planned.to_low else current - members
        configs = {_WITHOUT: ctx.measured(self.plan(current)), _WITH: ctx.measured(self.plan(flipped))}
        timer = StepTimer(ctx.clock, self.rounds, warmup=1)
        timer.on_round = ctx.show_rounds(self.rounds + 1, f"refining: {planned.group.label}")
        margin = ctx.config.measurement.switch_margin
        with self.budget.spending():
            times: StepTimes[str] = timer.time(configs, ctx.step)
        ratio = paired_ratio(times.ms[_WITHOUT], times.ms[_WITH])
        while ctx.agree(keeps_flip(ratio, margin) is Verdict.UNDECIDED):
            more = ctx.agree(self.budget.next_rounds())
            if not more:
                break
            if ctx.progress is not None:
                ctx.progress.extend_stage(more)
            with self.budget.spending():
                timer.time(configs, ctx.step, into=times, rounds=more, warmup=0)
            ratio = paired_ratio(times.ms[_WITHOUT], times.ms[_WITH])
        kept = ctx.agree(keeps_flip(ratio, margin) is Verdict.BELOW)
        step_ms = ctx.reduce_mean(min(times.ms[_WITH])) if times.ms[_WITH] else math.nan
        return GroupFlip(planned.group.pattern, planned.group.members, planned.to_low, planned.expected_gain_ms,
                         ratio, kept, step_ms)
