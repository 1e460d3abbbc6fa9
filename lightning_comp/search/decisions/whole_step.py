"""The plans the batch stage times as whole training steps, their timings, and their comparison two by two."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, paired_ratio

__all__ = ["ALTERNATIVES", "ComparedPlan", "PlanStep", "ProfiledPlan", "StepComparison"]


class ComparedPlan(str, Enum):
    """A plan timed as a whole training step; its value names it in the decision record."""

    FP32 = "fp32"  # the fixed FP32 policy: nothing lowered (the baseline of every ratio)
    CANDIDATES = "candidates"  # the per-operator candidate plan (the incumbent)
    AMP = "amp"  # the fixed AMP policy: what one global autocast region lowers
    ALL_LOW = "all_low"  # every lowerable operator lowered
    COMPUTE = "compute"  # the compute operators alone lowered
    SAVED = "saved"  # the candidate plan with its saved lowerings (saved stage)
    PARAMETERS = "parameters"  # the candidate plan with its optimizer-state and master lowerings (parameter stage)

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

_WORDS = {
    ComparedPlan.FP32: "fp32",
    ComparedPlan.CANDIDATES: "the candidate plan",
    ComparedPlan.AMP: "AMP's plan (what one global {low} autocast region lowers)",
    ComparedPlan.ALL_LOW: "the all-{low} plan",
    ComparedPlan.COMPUTE: "the plan of compute operators only",
    ComparedPlan.SAVED: "the candidate plan with its saved lowerings",
    ComparedPlan.PARAMETERS: "the candidate plan with its optimizer-state and master lowerings",
}


@dataclass(frozen=True)
class PlanStep:
    """One plan's whole step, as the batch stage timed it.

    Attributes:
        ms: the fastest round, as the clock counts it (averaged over ranks).
        wall_ms: the same round's real time.
        ratio: its step time relative to FP32's over paired rounds (``None`` for FP32 itself).
        saved_bytes: the bytes it saves for backward (``None``: not measured, the objective weighs no memory).
    """

    ms: float
    wall_ms: float
    ratio: RatioEstimate | None = None
    saved_bytes: float | None = None


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

    def ratios(self) -> dict[ComparedPlan, RatioEstimate]:
        """Each plan's step time relative to FP32."""
        return {plan: self.ratio(plan, ComparedPlan.FP32) for plan in self.ms if plan != ComparedPlan.FP32}
