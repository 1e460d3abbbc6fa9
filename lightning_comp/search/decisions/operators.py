"""Each operator's decision from the batch stage's per-operator measurements: a candidate, a fill, or FP32.

Operators that play the same part in repeated blocks are decided as one group
(:mod:`lightning_comp.search.decisions.groups`): their rounds pooled, one verdict for every member. Compute operators
(matmul, convolution, recurrent, attention, embeddings, other modules with weights, containers computing between
their children, and any leaf a trace found running such kernels:
:func:`~lightning_comp.operators.kinds.judged_as_compute`) are judged by the objective's policy
(:mod:`lightning_comp.search.decisions.objectives`) on their forward and backward time. Cheap operators (norms,
activations) are *fills*: lowered only between two lowered operators, when that costs no time forward and backward
or pays by the objective's own rule (the memory objective: the bytes it saves for backward, within its slowdown),
so activations stay low across the run (:mod:`lightning_comp.search.decisions.trial_plans`). Operators that do no
arithmetic (shape-only modules, ``Dropout(p=0)``) are not decisions: their output has their input's precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from torch import nn

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.kinds import (
    JUDGED_KINDS,
    OperatorKind,
    classify,
    does_no_arithmetic,
    judged_as_compute,
)
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.decisions.fp8 import Fp8Decision
from lightning_comp.search.decisions.groups import OperatorGroup, group_operators, pooled_series
from lightning_comp.search.decisions.objectives import ObjectivePolicy
from lightning_comp.search.decisions.parameters import ParameterDecision
from lightning_comp.search.decisions.saved import SavedDecision
from lightning_comp.search.decisions.whole_step import ProfiledPlan
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, paired_ratio
from lightning_comp.search.measurement.profiling import OperatorMeasurement, ProfileResult

__all__ = ["Choice", "OperatorDecision", "OperatorVerdict", "decide_operators", "fills", "judge_operator",
           "recheck_at_plan_boundaries"]


class Choice(str, Enum):
    """What the batch stage decided for one operator's compute precision."""

    CANDIDATE = "candidate"  # trialled in low precision
    FILL = "fill"  # lowered only between two lowered operators
    FP32 = "fp32"  # stays FP32, never trialled


@dataclass
class OperatorDecision:
    """One operator's measurements and decision (its record form: :mod:`lightning_comp.search.record.batch`).

    Attributes:
        type: the module's class name.
        kind: what it does.
        params: its parameter elements.
        decision: what was decided.
        reason: why, in words.
        fp32: its measurement in FP32 (``None``: it did not run).
        low: its measurement in low precision, with every lowerable operator lowered (the all-low plan's cast
            boundaries: its output stays low where its consumers compute low too).
        in_plan: its measurement in the candidate plan, at that plan's cast boundaries (where they differ from the
            all-low plan's; ``None``: not measured).
        in_plan_time: its low/FP32 time ratio there.
        time: its low/FP32 time ratio over paired rounds, with the interval.
        gain_ms: the time lowering it saves per step (FP32 minus low, ms; 0 where not measured).
        gain_bytes: the bytes saved for backward that lowering it saves per step.
        benefit: what lowering it gains in the objective's unit (ranks fallback groups).
        memory_ratio: its low/FP32 ratio of bytes saved for backward (where the policy judged it).
        settled: whether its rounds told the two precisions apart (where the policy judged it).
        own_decision: the decision from its own measurement, before any whole-step check changed it.
        excluded: ``CoMPSearch(exclude=...)`` named it.
        forced: ``CoMPSearch(include=...)`` named it.
        heavy: judged as a compute operator, on its own cost (else a cheap operator: a fill or FP32); always for the
            compute kinds (a cheap-kind leaf is heavy where a trace found it running compute kernels).
        group: the pattern of the group it was decided with (its own name for a group of one; empty: not judged).
        group_size: how many operators that group holds.
        saved: the decision on the precision of what it saves for backward (memory and balanced objectives).
        parameters: the decision on its parameters' optimizer state and master precision (memory and balanced
            objectives, operators owning parameters).
        fp8: the decision on computing it in fp8 instead of its 16-bit lowering (where fp8 is searched and it is a
            Linear fp8 kernels take).
    """

    type: str
    kind: OperatorKind
    params: int
    decision: Choice = Choice.FP32
    reason: str = ""
    fp32: OperatorMeasurement | None = None
    low: OperatorMeasurement | None = None
    in_plan: OperatorMeasurement | None = None
    in_plan_time: RatioEstimate | None = None
    time: RatioEstimate | None = None
    gain_ms: float = 0.0
    gain_bytes: int = 0
    benefit: float = 0.0
    memory_ratio: float | None = None
    settled: bool | None = None
    own_decision: Choice | None = None
    excluded: bool = False
    forced: bool = False
    heavy: bool = False
    group: str = ""
    group_size: int = 1
    saved: SavedDecision | None = None
    parameters: ParameterDecision | None = None
    fp8: Fp8Decision | None = None

    def __post_init__(self) -> None:
        self.heavy = self.heavy or self.kind in JUDGED_KINDS

    @property
    def is_candidate(self) -> bool:
        """Whether it is trialled in low precision."""
        return self.decision is Choice.CANDIDATE

    def keep_fp32(self, reason: str) -> None:
        """Take it out of the candidates (a whole-step check found against it), unless it is forced."""
        if not self.forced:
            self.decision, self.reason = Choice.FP32, reason


