"""One policy per :class:`~lightning_comp.search.config.Objective`: how it judges an operator, a saved precision
and a whole step, how it ranks what it keeps, and how the record words it.

Every time comparison is a :class:`~lightning_comp.search.measurement.estimates.RatioEstimate` from paired rounds:
the median per-round ratio and its confidence interval. A comparison is *settled* when the whole interval lies on
one side of the threshold (``1 - speed_margin`` for a gain, ``max_slowdown_vs_fastest`` for the slowdown the memory
and balanced objectives accept); otherwise it is *undecided*, the batch stage takes more rounds, and what is still
undecided at the end of its budget stays FP32 with that reason.

The slowdown those two objectives accept is bounded against the *pace*
(:class:`~lightning_comp.search.decisions.whole_step.Pace`): the fastest of the fixed policies the batch stage times
as whole steps (FP32, AMP's plan, the compute-only plan, one global autocast region). Bounding it against FP32
instead, where 16-bit compute pays, would accept plans at half the throughput a user has with ``bf16-mixed``. Until
the whole steps are timed the pace is FP32. Per operator, the memory objective holds a lowering to the bound against
that operator's own faster precision; the balanced objective judges operators by their score alone.

=============  ===========================================================================================
objective      a lowering pays when
=============  ===========================================================================================
throughput     the step gets faster by the margin (and by at least ``min_gain_ms``)
memory         it saves the margin's share of the bytes kept for backward, within ``max_slowdown_vs_fastest``
balanced       the geometric mean of its time and memory ratios to FP32 (the *balanced score*) beats the margin,
               within ``max_slowdown_vs_fastest``
=============  ===========================================================================================

Where the memory or balanced objective spends memory levers on its plan (a ``saved``, ``state`` or ``master`` dimension
is searched), the whole-step plan it builds on is chosen for what it will end at once the levers are spent:
:mod:`lightning_comp.search.decisions.levers_base`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from lightning_comp.errors import UsageError
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.decisions.levers_base import base_for_the_levers
from lightning_comp.search.decisions.whole_step import ComparedPlan, Pace, StepComparison
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, compare_to

FP32, CANDIDATES = ComparedPlan.FP32, ComparedPlan.CANDIDATES

__all__ = ["Judgement", "ObjectivePolicy", "balanced_score", "policy_for"]


def balanced_score(time_ratio: float, memory_ratio: float) -> float:
    """The balanced objective's score of a lowering: the geometric mean of its time and memory ratios to the
    configuration it is compared with (below 1 is better)."""
    return math.sqrt(max(time_ratio, 0.0) * memory_ratio)


def _balanced_verdict(time: RatioEstimate, memory_ratio: float, threshold: float) -> Verdict:
    """Where the balanced score's interval (from the time ratio's) lies against ``threshold``."""
    return compare_to(balanced_score(time.low, memory_ratio), balanced_score(time.high, memory_ratio), threshold)


@dataclass(frozen=True)
class Judgement:
    """A policy's judgement of one lowering.

    Attributes:
        verdict: ``BELOW``: it pays; ``ABOVE``: it does not; ``UNDECIDED``: the rounds cannot tell.
        why: the measurements that decided, in words.
        benefit: what keeping it gains, in the objective's unit (ms per step, bytes, or the balanced score's gain):
            ranks the passing groups of the epoch stage.
    """

    verdict: Verdict
    why: str
    benefit: float


class ObjectivePolicy(ABC):
    """How one objective judges and ranks lowerings (see the module docstring).

    Args:
        config: the search's settings (margin, slowdown accepted for memory, smallest gain).
    """

    objective: ClassVar[Objective]
    better: ClassVar[str]  # how a plan that wins a whole-step comparison is better, e.g. "faster as a whole"
    weighs_memory: ClassVar[bool] = True  # whether whole steps' saved bytes decide anything
    refines: ClassVar[bool] = False  # whether the trialled plan is refined one group at a time by whole steps

    def __init__(self, config: SearchConfig) -> None:
        self.config = config
        self.keep = 1 - config.measurement.speed_margin
        self.slowdown = config.slowdown_vs_fastest
        self.pace = Pace()

    def set_pace(self, pace: Pace) -> None:
        """Bound later judgements by ``pace`` (the batch stage's fastest fixed policy, once whole steps are timed)."""
        self.pace = pace

    def bound_holds(self, steps: StepComparison, plan: ComparedPlan) -> Verdict:
        """Whether ``plan``'s step is within ``max_slowdown_vs_fastest`` of the pace (:meth:`StepComparison.within`),
        the bound waived (``BELOW``) where every other plan timed, FP32 included, is past it beyond doubt.

        The pace can be a reference no plan reaches (one global autocast region, never trialled: on cnn it ran
        x0.93 of AMP's plan's step in one run, so every plan was past 1.05x of it); the bound would then hold back
        every plan and leave FP32, the furthest past it of all."""
        verdict = steps.within(plan, self.pace, self.slowdown)
        if verdict is Verdict.BELOW:
            return verdict
        others = [other for other in steps.plans if other != plan]
        if others and all(steps.within(other, self.pace, self.slowdown) is Verdict.ABOVE for other in others):
            return Verdict.BELOW
        return verdict

    def leaves_room(self, steps: StepComparison, plan: ComparedPlan) -> bool:
        """Whether ``plan``'s step is inside ``max_slowdown_vs_fastest`` of the pace by the median of their paired
        rounds (through both plans' ratios to FP32 where the pace was not timed beside it): the measure the memory
        levers' room is taken by. ``True`` where :meth:`bound_holds` waives the bound (every plan is past it)."""
        if plan == self.pace.plan or (steps.within(plan, self.pace, self.slowdown) is not Verdict.BELOW
                                      and self.bound_holds(steps, plan) is Verdict.BELOW):
            return True
        if self.pace.plan in steps.ms:
            return steps.ratio(plan, self.pace.plan).ratio < self.slowdown
        return steps.median_to_fp32(plan) < self.slowdown * self.pace.ratio_to_fp32

    def bound_against_fp32(self, steps: StepComparison, plan: ComparedPlan) -> Verdict:
        """:meth:`bound_holds` where the choice is between ``plan`` and FP32 (the fallback of
        :meth:`candidates_pay`): a bound the rounds cannot tell for ``plan`` holds (``BELOW``) where FP32 is past it
        beyond doubt and ``plan`` is faster than FP32 beyond doubt, since falling back would trade a plan near the
        bound for one surely past it, and slower.

        Seen on the default example (gpt, balanced): the candidates at x0.68 [0.64, 0.73] of FP32's step, the
        bound 1.05x the compute-only plan's x0.64, so undecided; the search then trialled FP32 (x1.0, 1.9x AMP's
        saved bytes), and the compare measured 0.67x AMP's throughput at 1.19x its step peak."""
        verdict = self.bound_holds(steps, plan)
        if (verdict is Verdict.UNDECIDED and FP32 in steps.plans
                and steps.within(FP32, self.pace, self.slowdown) is Verdict.ABOVE
                and steps.faster(plan, FP32, self.config.measurement.speed_margin) is Verdict.BELOW):
            return Verdict.BELOW
        return verdict

    @property
    def spends_levers(self) -> bool:
        """Whether memory levers (saved precisions, recompute, optimizer state, masters) are spent on the plan
        :meth:`winner` chooses: then the memory and balanced objectives choose it for room (see the module
        docstring)."""
        return self.weighs_memory and any(
            self.config.tried(dimension) for dimension in (Dimension.SAVED, Dimension.STATE, Dimension.MASTER))

    @property
    def saved_options(self) -> tuple[SavedPrecision, ...]:
        """The saved precisions this objective tries for what operators save, smallest first (empty: none)."""
        if not self.weighs_memory:
            return ()
        return tuple(v for v in self.config.tried(Dimension.SAVED) if v is not SavedPrecision.RECOMPUTE)

    @property
    def recomputes(self) -> bool:
        """Whether this objective offers cheap operators recomputation instead of storage."""
        return self.weighs_memory and SavedPrecision.RECOMPUTE in self.config.tried(Dimension.SAVED)

    # ------------------------------------------------------------------------------------------------ per operator
    @abstractmethod
    def operator(self, time: RatioEstimate, t32: float, tlow: float, memory_ratio: float,
                 bytes_saved: float) -> Judgement:
        """One operator in low precision against FP32: its time ratio, times (ms), memory ratio and bytes saved."""

    # -------------------------------------------------------------------------------------------------- whole step
    @abstractmethod
    def candidates_pay(self, steps: StepComparison) -> Verdict:
        """Whether the candidate plan as a whole is worth trialling against FP32."""

    @abstractmethod
    def winner(self, steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
               have_candidates: bool) -> ComparedPlan | None:
        """The alternative plan (one of ``labels``) to trial instead of the candidates, if one wins beyond doubt.

        Args:
            steps: whole-step times of ``FP32``, ``CANDIDATES`` (if any) and ``labels``.
            saved: bytes saved for backward per configuration (for the objectives that weigh memory).
            labels: the alternatives.
            have_candidates: whether a per-operator candidate plan exists (else alternatives compete with FP32).
        """

    @abstractmethod
    def undecided(self, steps: StepComparison, labels: list[ComparedPlan]) -> frozenset[ComparedPlan]:
        """The plans (``FP32``, ``CANDIDATES`` and of ``labels``) of the whole-step comparisons this policy decides
        from that could not tell their plans apart (empty: every one is decided). Asked while the whole steps are
        timed: against the pace ``steps`` show so far."""

    # ------------------------------------------------------------------------------------------ saved-for-backward
    def saved(self, time: RatioEstimate, memory_ratio: float, bytes_saved: float) -> Judgement:
        """One saved precision of an operator (or group) against saving as computed.

        Raises:
            UsageError: for an objective that chooses no saved precision.
        """
        raise UsageError(f"objective={self.objective.value!r} chooses no saved precision.")


class ThroughputPolicy(ObjectivePolicy):
    """Lower what gets faster."""

    objective = Objective.THROUGHPUT
    better = "faster as a whole"
    weighs_memory = False
    refines = True

    def operator(self, time: RatioEstimate, t32: float, tlow: float, memory_ratio: float,
                 bytes_saved: float) -> Judgement:
        verdict = time.against(self.keep)
        if verdict is Verdict.BELOW and t32 * (1 - time.ratio) < self.config.measurement.min_gain_ms:
            verdict = Verdict.ABOVE  # faster, but by less than min_gain_ms: not worth a trial
        elif verdict is Verdict.UNDECIDED and t32 * (1 - time.low) < self.config.measurement.min_gain_ms:
            verdict = Verdict.ABOVE  # even at its best it would gain less than min_gain_ms
        return Judgement(verdict, _shown(time, t32, tlow), t32 - tlow)

    def candidates_pay(self, steps: StepComparison) -> Verdict:
        """``BELOW`` when the candidates' median step-time ratio to FP32 beats the margin (the rounds' budget was
        spent on telling it where it was close), else ``ABOVE``."""
        keep = 1 - self.config.measurement.speed_margin
        return Verdict.BELOW if steps.median_to_fp32(CANDIDATES) <= keep else Verdict.ABOVE

    def winner(self, steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
               have_candidates: bool) -> ComparedPlan | None:
        """The fastest measured plan, by the median of paired rounds: an alternative when it is the fastest and beats
        FP32 by ``speed_margin`` (``None``: the candidates, or FP32, are the fastest). No plan is kept for its label:
        where two are close, more rounds were taken first (:meth:`undecided`)."""
        best = steps.fastest()
        keep = 1 - self.config.measurement.speed_margin
        return best if best in labels and steps.median_to_fp32(best) <= keep else None

    def undecided(self, steps: StepComparison, labels: list[ComparedPlan]) -> frozenset[ComparedPlan]:
        return steps.too_close_to_tell(self.config.measurement.speed_margin)


class MemoryPolicy(ObjectivePolicy):
    """Lower what saves memory for backward, within ``max_slowdown_vs_fastest`` of the fastest fixed policy."""

    objective = Objective.MEMORY
    better = "leaner as a whole"

    def operator(self, time: RatioEstimate, t32: float, tlow: float, memory_ratio: float,
                 bytes_saved: float) -> Judgement:
        verdict = Verdict.ABOVE if memory_ratio > self.keep else time.against(self.slowdown)
        return Judgement(verdict, f"saved bytes x{memory_ratio:.2f}, {_shown(time, t32, tlow)}", bytes_saved)

    def candidates_pay(self, steps: StepComparison) -> Verdict:
        """Each candidate saves memory within the slowdown (per operator); as a whole the plan must stay within it
        of the pace (where levers are spent, not past it beyond doubt: the levers' own check holds the bound)."""
        verdict = self.bound_against_fp32(steps, CANDIDATES)
        return Verdict.BELOW if self.spends_levers and verdict is Verdict.UNDECIDED else verdict

    def winner(self, steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
               have_candidates: bool) -> ComparedPlan | None:
        """Where levers are spent (:attr:`spends_levers`), the plan (not past the bound beyond doubt) that should end
        leanest once they are (:func:`~lightning_comp.search.decisions.levers_base.base_for_the_levers`).

        Otherwise the leanest plan within the slowdown of the pace: an alternative when it saves the margin's share
        of the candidates' bytes (or the candidates are past the bound), or when it saves as much as they do and is
        faster beyond doubt; when no plan is within the bound, the leanest of the plans the fastest one does not beat
        by the margin beyond doubt (a plan a few per cent faster by the median, within the rounds' noise, does not
        displace one that saves half the bytes). So the plan is never both slower and fatter than AMP's."""
        margin = self.config.measurement.speed_margin
        if self.spends_levers:
            return base_for_the_levers(self, steps, saved, labels, have_candidates)
        within = [plan for plan in ([CANDIDATES] if have_candidates else []) + labels
                  if steps.within(plan, self.pace, self.slowdown) is Verdict.BELOW]
        if within:
            best = min(within, key=lambda plan: saved[plan])
            if best != CANDIDATES and CANDIDATES in within and saved[best] > saved[CANDIDATES] * self.keep:
                best = CANDIDATES  # not leaner by the margin: the candidates stay, unless dominated (below)
            if best == CANDIDATES:
                # never slower and no leaner than a fixed policy: one that saves as little and is faster wins
                dominating = [plan for plan in labels if saved[plan] <= saved[CANDIDATES]
                              and steps.faster(plan, CANDIDATES, margin) is Verdict.BELOW and plan in within]
                return min(dominating, key=lambda plan: saved[plan]) if dominating else None
            return best
        return _leanest_of_the_fastest(steps, saved, labels, have_candidates, margin)

    def undecided(self, steps: StepComparison, labels: list[ComparedPlan]) -> frozenset[ComparedPlan]:
        # (where levers are spent the base is decided by medians, which more rounds refine but need not settle)
        return _bound_involved(steps, [CANDIDATES, *labels], steps.pace(), self.slowdown)

    def saved(self, time: RatioEstimate, memory_ratio: float, bytes_saved: float) -> Judgement:
        return Judgement(time.against(self.slowdown), "", bytes_saved)


class BalancedPolicy(ObjectivePolicy):
    """Lower what improves the balanced score (time x memory), within ``max_slowdown_vs_fastest`` of the fastest
    fixed policy."""

    objective = Objective.BALANCED
    better = "better in time x memory as a whole"

    def operator(self, time: RatioEstimate, t32: float, tlow: float, memory_ratio: float,
                 bytes_saved: float) -> Judgement:
        score = balanced_score(time.ratio, memory_ratio)
        why = f"{_shown(time, t32, tlow)}, saved bytes x{memory_ratio:.2f}, balanced x{score:.2f}"
        # no bound per operator: an operator's own slowdown is a small share of the step; the whole steps hold it
        return Judgement(_balanced_verdict(time, memory_ratio, self.keep), why, 1.0 - score)

    def candidates_pay(self, steps: StepComparison) -> Verdict:
        verdicts = {steps.faster(CANDIDATES, FP32, self.config.measurement.speed_margin),
                    self.bound_against_fp32(steps, CANDIDATES)}
        for verdict in (Verdict.ABOVE, Verdict.UNDECIDED):
            if verdict in verdicts:
                return verdict
        return Verdict.BELOW

    def winner(self, steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
               have_candidates: bool) -> ComparedPlan | None:
        """Where levers are spent (:attr:`spends_levers`), the plan that should end best once they are
        (:func:`~lightning_comp.search.decisions.levers_base.base_for_the_levers`): the levers take bytes only while
        each frees a larger share of the step's bytes than the share of time it adds, so time and bytes trade at the
        incumbent's own bytes per millisecond, which is the cost that rule minimises (to first order, the balanced
        score's product). The rule without levers (below) keeps the candidates unless an alternative's score beats
        theirs beyond doubt: on cnn the candidates (125.3 ms, 77.8 MiB saved) and AMP's plan (125.5 ms, 73.8 MiB) tied
        on time, the candidates stayed, and the levers (2.4 ms of room) ended 1.02x AMP's step bytes at x1.04 of its
        step: worse than AMP's plan on both.

        Otherwise an alternative whose balanced score at its worst beats the incumbent's at its best by the margin,
        within the bound."""
        if self.spends_levers:
            return base_for_the_levers(self, steps, saved, labels, have_candidates)
        incumbent = CANDIDATES if have_candidates else FP32

        def score(label: ComparedPlan, end: str = "ratio") -> float:
            if label == FP32:
                return 1.0
            return balanced_score(getattr(steps.ratio(label, FP32), end), saved[label] / max(saved[FP32], 1.0))

        bar = score(incumbent, "low") * self.keep  # the incumbent at its best
        if have_candidates and self.bound_holds(steps, CANDIDATES) is Verdict.ABOVE:
            bar = math.inf  # the candidates are past the bound: any alternative within it is better
        winners = [label for label in labels if score(label, "high") <= bar
                   and self.bound_holds(steps, label) is Verdict.BELOW]
        return min(winners, key=score) if winners else None

    def undecided(self, steps: StepComparison, labels: list[ComparedPlan]) -> frozenset[ComparedPlan]:
        return (_slowdown_involved(steps, labels, self.keep)
                | _bound_involved(steps, [CANDIDATES, *labels], steps.pace(), self.slowdown))

    def saved(self, time: RatioEstimate, memory_ratio: float, bytes_saved: float) -> Judgement:
        return Judgement(_balanced_verdict(time, memory_ratio, self.keep), "",
                         1.0 - balanced_score(time.ratio, memory_ratio))


_POLICIES: dict[Objective, type[ObjectivePolicy]] = {
    policy.objective: policy for policy in (ThroughputPolicy, MemoryPolicy, BalancedPolicy)}


def policy_for(config: SearchConfig) -> ObjectivePolicy:
    """The policy of ``config.objective``."""
    return _POLICIES[config.objective](config)


def _leanest_of_the_fastest(steps: StepComparison, saved: dict[ComparedPlan, float], labels: list[ComparedPlan],
                            have_candidates: bool, margin: float) -> ComparedPlan | None:
    """The leanest of the plans (the candidates, or FP32 without them, and ``labels``) that the fastest of them does
    not beat by ``margin`` beyond doubt; a tie in bytes goes to the candidates (``None``: they, or FP32, win)."""
    if not labels:
        return None
    incumbent = CANDIDATES if have_candidates else FP32
    contenders = [incumbent, *labels]
    fastest = min(contenders, key=steps.median_to_fp32)
    tied = [plan for plan in contenders if plan == fastest or steps.faster(fastest, plan, margin) is not Verdict.BELOW]
    best = min(tied, key=lambda plan: (saved[plan], plan != incumbent))
    return None if best == incumbent else best


def _slowdown_involved(steps: StepComparison, labels: list[ComparedPlan], limit: float) -> frozenset[ComparedPlan]:
    """The plans whose step time against FP32's cannot be told below or above ``limit`` (and FP32 with them)."""
    return frozenset(label for plan in labels if steps.ratio(plan, FP32).against(limit) is Verdict.UNDECIDED
                     for label in (plan, FP32))


def _bound_involved(steps: StepComparison, plans: list[ComparedPlan], pace: Pace,
                    slowdown: float) -> frozenset[ComparedPlan]:
    """The plans (of ``plans`` that were timed) whose step against the pace's cannot be told within ``slowdown`` or
    past it yet (and the pace with them, or FP32 where the pace was not timed beside them)."""
    anchor = pace.plan if pace.plan in steps.ms else FP32
    return frozenset(label for plan in plans if plan in steps.ms
                     and steps.within(plan, pace, slowdown) is Verdict.UNDECIDED for label in (plan, anchor))


def _shown(time: RatioEstimate, t32: float, tlow: float) -> str:
    return f"time {time.describe()} ({t32:.4f} -> {tlow:.4f} ms)"
