"""The memory levers the saved and parameter stages measured, as the spending takes them: each a
:class:`~lightning_comp.search.decisions.cheapest_bytes.Lever` of mutually exclusive options (bytes freed, time added),
with what each option writes into the plan (:class:`LeverChange`).

:class:`LeverBuilder` reads the operators' decisions: an operator's (or recompute unit's) saved precisions, priced over
every operator it timed at the precision each computes in under the base plan; an operator's optimizer-state formats,
and its bf16 master where it computes in bf16, priced by the update's cost model fitted over every operator's timings
(:mod:`lightning_comp.search.decisions.update_costs`). A saved codec (bf16, fp8) is priced by its casts, and a recompute
unit by its re-runs, timed directly in the profiled steps (:mod:`lightning_comp.search.measurement.direct_timing`), not
by the difference the operators' whole times showed; a codec judged by its time ratio alone is priced by a model of the
update's kind fitted per codec over the operators measured so (:mod:`lightning_comp.search.decisions.codec_costs`).
Levers of operators playing the same part in repeated blocks are pooled into one (their bytes and times summed), as
their compute precision is decided. A recompute unit and the codec lever of the operators that consume its output (and
save it for backward) are one lever of exclusive options (:meth:`LeverBuilder._with_consumers`): recomputed, the unit's
output is stored as a recipe wherever it is saved, so the consumers' compressed copy would free nothing more (two levers
would count those bytes twice, and the codec's time, which is then never spent).
:mod:`lightning_comp.search.stages.memory_stage` ranks and takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.decisions.cheapest_bytes import Lever, LeverOption
from lightning_comp.search.decisions.codec_costs import CodecCost, CodecSample, fit_codec_cost
from lightning_comp.search.decisions.groups import group_operators
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.update_costs import UpdateCost, UpdateSample, fit_update_cost
from lightning_comp.search.measurement.optimizer_timing import UpdateVariant
from lightning_comp.search.stages.context import StageContext

__all__ = ["LeverBuilder", "LeverChange"]


@dataclass(frozen=True)
class LeverChange:
    """What taking one option of a lever writes: per operator, the value of each dimension it sets."""

    values: dict[str, dict[Dimension, str]]


class LeverBuilder:
    """Builds the memory levers of a batch stage's run (see the module docstring).

    Args:
        ctx: the batch stage's run (its modules and the search's settings).
    """

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.update_costs: dict[UpdateVariant, UpdateCost] = {}  # what each update variant adds, fitted in build()
        self.codec_costs: dict[SavedPrecision, CodecCost] = {}  # what each saved codec adds, fitted in build()

    def build(self, base: PrecisionPlan, decisions: dict[str, OperatorDecision],
              ) -> tuple[list[Lever], dict[str, dict[str, LeverChange]]]:
        """Every lever measured: its options, and per option what it writes into the plan."""
        keep = 1 - self.config.measurement.speed_margin
        self.update_costs = _fitted_update_costs(decisions)
        self.codec_costs = _fitted_codec_costs(decisions, lambda timed: self._timed_ms(timed, decisions, base))
        levers: list[Lever] = []
        changes: dict[str, dict[str, LeverChange]] = {}
        firsts: dict[str, str] = {}  # lever label -> the first operator it changes
        consumers: dict[str, set[str]] = {}  # recompute unit lever -> the operators consuming (and saving) its output
        seen: set[tuple[str, ...]] = set()
        for name, decision in decisions.items():
            entry = decision.saved
            if entry is not None and entry.time_ratios:
                members = entry.group or (name,)
                if members not in seen:
                    seen.add(members)
                    # the ratio is of every operator it timed: a recompute unit's consumers run its recomputation
                    timed = entry.timed or members
                    base_ms = self._timed_ms(timed, decisions, base)
                    own = float(entry.bytes.get("fp32", 0))
                    options, writes = [], {}
                    for value, (median, _, _) in entry.time_ratios.items():
                        nbytes = float(entry.bytes.get(value, own))
                        if own <= 0 or nbytes > own * keep:
                            continue  # saves too little
                        if entry.held_by and SavedPrecision(value).compresses and not entry.forced:
                            continue  # another operator keeps the tensor (or recomputes it): frees nothing
                        # by what it adds timed directly (a codec's casts, a recompute unit's re-runs), else a
                        # codec by its model (fitted over the operators whose codec was not timed so), else by
                        # its time ratio
                        model = self.codec_costs.get(SavedPrecision(value))
                        direct = entry.direct_ms.get(value)
                        extra_ms = (direct if direct is not None else model.extra_ms(len(timed), int(own))
                                    if model is not None else base_ms * max(median - 1.0, 0.0))
                        options.append(LeverOption(value, own - nbytes, max(extra_ms, 0.0)))
                        writes[value] = LeverChange({m: {Dimension.SAVED: value} for m in members})
                    if options:
                        label = f"saved:{_shown(members)}"
                        levers.append(Lever(label, tuple(options), forced=entry.forced))
                        changes[label] = writes
                        if entry.unit is None:  # a recompute unit is pooled across blocks already
                            firsts[label] = members[0]
                        else:
                            consumers[label] = set(timed) - set(members)
            params = decision.parameters
            if params is not None and params.update_ms:
                lever, writes = self._parameter_lever(name, params, base)
                if lever is not None:
                    levers.append(lever)
                    changes[lever.label] = writes
                    firsts[lever.label] = name
        return self._with_consumers(*self._pooled(levers, changes, firsts), consumers)

    def _timed_ms(self, timed: tuple[str, ...], decisions: dict[str, OperatorDecision], base: PrecisionPlan) -> float:
        """The forward and backward (ms) of the operators ``timed`` at the precisions they compute in under ``base``:
        what a saved precision's time ratio is of."""
        return sum(_compute_ms(m, decisions[m], base, self.ctx) for m in timed if m in decisions)

    def _pooled(self, levers: list[Lever], changes: dict[str, dict[str, LeverChange]], firsts: dict[str, str],
                ) -> tuple[list[Lever], dict[str, dict[str, LeverChange]]]:
        """The levers of operators playing the same part in repeated blocks
        (:mod:`lightning_comp.search.decisions.groups`) as one: their bytes and times summed, one decision for
        every block, as their compute precision is decided. Levers of one group that were measured with other
        options (or one forced) stay apart, and so do recompute units (``firsts`` leaves them out): the saved stage
        pooled them by all their members' parts, which their first member alone does not tell."""
        pooled: list[Lever] = []
        merged: set[str] = set()
        for dimension in ("saved:", "state:"):
            by_first = {firsts[lever.label]: lever for lever in levers
                        if lever.label.startswith(dimension) and lever.label in firsts}
            for group in group_operators(list(by_first), self.ctx.modules):
                members = [by_first[n] for n in group.members]
                values = {tuple(sorted(o.value for o in lever.options)) for lever in members}
                if group.size < 2 or len(values) != 1 or any(lever.forced for lever in members):
                    continue
                options = tuple(
                    LeverOption(value, sum(_option(lever, value).bytes_saved for lever in members),
                                sum(_option(lever, value).extra_ms for lever in members))
                    for value in next(iter(values)))
                label = f"{dimension}{group.label}"
                pooled.append(Lever(label, options))
                changes[label] = {value: LeverChange({n: v for lever in members
                                                      for n, v in changes[lever.label][value].values.items()})
                                  for value in next(iter(values))}
                merged.update(lever.label for lever in members)
        for label in merged:
            del changes[label]
        return [lever for lever in levers if lever.label not in merged] + pooled, changes

    @staticmethod
    def _with_consumers(levers: list[Lever], changes: dict[str, dict[str, LeverChange]],
                        consumers: dict[str, set[str]]) -> tuple[list[Lever], dict[str, dict[str, LeverChange]]]:
        """Each recompute unit's lever merged with the one codec lever whose operators all consume its output: one
        lever, its options the codec's (the consumers' compressed copy) and the recomputation (a recipe in its place),
        exclusive. Where several codec levers, or one reaching beyond the consumers, would merge, or an option's name
        is taken, or either is forced, they stay apart."""
        by_label = {lever.label: lever for lever in levers}
        operators = {label: {n for change in writes.values() for n in change.values}
                     for label, writes in changes.items()}
        codecs = [lever.label for lever in levers if lever.label.startswith("saved:") and lever.label not in consumers]
        merged: dict[str, Lever] = {}  # the unit's label -> the merged lever
        gone: set[str] = set()
        for label, fed in consumers.items():
            unit = by_label.get(label)
            hits = [c for c in codecs if c not in gone and operators[c] & fed]
            if unit is None or unit.forced or len(hits) != 1 or not operators[hits[0]] <= fed:
                continue
            codec = by_label[hits[0]]
            if codec.forced or {o.value for o in codec.options} & {o.value for o in unit.options}:
                continue
            both = f"{label} / {codec.label.removeprefix('saved:')}"
            merged[label] = Lever(both, codec.options + unit.options)
            changes[both] = {**changes.pop(codec.label), **changes.pop(label)}
            gone.add(codec.label)
        return [merged.get(lever.label, lever) for lever in levers if lever.label not in gone], changes

    def _parameter_lever(self, name: str, params: Any, base: PrecisionPlan
                         ) -> tuple[Lever | None, dict[str, LeverChange]]:
        """One operator's optimizer-state formats and bf16 master as one lever (the master where it computes in bf16,
        or in FP32 with FP32 copies of its bf16 parameters, priced with their casts)."""
        keep = 1 - self.config.measurement.speed_margin
        fp32_ms = params.update_ms.get(UpdateVariant.FP32, 0.0)
        own = float(params.bytes.get(UpdateVariant.FP32, 0))
        options, writes = [], {}

        def extra(variant: UpdateVariant) -> float:
            model = self.update_costs.get(variant)
            if model is not None and params.tensors > 0:  # one price for one shape: the model over every operator
                return max(model.extra_ms(params.tensors, params.params), 0.0)
            return fp32_ms * max(params.time_ratios[variant][0] - 1.0, 0.0)

        for variant in params.time_ratios:
            if variant in (UpdateVariant.FP32, UpdateVariant.MASTER, UpdateVariant.MASTER_FP32_COPIES):
                continue
            nbytes = float(params.bytes[variant])
            if own > 0 and nbytes <= own * keep:
                options.append(LeverOption(variant.value, own - nbytes, extra(variant)))
                writes[variant.value] = LeverChange({name: {Dimension.STATE: variant.value}})
        module = self.ctx.modules.get(name)
        computes = base.of(Dimension.COMPUTE, name, None if module is None else type(module))
        master = {ComputePrecision.BF16: UpdateVariant.MASTER,
                  ComputePrecision.FP32: UpdateVariant.MASTER_FP32_COPIES}.get(computes)
        if master is not None and master in params.time_ratios:
            tried = self.config.tried(Dimension.STATE)
            timed = tried[-1] if tried else StatePrecision.FP32  # the state the master update was timed with
            master_saved = float(params.bytes[master])  # half of the weights and gradients
            master_ms = extra(master) - (extra(UpdateVariant.of(timed)) if timed.managed else 0.0)
            for state in tried or (StatePrecision.FP32,):
                # each state format with a bf16 master: the master's own cost added to that format's
                state_saved = own - float(params.bytes.get(UpdateVariant.of(state), own))
                state_ms = extra(UpdateVariant.of(state)) if state.managed else 0.0
                value = f"{state.value}+master bf16"
                options.append(LeverOption(value, state_saved + master_saved, max(state_ms + master_ms, 0.0)))
                write = {Dimension.MASTER: MasterPrecision.BF16.value}
                if state.managed:
                    write[Dimension.STATE] = state.value
                writes[value] = LeverChange({name: write})
        if not options:
            return None, {}
        return Lever(f"state:{name}", tuple(options), forced=bool(params.forced)), writes