@dataclass(frozen=True)
class OperatorVerdict:
    """What a policy decides of one operator from its own measurements.

    Attributes:
        decision: candidate or FP32.
        reason: why, with the measurements.
        settled: ``False`` when the rounds could not tell the two precisions apart (more rounds may settle it).
        time: the low/FP32 time ratio it was judged by.
        memory_ratio: low/FP32 bytes saved for backward.
        benefit: what lowering it gains, in the objective's unit.
    """

    decision: Choice
    reason: str
    settled: bool
    time: RatioEstimate
    memory_ratio: float
    benefit: float

    def apply_to(self, decision: OperatorDecision) -> None:
        """Make this the operator's decision."""
        decision.decision, decision.reason, decision.settled = self.decision, self.reason, self.settled
        decision.time, decision.memory_ratio, decision.benefit = self.time, self.memory_ratio, self.benefit


def judge_operator(policy: ObjectivePolicy, fp32: OperatorMeasurement, low: OperatorMeasurement,
                   time: RatioEstimate | None = None) -> OperatorVerdict:
    """One operator's verdict from its FP32 and low-precision measurements, by ``policy``.

    Args:
        policy: the objective's policy.
        fp32: its measurement in FP32 (times are minima over rounds).
        low: its measurement in low precision.
        time: the low/FP32 time ratio over paired rounds (``None``: exactly the ratio of the minima).

    Returns:
        The verdict, which :meth:`OperatorVerdict.apply_to` makes the operator's decision.
    """
    t32, tlow = fp32.total_ms, low.total_ms
    if time is None:
        exact = tlow / t32 if t32 > 0 else float("inf")
        time = RatioEstimate(exact, exact, exact, 1, 1.0)
    memory_ratio = low.saved_bytes / fp32.saved_bytes if fp32.saved_bytes > 0 else 1.0
    judged = policy.operator(time, t32, tlow, memory_ratio, float(fp32.saved_bytes - low.saved_bytes))
    if judged.verdict is Verdict.UNDECIDED:
        margin = policy.config.measurement.speed_margin
        reason = f"cannot be told apart from fp32 at a {margin:.0%} margin: {judged.why}"
    else:
        reason = ("pays: " if judged.verdict is Verdict.BELOW else "does not pay: ") + judged.why
    return OperatorVerdict(Choice.CANDIDATE if judged.verdict is Verdict.BELOW else Choice.FP32, reason,
                           settled=judged.verdict is not Verdict.UNDECIDED, time=time, memory_ratio=memory_ratio,
                           benefit=judged.benefit)


def fills(config: SearchConfig, fp32: OperatorMeasurement, low: OperatorMeasurement, time: RatioEstimate) -> bool:
    """Whether a cheap operator (or group) may be lowered between two lowered ones: its forward and backward time
    (at the all-low plan's cast boundaries, where a run stays low) is not slower in low precision by more than the
    margin, or than ``min_gain_ms``, even at the slow end of the interval of its per-round ratios (from a single
    round: the ratio of the minima). Judged at the slow end so that an operator near the margin (a LayerNorm at 1.3x
    whose fastest rounds happen to meet) is not filled in one run and left out in the next."""
    measurement = config.measurement
    if time.rounds < 2 or not math.isfinite(time.high):
        return low.total_ms <= fp32.total_ms * (1 + measurement.speed_margin) + measurement.min_gain_ms
    slowest_gain_ms = (time.high - 1) * fp32.total_ms
    return time.high <= 1 + measurement.speed_margin or slowest_gain_ms <= measurement.min_gain_ms


