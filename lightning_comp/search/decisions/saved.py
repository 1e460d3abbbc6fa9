"""Each operator's saved precision (memory and balanced objectives) from the saved stage's measurements.

Operators that save the same tensor (a ReLU's output is the next Linear's saved input) are judged as one group
(:func:`sharing_groups`): only together do they free it. A saved lowering qualifies when it saves at least
``speed_margin`` of the bytes and the objective's policy accepts its time (:func:`judge_saved`); of two that qualify
the smaller wins. Recomputation is judged by the same rule, per unit of cheap operators
(:mod:`lightning_comp.search.decisions.recompute_units`). A lowering another operator would still hold as computed,
or may recompute, is dropped (:func:`unshared_choices`: both forms would be held, or the recipe replaces it). What is
taken of them is decided with every other memory lever, cheapest bytes first
(:mod:`lightning_comp.search.stages.memory_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.search.decisions.objectives import ObjectivePolicy
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict

__all__ = ["SavedDecision", "judge_saved", "sharing_groups", "unshared_choices"]


@dataclass
class SavedDecision:
    """One operator's decision on the precision of what it saves for backward (its record form:
    :mod:`lightning_comp.search.record.batch`).

    Attributes:
        decision: the saved precision chosen (``FP32``: as computed).
        reason: why, in words.
        bytes: the bytes it (or its group) saves, as computed (``"fp32"``) and at each precision measured.
        time_ratios: per precision measured, its time relative to saving as computed: ``[ratio, low, high]``.
        gain_bytes: the bytes the chosen precision saves per step (0 when saved as computed).
        benefit: what the chosen precision gains in the objective's unit (ranks fallback groups).
        group: the operators judged together with it (they save the same tensors, or they recompute as one unit), if
            any.
        forced: ``CoMPSearch(include_dimensions={"saved": ...})`` named it.
        unit: for a recompute decision, the label of the recompute unit it was judged in
            (:mod:`lightning_comp.search.decisions.recompute_units`).
        timed: for a recompute decision, the operators whose forward and backward ``time_ratios`` are of: the unit's
            members and its consumers, whose backward runs the recomputation (``None``: those in ``group``, or the
            operator alone).
        held_by: operators outside its group that save one of the same tensors and have no codec of their own (a
            ReLU, in a recompute unit, saving the output the next convolution saves as its input): they keep it as
            computed, or their recomputation replaces every form of it, so a codec of this operator frees nothing
            and its codec options are not offered to the memory levers (empty: none).
        direct_ms: per precision, what it adds to a step timed directly (its group's or recompute unit's, whole: a
            codec's casts, or the re-runs of the unit's forwards in backward;
            :mod:`~lightning_comp.search.measurement.direct_timing`), on the whole-step rounds' scale (its share of
            the candidate plan's step in the rounds it was timed in, times that step as the whole-step rounds measured
            it), which prices its memory lever instead of ``time_ratios`` (empty: not timed so).
    """

    decision: SavedPrecision = SavedPrecision.FP32
    reason: str = ""
    bytes: dict[str, int] = field(default_factory=dict)
    time_ratios: dict[str, list[float]] = field(default_factory=dict)
    gain_bytes: int = 0
    benefit: float = 0.0
    group: tuple[str, ...] | None = None
    forced: bool = False
    unit: str | None = None
    timed: tuple[str, ...] | None = None
    held_by: tuple[str, ...] = ()
    direct_ms: dict[str, float] = field(default_factory=dict)

    @property
    def lowers(self) -> bool:
        """Whether it stores its saved tensors lower than computed."""
        return self.decision.changes

    def keep_as_computed(self, reason: str) -> None:
        """Save as computed after all (not taken, or a neighbour found against it)."""
        self.decision, self.reason, self.gain_bytes, self.benefit = SavedPrecision.FP32, reason, 0, 0.0


def sharing_groups(names: Sequence[str], sharing: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """``names`` grouped by the tensors they save: connected through ``ProfileResult.sharing``, in order."""
    position = {name: i for i, name in enumerate(names)}
    seen: set[str] = set()
    groups = []
    for name in names:
        if name in seen:
            continue
        group, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current in group or current not in position:
                continue
            group.add(current)
            todo.extend(sharing.get(current, ()))
        seen |= group
        groups.append(tuple(sorted(group, key=position.__getitem__)))
    return groups


def unshared_choices(choices: dict[str, SavedPrecision], sharing: dict[str, set[str]],
                     forced: set[str]) -> dict[str, str]:
    """The lowerings in ``choices`` that cannot pay because another operator keeps the same tensor as computed.

    A tensor saved by two operators is held once; if one of them stores it compressed and the other as computed,
    both forms are held and nothing is saved. Such a lowering is dropped (unless forced), which may make others
    unshared in turn, so this repeats until nothing changes.

    Args:
        choices: operator -> saved precision chosen from its own measurement.
        sharing: operator -> the other operators that save one of its tensors (``ProfileResult.sharing``).
        forced: operators whose lowering ``include_dimensions`` forces (never dropped).

    Returns:
        operator -> why its lowering is dropped.
    """
    kept, dropped = dict(choices), {}
    changed = True
    while changed:
        changed = False
        for name in sorted(kept):
            if name in forced:
                continue
            holders = sorted(other for other in sharing.get(name, ()) if other not in kept)
            recomputing = [] if kept[name].recomputes else sorted(
                other for other in sharing.get(name, ()) if other in kept and kept[other].recomputes)
            if holders:
                dropped[name] = (f"saves as computed: a tensor it saves is also saved by {_shown(holders)}, which"
                                 " keep(s) it as computed, so both forms would be held")
            elif recomputing:
                dropped[name] = (f"saves as computed: a tensor it saves is also saved by {_shown(recomputing)}, which"
                                 " may recompute it: then its recipe is stored in place of any compressed form (and"
                                 " the bytes are the recomputation's), else it is kept as computed beside the"
                                 " compressed one; either way compressing it frees nothing")
            else:
                continue
            del kept[name]
            changed = True
    return dropped


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def judge_saved(policy: ObjectivePolicy, base_bytes: int,
                options: dict[SavedPrecision, tuple[int, RatioEstimate]]) -> SavedDecision:
    """One operator's (or group's) saved precision from its measurements, by ``policy``.

    Args:
        policy: the objective's policy (memory or balanced).
        base_bytes: bytes it saves as computed.
        options: per saved precision, the bytes it saves and its time relative to saving as computed.
    """
    decision = SavedDecision(bytes={"fp32": int(base_bytes)})
    reasons = []
    for saved, (nbytes, time) in sorted(options.items(), key=lambda item: item[1][0]):
        decision.bytes[saved.value] = int(nbytes)
        decision.time_ratios[saved.value] = [time.ratio, time.low, time.high]
        if decision.lowers:
            continue
        memory_ratio = nbytes / base_bytes if base_bytes > 0 else 1.0
        shown = f"{saved.value}: bytes x{memory_ratio:.2f}, time {time.describe()}"
        if memory_ratio > policy.keep:
            reasons.append(f"{shown} saves too little")
            continue
        judged = policy.saved(time, memory_ratio, float(base_bytes - nbytes))
        if judged.verdict is Verdict.BELOW:
            decision.decision, decision.reason = saved, f"pays: {shown}"
            decision.gain_bytes, decision.benefit = int(base_bytes - nbytes), judged.benefit
        else:
            why = "costs too much time" if judged.verdict is Verdict.ABOVE else "undecided in time"
            reasons.append(f"{shown} {why}")
    if not decision.lowers:
        decision.reason = f"saves as computed: {'; '.join(reasons) or 'saves nothing for backward'}"
    return decision
