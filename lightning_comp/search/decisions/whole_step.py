"""The plans the batch stage times as whole training steps, their timings, and their comparison two by two."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, paired_ratio
from lightning_comp.search.measurement.process_memory import StepPeak

__all__ = ["ALTERNATIVES", "PACE_PLANS", "REFERENCES", "ComparedPlan", "Pace", "PlanStep", "ProfiledPlan",
           "StepComparison", "TrialledPlan"]


class ComparedPlan(str, Enum):
    """A plan timed as a whole training step; its value names it in the decision record."""

    FP32 = "fp32"  # the fixed FP32 policy: nothing lowered (the baseline of every ratio)
    CANDIDATES = "candidates"  # the per-operator candidate plan (the incumbent)
    AMP = "amp"  # the fixed AMP policy: what one global autocast region lowers
    ALL_LOW = "all_low"  # every lowerable operator lowered
    COMPUTE = "compute"  # the compute operators alone lowered
    PARAMETERS = "parameters"  # the candidate plan with the memory levers taken (the spending's whole-step check)
    AUTOCAST = "autocast"  # a reference, never trialled: one global autocast region and no plan (bf16-mixed)

    def describe(self, low: ComputePrecision) -> str:
        """The plan in words (``low``: the searched precision)."""
        return _WORDS[self].format(low=low)


class ProfiledPlan(str, Enum):
    """A plan the batch stage profiles per operator; its value names it in the decision record."""

    FP32 = "fp32"  # nothing lowered, every operator with its own casts
    LOW = "low"  # every lowerable operator lowered, at the all-low plan's cast boundaries
    AT_PLAN = "plan"  # the candidate plan, at its own cast boundaries


# The whole-step alternatives to the per-operator candidate plan, in the order they are timed
ALTERNATIVES = (ComparedPlan.AMP, ComparedPlan.ALL_LOW, ComparedPlan.COMPUTE)
# Steps timed beside the plans as references only: never trialled, never the fastest plan
REFERENCES = (ComparedPlan.AUTOCAST,)
# The fixed policies a user would train with instead of a searched plan: the fastest of them measured is the *pace*
# the memory and balanced objectives bound their slowdown against (``max_slowdown_vs_fastest``). The candidate and
# all-low plans are not among them: neither is a policy known to converge before its trial.
PACE_PLANS = (ComparedPlan.FP32, ComparedPlan.AMP, ComparedPlan.COMPUTE, ComparedPlan.AUTOCAST)

_WORDS = {
    ComparedPlan.FP32: "fp32",
    ComparedPlan.CANDIDATES: "the candidate plan",
    ComparedPlan.AMP: "AMP's plan (what one global {low} autocast region lowers)",
    ComparedPlan.ALL_LOW: "the all-{low} plan",
    ComparedPlan.COMPUTE: "the plan of compute operators only",
    ComparedPlan.PARAMETERS: "the candidate plan with its memory levers",
    ComparedPlan.AUTOCAST: "one global {low} autocast region without a plan (Lightning's {low}-mixed)",
}


@dataclass(frozen=True)
class PlanStep:
    """One plan's whole step, as the batch stage timed it.

    Attributes:
        ms: the fastest round, as the clock counts it (averaged over ranks).
        wall_ms: the same round's real time.
        ratio: its step time relative to FP32's over paired rounds (``None`` for FP32 itself).
        saved_bytes: the bytes it saves for backward (``None``: not measured, the objective weighs no memory).
        process_peak: the peak the process needed for one step of it, measured on rank 0 (live heap and OS peak on a
            CPU, the allocator's reserved and allocated peaks on CUDA; ``None``: not measured, the objective weighs no
            memory).
    """

    ms: float
    wall_ms: float
    ratio: RatioEstimate | None = None
    saved_bytes: float | None = None
    process_peak: StepPeak | None = None


@dataclass(frozen=True)
class Pace:
    """The fastest fixed policy the batch stage measured as a whole step (of :data:`PACE_PLANS`).

    Attributes:
        plan: which one.
        ratio_to_fp32: its median per-round step-time ratio to FP32 (1 for FP32 itself).
    """

    plan: ComparedPlan = ComparedPlan.FP32
    ratio_to_fp32: float = 1.0

    def describe(self, low: ComputePrecision) -> str:
        """The pace in words, e.g. ``"AMP's plan (... ) at x0.52 of fp32's step"``."""
        if self.plan is ComparedPlan.FP32:
            return "fp32"
        return f"{self.plan.describe(low)} at x{self.ratio_to_fp32:.2f} of fp32's step"


@dataclass(frozen=True)
class TrialledPlan:
    """The plan the batch stage hands the epoch stage, and the batch stage's forecast of its step.

    Attributes:
        source: the whole-step plan it was measured as (the fastest measured, or FP32 when none beat it).
        refined: whether refinement flips changed it.
        step_ms: the forecast of its step (the fastest round of its last measurement, as the clock counts it).
        ratio_to_fp32: the forecast of its step-time ratio to FP32 (``source``'s median ratio, times the kept flips'
            median ratios).
        fastest: the fastest plan measured as a whole step, by the median (before refinement).
        fastest_ms: that plan's fastest round.
        pace: the fastest fixed policy measured, which the memory and balanced objectives bound their slowdown
            against.
    """

    source: ComparedPlan
    refined: bool
    step_ms: float
    ratio_to_fp32: float
    fastest: ComparedPlan
    fastest_ms: float
    pace: Pace


@dataclass
class StepComparison:
    """Whole-step times of several plans over paired rounds.

    Attributes:
        ms: plan -> step times per round as the clock counts them (:attr:`ComparedPlan.FP32` is always there).
    """

    ms: dict[ComparedPlan, list[float]]

    def ratio(self, a: ComparedPlan, b: ComparedPlan) -> RatioEstimate:
        """``a``'s step time relative to ``b``'s, over the rounds both were measured in.

        Extra rounds time only the plans of the comparisons still undecided, and that set only shrinks, so the first
        ``min(len)`` rounds of any two plans are the rounds both took part in.
        """
        n = min(len(self.ms[a]), len(self.ms[b]))
        return paired_ratio(self.ms[b][:n], self.ms[a][:n])

    def faster(self, a: ComparedPlan, b: ComparedPlan, margin: float) -> Verdict:
        """``BELOW`` when ``a`` is faster than ``b`` by ``margin`` beyond doubt, ``ABOVE`` when it is not."""
        return self.ratio(a, b).against(1 - margin)

    def median_to_fp32(self, plan: ComparedPlan) -> float:
        """``plan``'s median per-round step-time ratio to FP32 (1 for FP32 itself)."""
        return 1.0 if plan is ComparedPlan.FP32 else self.ratio(plan, ComparedPlan.FP32).ratio

    @property
    def plans(self) -> list[ComparedPlan]:
        """The plans compared (the references left out)."""
        return [plan for plan in self.ms if plan not in REFERENCES]

    def fastest(self) -> ComparedPlan:
        """The plan whose whole step is fastest by the median of its paired per-round ratios to FP32 (FP32 counts 1;
        a tie goes to the plan timed first, FP32 first of all; references are not plans)."""
        return min(self.plans, key=self.median_to_fp32)

    def pace(self) -> Pace:
        """The fastest of the fixed policies timed (:data:`PACE_PLANS`), by the median of its paired per-round ratios
        to FP32 (a tie goes to the policy first in :data:`PACE_PLANS`, FP32 first of all)."""
        timed = [plan for plan in PACE_PLANS if plan in self.ms]
        best = min(timed, key=self.median_to_fp32)
        return Pace(best, self.median_to_fp32(best))

    def within(self, plan: ComparedPlan, pace: Pace, slowdown: float) -> Verdict:
        """Whether ``plan``'s step stays within ``slowdown`` of ``pace``'s: ``BELOW`` beyond doubt, ``ABOVE`` when
        it is past it, ``UNDECIDED`` while the rounds cannot tell (the pace itself is always within). Compared over
        paired rounds with the pace where the pace was timed here, else through both plans' ratios to FP32."""
        if plan == pace.plan:
            return Verdict.BELOW
        if pace.plan in self.ms:
            return self.ratio(plan, pace.plan).against(slowdown)
        return self.ratio(plan, ComparedPlan.FP32).against(slowdown * pace.ratio_to_fp32)

    def too_close_to_tell(self, margin: float) -> frozenset[ComparedPlan]:
        """The plans whose comparison with the fastest cannot be decided yet, with the fastest (empty: decided).

        A plan is too close when the interval of its per-round ratios to the fastest straddles 1; the fastest and
        FP32 are also too close when the interval of the fastest's ratio to FP32 straddles ``1 - margin`` (whether it
        beats FP32 by the margin at all).
        """
        best = self.fastest()
        close = {plan for plan in self.plans
                 if plan is not best and self.ratio(plan, best).against(1.0) is Verdict.UNDECIDED}
        fp32 = ComparedPlan.FP32
        if best is not fp32 and self.ratio(best, fp32).against(1 - margin) is Verdict.UNDECIDED:
            close.add(fp32)
        return frozenset(close | {best}) if close else frozenset()

    def ratios(self) -> dict[ComparedPlan, RatioEstimate]:
        """Each plan's step time relative to FP32."""
        return {plan: self.ratio(plan, ComparedPlan.FP32) for plan in self.ms if plan != ComparedPlan.FP32}