def _fill_reason(config: SearchConfig, policy: ObjectivePolicy, fp32: OperatorMeasurement, low: OperatorMeasurement,
                 time: RatioEstimate, precision: ComputePrecision) -> str | None:
    """Why a cheap operator (or group) is a fill (``None``: it is not): it :func:`fills`, or it pays by the
    objective's own rule (the memory objective: it saves the margin's share of its bytes for backward within the
    slowdown bound), as a compute operator would. A GELU whose bf16 output halves the 16 MiB the default example's
    MLPs keep, at x0.96 [0.87, 1.11] of its FP32 time, was left FP32 by :func:`fills` alone in one run of four, and
    the memory search then built on a plan 16 MiB fatter.

    For the memory and balanced objectives, where the rounds cannot tell (x0.93 [0.75, 1.28]: one slow round), their
    median decides: the whole step is held to the bound afterwards, and judged at the interval's slow end the same
    GELU was left FP32 in the default example's budget run and in a compare's gpt search, whose plan ended at 0.97x
    AMP's step peak where the other gpt searches ended at 0.63-0.70x. The throughput objective keeps its fills to
    what costs no time beyond doubt."""
    if fills(config, fp32, low, time):
        return (f"time {time.describe()} forward and backward ({fp32.total_ms:.4f} ms in fp32 ->"
                f" {low.total_ms:.4f} ms in {precision})")
    own = judge_operator(policy, fp32, low, time)
    if own.decision is Choice.CANDIDATE:
        return own.reason
    if own.settled or policy.objective is Objective.THROUGHPUT:
        return None
    median = RatioEstimate(time.ratio, time.ratio, time.ratio, time.rounds, time.confidence)
    by_median = judge_operator(policy, fp32, low, median)
    return (f"{by_median.reason} by the median of its rounds ({time.describe()}; the whole step holds the bound)"
            if by_median.decision is Choice.CANDIDATE else None)


def _pooled(measurements: list[OperatorMeasurement]) -> OperatorMeasurement:
    """A group's measurement: its members' summed."""
    if len(measurements) == 1:
        return measurements[0]
    return OperatorMeasurement(
        forward_ms=sum(m.forward_ms for m in measurements), compute_ms=sum(m.compute_ms for m in measurements),
        backward_ms=sum(m.backward_ms for m in measurements), saved_bytes=sum(m.saved_bytes for m in measurements),
        calls=sum(m.calls for m in measurements), wall_ms=sum(m.wall_ms for m in measurements),
        own_saved_bytes=sum(m.own_saved_bytes for m in measurements))


def _group_measurements(group: OperatorGroup | tuple[str, ...], a: ProfileResult, b: ProfileResult,
                        ) -> tuple[OperatorMeasurement, OperatorMeasurement, RatioEstimate]:
    """The pooled measurements of a group's members in ``a`` and ``b``, and the ratio of their pooled rounds."""
    members = group.members if isinstance(group, OperatorGroup) else group
    time = paired_ratio(pooled_series(a.series(m) for m in members), pooled_series(b.series(m) for m in members))
    return _pooled([a.operators[m] for m in members]), _pooled([b.operators[m] for m in members]), time


def _in_group(group: OperatorGroup, reason: str) -> str:
    return reason if group.size == 1 else f"decided with its group {group.pattern} (x{group.size}): {reason}"


