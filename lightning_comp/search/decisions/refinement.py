"""The whole-step rule of the throughput objective: the fastest measured plan, then one group flipped at a time.

The batch stage times whole training steps of every plan it knows (FP32, the per-operator candidates, AMP's plan,
the all-low and the compute-only plans), interleaved. The plan it trials is the fastest of them by the median of its
paired per-round ratios to FP32 (:meth:`~lightning_comp.search.decisions.whole_step.StepComparison.fastest`); where
the fastest cannot be told from another plan, more rounds are taken, to the batch stage's time budget
(:meth:`~lightning_comp.search.decisions.whole_step.StepComparison.too_close_to_tell`). No plan is preferred for
its label: stability comes from more evidence and from deciding repeated blocks as groups.

From that plan, groups of operators (:mod:`lightning_comp.search.decisions.groups`) are flipped one at a time, the
largest expected gain first (:func:`flip_order`: from the groups' own forward and backward measurements), and a flip
is kept only when the whole step with it is faster than without it beyond doubt (:func:`keeps_flip`), within the same
budget. Each flip is recorded (:class:`GroupFlip`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict

__all__ = ["GroupFlip", "PlannedFlip", "flip_order", "keeps_flip"]

@dataclass(frozen=True)
class PlannedFlip:
    """A flip the refinement may try.

    Attributes:
        group: the group flipped.
        to_low: whether it lowers the group (else it takes it back to FP32).
        expected_gain_ms: what the group's own measurements expect the flip to save per step.
    """

    group: OperatorGroup
    to_low: bool
    expected_gain_ms: float


def flip_order(groups: Iterable[OperatorGroup], decisions: Mapping[str, OperatorDecision],
               lowered: set[str]) -> list[PlannedFlip]:
    """The flips worth trying from the plan lowering ``lowered``, the largest expected gain first.

    A group's expected gain is the difference of its members' forward and backward time in FP32 and in low precision
    (at the all-low plan's cast boundaries); only flips expected to save time are listed, and only of groups whose
    members are all decided by measurement (not forced, excluded or unmeasured) and all on one side of the plan.
    """
    out: list[PlannedFlip] = []
    for group in groups:
        members = [decisions[m] for m in group.members]
        if any(d.fp32 is None or d.low is None or d.forced or d.excluded or not d.group for d in members):
            continue
        inside = {m in lowered for m in group.members}
        if len(inside) != 1:
            continue
        fp32_ms = sum(d.fp32.total_ms for d in members if d.fp32 is not None)
        low_ms = sum(d.low.total_ms for d in members if d.low is not None)
        to_low = not inside.pop()
        gain = fp32_ms - low_ms if to_low else low_ms - fp32_ms
        if gain > 0:
            out.append(PlannedFlip(group, to_low, gain))
    return sorted(out, key=lambda flip: -flip.expected_gain_ms)


def keeps_flip(ratio: RatioEstimate, margin: float) -> Verdict:
    """Whether a flip whose step time is ``ratio`` of the plan's without it is kept: ``BELOW`` (kept) when the whole
    interval is at or below ``1 - margin``, ``ABOVE`` when it is above, ``UNDECIDED`` while the rounds cannot tell."""
    return ratio.against(1 - margin)


@dataclass(frozen=True)
class GroupFlip:
    """One flip the refinement measured.

    Attributes:
        group: the group's pattern.
        members: its operators.
        to_low: whether it lowered the group (else took it back to FP32).
        expected_gain_ms: what the group's own measurements expected it to save per step.
        ratio: the step time with the flip over the step time without it, over paired rounds.
        kept: whether it was kept.
        step_ms: the fastest measured step with the flip.
    """

    group: str
    members: tuple[str, ...]
    to_low: bool
    expected_gain_ms: float
    ratio: RatioEstimate
    kept: bool
    step_ms: float

    def describe(self, low: str) -> str:
        """The flip and its evidence, in words."""
        what = f"{self.group} (x{len(self.members)})" if len(self.members) > 1 else self.group
        to = low if self.to_low else "fp32"
        verdict = "kept" if self.kept else "not kept"
        return (f"{what} to {to}: expected -{self.expected_gain_ms:.3f} ms, step {self.ratio.describe()} of the plan"
                f" without it: {verdict}")
