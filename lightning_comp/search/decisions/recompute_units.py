"""Recomputation judged unit by unit: which cheap operators recompute together, what each unit frees, what it costs.

Judged as one group against the whole step, a model's recomputation is kept or dropped all at once: on the zoo's
``cnn`` the group cost x1.47 of the step and was dropped whole, the part that would have been cheap with it. Here the
recomputable operators are split into units, each judged on its own bytes and time from the two profiles the saved
stage takes anyway (every operator saving as computed, and every recomputable one recomputing): no profile
configuration is added.

**Units** (:func:`recompute_units`). A unit is a run of recomputable operators that follow one another in execution
order: any other operator that runs between two of them (a matmul, a convolution, attention, a shape-only view, one
excluded or computing in place) ends the run, and so does the step from one repeat of a block to the next
(:func:`block_of`: ``blocks.3.mlp.act`` lies in ``blocks.3``; ``blocks.3.mlp.drop`` then ``blocks.4.ln1``), unless the
next operator saves a tensor the run saves (it computes on the run's output). A run recomputes as a chain (BatchNorm
then ReLU: the ReLU's recipe holds the BatchNorm's output, itself a recipe), and an operator that is not recomputed
cuts the chain (its output is a real tensor), so units recompute independently of each other: what one frees and
what it costs are its own, and splitting a chain would charge the chain's recomputation to whichever unit's consumer
unpacks it first. A model without repeated blocks gets one unit per run between its compute operators (the zoo's
``cnn``: each ConvBN block's BatchNorm and ReLU, with the stage's MaxPool after its last); a transformer one per cheap
part of each block (``blocks.3.ln1``, ``blocks.3.mlp.act``).

**What a unit frees and costs** (:func:`measure_units`). Recomputing an operator frees what is saved of its output,
which shows in its *consumers'* saved bytes (the Linear after a GELU no longer holds the GELU's output) and in its
own (a ReLU saves its output). A consumer is an operator outside every unit whose saved bytes differ between the two
profiles; it is attributed to the unit it shares a saved tensor with, else (a container computing on its children's
outputs) to the last unit inside it, else to the unit that ran last before it. A unit's bytes are its members' and
consumers' saved bytes (each storage counted at the first operator that saves it, so the units' changes add up to
the step's), and its time their forward and backward per round: the backward of every operator that unpacks a
recipe runs the recomputation. The attribution follows execution order; a consumer that runs after a later unit (a
ResNet's downsampling convolution, after the block's own ReLUs) is charged to that later unit.

**Pooled** (:func:`pool_units`). Units playing the same part in repeated blocks (their members, in order, play the
same parts: :func:`~lightning_comp.search.decisions.groups.group_operators`) are judged as one: their bytes and
per-round times summed, one verdict, as the compute decisions pool their operators. Judged apart, each block would
draw its own noise, and a plan recomputing ``blocks.1.ln1`` but not ``blocks.2.ln1`` would tell chance, not
structure.

**Judged** (:func:`judge_units`) by the objective's policy
(:func:`~lightning_comp.search.decisions.saved.judge_saved`): it must keep at most ``1 - speed_margin`` of its bytes
and its time must stay within the policy's slowdown. Where the interval of a unit's paired rounds straddles the bound
(:func:`undecided_units`), the saved stage measures more rounds of the same configurations, within the
``extra_profile_time`` budget, before judging. Each member's decision names its unit and that unit's bytes and
time. The saved stage offers a unit that frees enough bytes to the memory levers even where its time is past the
bound (its own operators' ratio is not the step's), and those levers decide, cheapest bytes first.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from torch import nn

from lightning_comp.errors import UsageError
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.search.decisions.groups import abstract_path, group_operators, pooled_series
from lightning_comp.search.decisions.objectives import ObjectivePolicy
from lightning_comp.search.decisions.saved import SavedDecision, judge_saved
from lightning_comp.search.measurement.estimates import RatioEstimate, Verdict, paired_ratio
from lightning_comp.search.measurement.profiling import ProfileResult

__all__ = ["PooledUnit", "RecomputeUnit", "UnitMeasurement", "block_of", "judge_units", "measure_units",
           "pool_units", "recompute_units", "undecided_units", "unit_label"]

MIB = 2**20


def block_of(name: str) -> str | None:
    """The innermost repeated block ``name`` lies in: its path up to its last numeric part that is not its own last
    part (``blocks.3.mlp.act`` -> ``blocks.3``, ``features.0.1.1`` -> ``features.0.1``); ``None`` for an operator
    in no block (``ln_f``, or ``net.1`` of a plain ``Sequential``)."""
    parts = name.split(".")
    for index in range(len(parts) - 2, -1, -1):
        if parts[index].isdigit():
            return ".".join(parts[: index + 1])
    return None


def unit_label(members: Sequence[str]) -> str:
    """How the record names a unit of ``members``: the name of a single one; else their common path with the rest
    in braces (``features.0.{1.1, 1.2, 2}``)."""
    if len(members) == 1:
        return members[0]
    split = [name.split(".") for name in members]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    common = common[: min(len(p) for p in split) - 1]  # every member keeps a part of its own
    rests = ", ".join(".".join(parts[len(common):]) for parts in split)
    return f"{'.'.join(common)}.{{{rests}}}" if common else "{" + rests + "}"


@dataclass(frozen=True)
class RecomputeUnit:
    """Recomputable operators that recompute together: a run of them in execution order (see the module docstring).

    Attributes:
        members: the operators, in execution order.
    """

    members: tuple[str, ...]

    @property
    def block(self) -> str | None:
        """The repeated block its first member lies in (:func:`block_of`)."""
        return block_of(self.members[0])

    @property
    def label(self) -> str:
        """Its name in the record (:func:`unit_label`)."""
        return unit_label(self.members)


def recompute_units(order: Sequence[str], recomputable: Collection[str],
                    sharing: Mapping[str, Collection[str]]) -> list[RecomputeUnit]:
    """The recomputable operators of ``order`` split into units, in execution order.

    Args:
        order: every operator that ran, in the order it first ran (``ProfileResult.order``).
        recomputable: the operators offered ``recompute`` (others in ``order`` end a unit).
        sharing: per operator, the others that save a tensor it saves (``ProfileResult.sharing``): a run goes on
            across a block boundary where the next operator saves a tensor the run saves.
    """
    units: list[RecomputeUnit] = []
    run: list[str] = []
    for name in order:
        if name not in recomputable:
            if run:
                units.append(RecomputeUnit(tuple(run)))
                run = []
            continue
        if run and _next_repeat(run[-1], name) and not set(sharing.get(name, ())) & set(run):
            units.append(RecomputeUnit(tuple(run)))
            run = []
        if name not in run:  # (an operator runs once in ``order``; guard a caller's repeats)
            run.append(name)
    if run:
        units.append(RecomputeUnit(tuple(run)))
    return units


def _next_repeat(last: str, name: str) -> bool:
    """Whether ``name`` lies in another repeat of the block ``last`` lies in (``blocks.2.ln1`` after
    ``blocks.1.mlp.drop``); leaving a block for its container, or entering one, is not (``features.0.2``, the
    MaxPool after ``features.0.1.2``, the ReLU of the stage's last ConvBN block, computes on its output)."""
    here, there = block_of(last), block_of(name)
    return here is not None and there is not None and here != there and abstract_path(here) == abstract_path(there)


@dataclass(frozen=True)
class UnitMeasurement:
    """What one unit frees and costs, from the profile saving as computed and the one recomputing.

    Attributes:
        unit: the unit.
        consumers: the operators outside every unit whose saved bytes its recomputation changes (they save its
            outputs), in execution order.
        bytes_before: what its members and consumers save for backward as computed (each storage at its first saver).
        bytes_after: the same with the unit recomputing.
        before_ms: per round, its members' and consumers' forward and backward as computed.
        after_ms: the same with the unit recomputing (their backward runs the recomputation).
    """

    unit: RecomputeUnit
    consumers: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    before_ms: tuple[float, ...]
    after_ms: tuple[float, ...]

    @property
    def timed(self) -> tuple[str, ...]:
        """The operators whose time it is judged by: its members, then its consumers."""
        return self.unit.members + self.consumers

    @property
    def time(self) -> RatioEstimate:
        """Its time recomputing relative to saving as computed, over the paired rounds."""
        return paired_ratio(self.before_ms, self.after_ms)

    def describe(self) -> str:
        """Its bytes and time in words."""
        return f"{self.unit.label}{_bytes_and_time(self.consumers, self.bytes_before, self.bytes_after, self.time)}"


def measure_units(units: Sequence[RecomputeUnit], before: ProfileResult, after: ProfileResult,
                  ) -> tuple[list[UnitMeasurement], tuple[str, ...]]:
    """Each unit's bytes and time, its consumers attributed (see the module docstring).

    Args:
        units: the units (:func:`recompute_units`); each member must have run in both profiles.
        before: the profile with every operator saving as computed.
        after: the profile with every unit recomputing (rounds paired with ``before``'s).

    Returns:
        the units' measurements, in ``units``' order, and the operators whose saved bytes changed but that no unit
        ran before (attributed to none).

    Raises:
        UsageError: if a member did not run in both profiles, or the profiles hold different numbers of rounds.
    """
    if len(before.rounds) != len(after.rounds):
        raise UsageError(f"the two profiles must hold paired rounds: {len(before.rounds)} and {len(after.rounds)}")
    missing = [n for u in units for n in u.members if n not in before.operators or n not in after.operators]
    if missing:
        raise UsageError(f"unit members {missing} did not run in both profiles; units are made of operators that did")
    unit_of = {name: index for index, unit in enumerate(units) for name in unit.members}
    position = {name: i for i, name in enumerate(before.order)}
    consumers: list[list[str]] = [[] for _ in units]
    unattributed: list[str] = []
    for name in before.order:
        if name in unit_of or name not in before.operators or name not in after.operators:
            continue
        was, now = before.operators[name], after.operators[name]
        if was.own_saved_bytes == now.own_saved_bytes and was.saved_bytes == now.saved_bytes:
            continue
        index = _attributed(name, units, unit_of, position, before.sharing)
        if index is None:
            unattributed.append(name)
        else:
            consumers[index].append(name)
    measured = []
    for unit, extra in zip(units, consumers):
        names = unit.members + tuple(extra)
        measured.append(UnitMeasurement(
            unit, tuple(extra),
            bytes_before=sum(before.operators[n].saved_bytes for n in names),
            bytes_after=sum(after.operators[n].saved_bytes for n in names),
            before_ms=tuple(pooled_series(before.series(n) for n in names)),
            after_ms=tuple(pooled_series(after.series(n) for n in names))))
    return measured, tuple(unattributed)


def _attributed(name: str, units: Sequence[RecomputeUnit], unit_of: Mapping[str, int], position: Mapping[str, int],
                sharing: Mapping[str, Collection[str]]) -> int | None:
    """The unit a consumer ``name`` is attributed to: the one it shares a saved tensor with (the last before it, if
    several), else the last inside it (a container computing on its children's outputs), else the one that ran last
    before it; ``None``: none ran before it."""
    here = position[name]
    shared = sorted({unit_of[other] for other in sharing.get(name, ()) if other in unit_of},
                    key=lambda i: position[units[i].members[0]])
    if shared:
        earlier = [i for i in shared if position[units[i].members[0]] < here]
        return earlier[-1] if earlier else shared[0]
    inside = [i for i, unit in enumerate(units) if any(m.startswith(name + ".") for m in unit.members)]
    if inside:
        return max(inside, key=lambda i: position[units[i].members[-1]])
    before_it = [m for m in unit_of if position[m] < here]
    return unit_of[max(before_it, key=position.__getitem__)] if before_it else None


@dataclass(frozen=True)
class PooledUnit:
    """Units playing the same part in repeated blocks, judged as one (a single unit where none repeats).

    Attributes:
        measurements: the units' measurements, in execution order.
        label: its name in the record: the unit's label, or the pattern of its members with the unit count.
    """

    measurements: tuple[UnitMeasurement, ...]
    label: str

    @property
    def members(self) -> tuple[str, ...]:
        """Every unit's members, in execution order."""
        return tuple(n for m in self.measurements for n in m.unit.members)

    @property
    def timed(self) -> tuple[str, ...]:
        """Every operator whose time it is judged by (members and consumers)."""
        return tuple(n for m in self.measurements for n in m.timed)

    @property
    def consumers(self) -> tuple[str, ...]:
        """Every unit's consumers."""
        return tuple(n for m in self.measurements for n in m.consumers)

    @property
    def bytes_before(self) -> int:
        """What its units and their consumers save as computed."""
        return sum(m.bytes_before for m in self.measurements)

    @property
    def bytes_after(self) -> int:
        """The same with its units recomputing."""
        return sum(m.bytes_after for m in self.measurements)

    @cached_property
    def time(self) -> RatioEstimate:
        """Its time recomputing relative to saving as computed: the per-round sums of its units' times, paired."""
        return paired_ratio(pooled_series(m.before_ms for m in self.measurements),
                            pooled_series(m.after_ms for m in self.measurements))

    @cached_property
    def extra_ms(self) -> float:
        """What recomputing adds to a step (ms): the median of the paired rounds' differences."""
        before = pooled_series(m.before_ms for m in self.measurements)
        after = pooled_series(m.after_ms for m in self.measurements)
        return float(statistics.median(b - a for a, b in zip(before, after))) if before else 0.0

    def describe(self) -> str:
        """Its bytes and time in words."""
        shown = _bytes_and_time(self.consumers, self.bytes_before, self.bytes_after, self.time)
        pooled = (f"; pooled over {len(self.measurements)} units playing the same part in repeated blocks"
                  if len(self.measurements) > 1 else "")
        return f"{self.label}{shown}, {self.extra_ms:+.3f} ms a step{pooled}"


def pool_units(measured: Sequence[UnitMeasurement], modules: Mapping[str, nn.Module],
               all_names: Iterable[str] | None = None) -> list[PooledUnit]:
    """``measured`` pooled by the part they play: units whose members, in order, play the same parts
    (:func:`~lightning_comp.search.decisions.groups.group_operators`) are one, in the order of their first unit.

    Args:
        measured: the units' measurements (:func:`measure_units`).
        modules: the model's operators by name (at least every member).
        all_names: every operator name of the model (passed on to ``group_operators``).
    """
    names = [n for m in measured for n in m.unit.members]
    part = {name: index for index, group in enumerate(group_operators(names, modules, all_names))
            for name in group.members}
    by_parts: dict[tuple[int, ...], list[UnitMeasurement]] = {}
    for measurement in measured:
        by_parts.setdefault(tuple(part[n] for n in measurement.unit.members), []).append(measurement)
    pooled = []
    for units in by_parts.values():
        first = units[0].unit
        label = first.label if len(units) == 1 else (
            f"{unit_label([abstract_path(n) for n in first.members])} (x{len(units)})")
        pooled.append(PooledUnit(tuple(units), label))
    return pooled


def undecided_units(policy: ObjectivePolicy, pooled: Sequence[PooledUnit]) -> list[PooledUnit]:
    """The units whose time ``policy`` cannot yet tell from its bound (the interval of their paired rounds straddles
    it) and that free enough bytes to be worth more rounds."""
    close = []
    for unit in pooled:
        memory_ratio = unit.bytes_after / unit.bytes_before if unit.bytes_before > 0 else 1.0
        if memory_ratio <= policy.keep and policy.saved(unit.time, memory_ratio, float(
                unit.bytes_before - unit.bytes_after)).verdict is Verdict.UNDECIDED:
            close.append(unit)
    return close


def judge_units(policy: ObjectivePolicy, pooled: Sequence[PooledUnit]) -> dict[str, SavedDecision]:
    """Each member's recompute decision: its pooled unit judged as one by ``policy``
    (:func:`~lightning_comp.search.decisions.saved.judge_saved`), each member holding an equal share of what the unit
    gains; the reason names the unit, its bytes and its time (and, where pooled, the member's own unit's)."""
    decisions: dict[str, SavedDecision] = {}
    for unit in pooled:
        shared = judge_saved(policy, unit.bytes_before, {SavedPrecision.RECOMPUTE: (unit.bytes_after, unit.time)})
        members = unit.members
        for measurement in unit.measurements:
            own = f"; this operator's unit {measurement.describe()}" if len(unit.measurements) > 1 else ""
            for name in measurement.unit.members:
                decisions[name] = replace(
                    shared, bytes=dict(shared.bytes), time_ratios=dict(shared.time_ratios),
                    gain_bytes=shared.gain_bytes // len(members), benefit=shared.benefit / len(members),
                    group=members if len(members) > 1 else None, unit=unit.label, timed=unit.timed,
                    reason=f"{shared.reason} (judged in recompute unit {unit.describe()}{own})")
    return decisions


def _bytes_and_time(consumers: Sequence[str], before: int, after: int, time: RatioEstimate) -> str:
    who = f"its own and its consumers' ({_names(consumers)})" if consumers else "its own (no consumer)"
    return (f": saved bytes, {who}, {_size(before, after)}, their forward and backward"
            f" x{time.ratio:.2f} [{time.low:.2f}, {time.high:.2f}]")


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _size(before: int, after: int) -> str:
    """``before -> after`` in MiB, or in KiB where both are under a tenth of a MiB."""
    if max(before, after) < MIB // 10:
        return f"{before / 2**10:.1f} -> {after / 2**10:.1f} KiB"
    return f"{before / MIB:.2f} -> {after / MIB:.2f} MiB"