def decide_operators(config: SearchConfig, policy: ObjectivePolicy, low: ComputePrecision,
                     modules: dict[str, nn.Module],
                     lowerable: list[str], results: dict[ProfiledPlan, ProfileResult]) -> dict[str, OperatorDecision]:
    """Each operator's decision from the per-operator profile (``results[FP32]`` and ``results[LOW]``), one per group
    of operators playing the same part in repeated blocks.

    Args:
        config: the search's settings (``include``/``exclude``, margin, smallest gain).
        policy: the objective's policy.
        low: the searched 16-bit precision.
        modules: the model's operators by name.
        lowerable: the operators that can compute in ``low`` on the device.
        results: the profile of every operator in FP32 and in low precision.
    """
    fp32, lowered = results[ProfiledPlan.FP32], results[ProfiledPlan.LOW]
    decisions: dict[str, OperatorDecision] = {}
    judged: list[str] = []
    for name, module in modules.items():
        kind = classify(module)
        a, b = fp32.operators.get(name), lowered.operators.get(name)
        decision = OperatorDecision(type(module).__name__, kind, sum(p.numel() for p in module.parameters()),
                                    fp32=a, low=b, heavy=judged_as_compute(module))
        if a is not None and b is not None:
            decision.time = paired_ratio(fp32.series(name), lowered.series(name))
            decision.gain_ms = a.total_ms - b.total_ms
            decision.gain_bytes = a.saved_bytes - b.saved_bytes
        if not low.is_low:
            decision.reason = "compute not searched (CoMPSearch(low_precision='off'))"
        elif name not in lowerable:
            decision.reason = ("no arithmetic: its output has its input's precision (follows its neighbours)"
                               if does_no_arithmetic(module) or kind is OperatorKind.SHAPE
                               else f"no {low} kernel on this device")
        elif config.excluded.matches(name, module):
            decision.reason, decision.excluded = "excluded by CoMPSearch(exclude=...)", True
        elif config.included(Dimension.COMPUTE).matches(name, module):
            decision.decision, decision.reason, decision.forced = (
                Choice.CANDIDATE, "included by CoMPSearch(include=...)", True)
            if a is not None and b is not None:
                decision.benefit = judge_operator(policy, a, b, decision.time).benefit
        elif a is None or b is None:
            decision.reason = "not run in the training step"
        else:
            judged.append(name)
        decisions[name] = decision
    for group in group_operators(judged, modules):
        a, b, time = _group_measurements(group, fp32, lowered)
        members = [decisions[m] for m in group.members]
        heavy = members[0].heavy
        verdict = judge_operator(policy, a, b, time) if heavy else None
        for decision in members:
            decision.group, decision.group_size = group.pattern, group.size
            if verdict is not None:
                verdict.apply_to(decision)
                decision.reason = _in_group(group, verdict.reason)
                decision.benefit = verdict.benefit / group.size  # its share: a group's benefit is its members' sum
                decision.own_decision = decision.decision  # from its group's measurement, before whole-step checks
            elif (why := _fill_reason(config, policy, a, b, time, low)) is not None:
                decision.decision = Choice.FILL
                decision.reason = _in_group(group, f"lowered only between lowered operators: {why}")
                decision.time = time
            else:
                decision.time = time
                decision.reason = _in_group(group, f"slower in {low} forward and backward: time {time.describe()}"
                                                   f" ({a.total_ms:.4f} ms in fp32 -> {b.total_ms:.4f} ms in {low};"
                                                   f" judged at the interval's slow end, x{time.high:.2f})")
    return decisions


def recheck_at_plan_boundaries(policy: ObjectivePolicy, decisions: dict[str, OperatorDecision],
                               profile: dict[ProfiledPlan, ProfileResult]) -> dict[str, str]:
    """The candidates that stop paying at the candidate plan's own cast boundaries, with the reason for each.

    Operators are first judged with every lowerable operator lowered, so none is charged an output cast that
    training with its neighbours lowered does not pay. Where the candidate plan keeps a neighbour in FP32, the
    operator pays that cast after all; ``profile`` (``FP32`` and ``AT_PLAN``, paired rounds at the plan's
    boundaries) measures it, and a candidate group judged there not to pay any more (beyond doubt) is named, every
    member of it. Forced ones and fills are kept; every measured candidate's ``in_plan`` measurement is recorded.

    Returns:
        name -> why it is dropped (empty: every candidate still pays). The caller takes them out (``keep_fp32``).
    """
    fp32, plan = profile[ProfiledPlan.FP32], profile[ProfiledPlan.AT_PLAN]
    groups: dict[str, list[str]] = {}
    for name, decision in decisions.items():
        if not decision.is_candidate or name not in fp32.operators or name not in plan.operators:
            continue
        decision.in_plan = plan.operators[name]
        decision.in_plan_time = paired_ratio(fp32.series(name), plan.series(name))
        if not decision.forced and decision.heavy:
            groups.setdefault(decision.group or name, []).append(name)
    dropped: dict[str, str] = {}
    for pattern, members in groups.items():
        a, b, time = _group_measurements(tuple(members), fp32, plan)
        verdict = judge_operator(policy, a, b, time)
        if verdict.decision is Choice.FP32 and verdict.settled:
            first = decisions[members[0]]
            before = first.time.describe() if first.time is not None else "?"
            why = (f"pays with its neighbours low (time {before}) but not at the candidate plan's cast boundaries:"
                   f" {verdict.reason.removeprefix('does not pay: ')}")
            if len(members) > 1:
                why = f"decided with its group {pattern} (x{len(members)}): {why}"
            dropped.update(dict.fromkeys(members, why))
    return dropped