def _fitted_update_costs(decisions: dict[str, OperatorDecision]) -> dict[UpdateVariant, UpdateCost]:
    """Per update variant, what it adds to an update, fitted over every operator whose update was timed (a variant
    measured on too few operators is left out: each of those is priced by its own rounds)."""
    samples: dict[UpdateVariant, list[UpdateSample]] = {}
    for decision in decisions.values():
        params = decision.parameters
        if params is None or params.tensors <= 0 or UpdateVariant.FP32 not in params.update_ms:
            continue
        fp32_ms = params.update_ms[UpdateVariant.FP32]
        for variant, (ratio, *_) in params.time_ratios.items():
            samples.setdefault(variant, []).append(UpdateSample(params.tensors, params.params, fp32_ms * (ratio - 1)))
    fitted = {variant: fit_update_cost(measured) for variant, measured in samples.items()}
    return {variant: model for variant, model in fitted.items() if model is not None}


def _fitted_codec_costs(decisions: dict[str, OperatorDecision],
                        timed_ms: Callable[[tuple[str, ...]], float]) -> dict[SavedPrecision, CodecCost]:
    """Per saved codec (bf16, fp8), what it adds to a step (:mod:`~lightning_comp.search.decisions.codec_costs`),
    fitted over every operator or sharing group whose codec frees bytes and was judged by its time ratio alone, not
    timed directly (a codec measured so on too few is left out: each is priced by its own rounds).

    A group whose casts were timed directly is priced by its own time: on the default example those read within
    12 % of each other over three searches per group (an attention's fp8 8.65-10.18 ms), while one model over
    every group, a cost per operator and per byte, priced the four attentions' fp8 at 23.7-34.4 ms against the
    36.0-40.8 ms their casts took: the groups differ by more than bytes (2 MiB at 0.8 ms per MiB, 8 MiB at 0.56,
    10 MiB at 0.95)."""
    samples: dict[SavedPrecision, list[CodecSample]] = {}
    seen: set[tuple[str, ...]] = set()
    for name, decision in decisions.items():
        entry = decision.saved
        if entry is None or not entry.time_ratios or (entry.group or (name,)) in seen:
            continue
        members = entry.group or (name,)
        seen.add(members)
        own = entry.bytes.get(SavedPrecision.FP32.value, 0)
        timed = entry.timed or members
        for value, (median, *_) in entry.time_ratios.items():
            codec = SavedPrecision(value)
            if codec.compresses and 0 < entry.bytes.get(value, own) < own:  # its time is the codec's, held or not
                if value in entry.direct_ms:
                    continue  # priced by its own casts' time
                samples.setdefault(codec, []).append(CodecSample(len(timed), own, timed_ms(timed) * (median - 1)))
    fitted = {codec: fit_codec_cost(measured) for codec, measured in samples.items()}
    return {codec: model for codec, model in fitted.items() if model is not None}


def _option(lever: Lever, value: str) -> LeverOption:
    return next(option for option in lever.options if option.value == value)


def _compute_ms(name: str, decision: OperatorDecision, base: PrecisionPlan, ctx: StageContext) -> float:
    """The operator's forward and backward (ms) at the precision it computes in under ``base``."""
    module = ctx.modules.get(name)
    low = base.of(Dimension.COMPUTE, name, None if module is None else type(module)).is_low
    measured = decision.low if low and decision.low is not None else decision.fp32
    return measured.total_ms if measured is not None else 0.0


def _shown(members: tuple[str, ...]) -> str:
    return members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} judged with it)"
