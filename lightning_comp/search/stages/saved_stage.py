"""The batch stage's second dimension: in which precision each operator stores what it saves for backward.

Runs for ``objective="memory"`` and ``objective="balanced"`` once the compute candidates are known. On top of the
candidate plan, the training step is profiled with every eligible operator saving as computed, ``bf16`` and
``fp8`` (interleaved rounds, as for compute precision), and with every cheap operator recomputing: per operator, the
bytes it saves and its time, pack and unpack included. The decisions follow from them
(:mod:`lightning_comp.search.decisions.saved`). Recomputation is decided first, unit by unit
(:mod:`lightning_comp.search.decisions.recompute_units`: a run of cheap operators between compute operators, pooled
with the runs playing the same part in repeated blocks, judged on its own and its consumers' bytes and time, both
read from the same two profiles; a unit whose rounds straddle the bound gets more rounds of every configuration,
within ``extra_profile_time``), so the cheap part of a model's recomputation is kept when the whole would be too
slow; a unit that frees enough bytes is offered to the memory levers whatever its own time ratio; the operators not
recomputed are judged for ``bf16``/``fp8``. What is taken is decided with every other memory lever, cheapest bytes
first (:mod:`lightning_comp.search.stages.memory_stage`). In the profiled steps, what each lever adds is also timed
directly (:mod:`lightning_comp.search.measurement.direct_timing`: a unit's re-runs in backward, a codec's casts): the
levers' prices, where the time ratios judge. A price is the share of the candidate plan's step the work took in the
same round (the plan profiled beside it), times that plan's step as the whole-step rounds measured it
(``step_ms``): the room the levers fill is a share of that step, so the prices and the room are on one basis
whatever the machine's load did between the two measurements.

Saved lowerings join the compute candidates in the epoch stage's group testing as candidates of the ``saved``
dimension (:class:`~lightning_comp.search.candidates.Candidate`), in execution order beside their operator, so a
layer whose gradients suffer is isolated like any other candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_comp.execution.recompute import recompute_unsuitable
from lightning_comp.execution.saved_hooks import HookTimer
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.batch_result import SavedStageResult
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.recompute_units import (
    PooledUnit,
    judge_units,
    measure_units,
    pool_units,
    recompute_units,
    undecided_units,
)
from lightning_comp.search.decisions.saved import (
    SavedDecision,
    judge_saved,
    sharing_groups,
    unshared_choices,
)
from lightning_comp.search.measurement.direct_timing import DirectTimes
from lightning_comp.search.measurement.estimates import ExtraRounds, RatioEstimate, paired_ratio
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult
from lightning_comp.search.ranks import reduce_profile
from lightning_comp.search.stages.context import StageContext

__all__ = ["SavedStage"]



class SavedStage:
    """Measures and decides the saved precision of each operator (see the module docstring).

    Args:
        ctx: the batch stage's run.
    """

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.policy = ctx.policy
        self._direct: dict[SavedPrecision, DirectTimes] = {}  # each configuration's codec or re-runs, once profiled
        self._reference: list[float] = []  # the candidate plan's step in each measured round, what they are shares of
        self._step_ms: float | None = None

    def eligible(self, order: list[str]) -> list[str]:
        """Operators whose saved precision may be lowered: all that ran, but shape-only and excluded ones."""
        excluded, modules = self.ctx.config.excluded, self.ctx.modules
        return [n for n in order if classify(modules[n]) is not OperatorKind.SHAPE
                and not excluded.matches(n, modules[n])]

    def measure(self, base: PrecisionPlan, order: list[str], decisions: dict[str, OperatorDecision],
                step_ms: float | None = None) -> SavedStageResult:
        """Measure on top of the candidate plan ``base`` and decide per operator (into each
        ``decisions[name].saved``); what is taken is decided with the other memory levers
        (:mod:`lightning_comp.search.stages.memory_stage`).

        Args:
            base: the candidate plan (compute precisions only).
            order: the operators in execution order.
            decisions: the operators' decisions so far.
            step_ms: ``base``'s forward and backward as the whole-step rounds measured it (on the scale the levers'
                bound is in): the directly timed prices are their share of ``base``'s step in their own rounds times
                this (``None``: the times as measured).
        """
        modules = self.ctx.modules
        self._step_ms = step_ms
        eligible = self.eligible(order)
        # bf16 shrinks only what an operator computing in fp32 saves: not worth profiling when every one is lowered
        options = tuple(s for s in self.policy.saved_options if s is not SavedPrecision.BF16
                        or any(not base.of(Dimension.COMPUTE, n, type(modules[n])).is_low for n in eligible))
        recomputable = [n for n in eligible if self.policy.recomputes and recompute_unsuitable(modules[n]) is None]
        if not options and not recomputable:  # e.g. saved "bf16" with every operator computing in 16 bits
            return SavedStageResult()
        results = self._profile(base, eligible, options, recomputable)
        result = SavedStageResult()
        if recomputable:
            self._decide_recompute(results, recomputable, decisions, result)
        codec = [n for n in eligible if n not in result.choices]
        self._decide(results, codec, options, decisions, result)
        result.choices, result.benefits = self.ctx.agree((result.choices, result.benefits))
        return result

    def _profile(self, base: PrecisionPlan, eligible: list[str], options: tuple[SavedPrecision, ...],
                 recomputable: list[str]) -> dict[SavedPrecision, ProfileResult]:
        """The candidate plan profiled with every eligible operator saving as computed (``FP32``) and at each option,
        and with every recomputable one recomputing (``RECOMPUTE``)."""
        ctx = self.ctx
        config = ctx.config
        plans = {SavedPrecision.FP32: base}
        plans.update({s: base.with_assignment(Dimension.SAVED, dict.fromkeys(eligible, s.value)) for s in options})
        if recomputable:
            plans[SavedPrecision.RECOMPUTE] = base.with_assignment(
                Dimension.SAVED, dict.fromkeys(recomputable, SavedPrecision.RECOMPUTE.value))
        # Profiled as training steps run (calibrated cast boundaries, so a lowered operator's output stays low where
        # training keeps it low, and the tensors operators share are the ones training shares). A saved precision
        # does not move a cast boundary: one calibrating step of the base plan serves every configuration.
        with ctx.plugin.measured_step(base):
            ctx.step()
        configs: dict[SavedPrecision, Callable[[], Any]] = {label: ctx.measured(plan) for label, plan in plans.items()}
        measurement = config.measurement
        # what the codecs' casts and the re-runs add, timed directly: the levers' prices
        executor = ctx.plugin.executor
        for label in configs:
            if label is not SavedPrecision.FP32:
                self._direct[label] = DirectTimes(ctx.clock)
                configs[label] = self._direct[label].around(
                    _installer(executor.recomputer, "unpack_timer") if label.recomputes
                    else _installer(executor.saved_tensors, "codec_timer"), configs[label])
        profiler = OperatorProfiler(ctx.pl_module, ctx.clock, measurement.profile_steps, measurement.profile_warmup)
        # the bar counts rounds (each measures every configuration)
        profiler.on_round = ctx.show_rounds(ctx.first_rounds, "saved precision, per operator")
        started = time.perf_counter()
        results = profiler.profile(configs, ctx.step)
        if recomputable:  # a recompute unit whose rounds straddle the bound gets more of them, every config's
            budget = ExtraRounds(config, time.perf_counter() - started, ctx.first_rounds)
            while True:
                close = undecided_units(self.policy, self._units(results, recomputable))
                more = ctx.agree(budget.next_rounds() if close else 0)
                if not more:
                    break
                if ctx.progress is not None:
                    ctx.progress.extend_stage(more)
                with budget.spending():
                    profiler.extend(results, configs, ctx.step, more)
        reduce_profile(ctx.trainer, results)
        self._reference = list(results[SavedPrecision.FP32].step_rounds)
        return results

    def _price_ms(self, times: DirectTimes, names: tuple[str, ...] | list[str]) -> float | None:
        """What the timed work of ``names`` adds to a step: its share of the candidate plan's step in the same rounds
        on the whole-step scale (``step_ms``), or its median time where no scale was given (``None``: not timed)."""
        skip = self.ctx.config.measurement.profile_warmup
        if self._step_ms is None:
            return times.median_ms(names, skip)
        share = times.median_share(names, self._reference, skip)
        return None if share is None else share * self._step_ms

    def _units(self, results: dict[SavedPrecision, ProfileResult], recomputable: list[str]) -> list[PooledUnit]:
        """The recompute units (:mod:`lightning_comp.search.decisions.recompute_units`) of the operators in
        ``recomputable`` that ran in both profiles, measured and pooled."""
        base, recomputed = results[SavedPrecision.FP32], results[SavedPrecision.RECOMPUTE]
        ran = {n for n in recomputable if n in base.operators and n in recomputed.operators}
        units = recompute_units(base.order, ran, base.sharing)
        measured, _ = measure_units(units, base, recomputed)
        return pool_units(measured, self.ctx.modules)

    def _decide_recompute(self, results: dict[SavedPrecision, ProfileResult], recomputable: list[str],
                          decisions: dict[str, OperatorDecision], result: SavedStageResult) -> None:
        """The cheap operators' recomputation, judged unit by unit
        (:mod:`lightning_comp.search.decisions.recompute_units`): a run of them between compute operators, pooled
        with the runs playing the same part in repeated blocks, on what recomputing it frees (its own and its
        consumers' saved bytes: the next Linear no longer holds the GELU's output) and what it costs (their forward
        and backward: the backward of every operator that unpacks it runs the recomputation), from the profile
        saving as computed and the one recomputing every unit.

        A unit that frees the margin's share of its bytes is offered to the memory levers even where its own
        operators' time ratio is past the step's bound (a ratio of a small part of the step is not the step's: the
        levers weigh its milliseconds against the step's allowance); its members then have no codec decision."""
        keep = self.policy.keep
        units = self._units(results, recomputable)
        unit_ms: dict[str, float | None] = {}
        times = self._direct.get(SavedPrecision.RECOMPUTE)
        if times is not None:
            direct = self.ctx.agree({unit.label: self._price_ms(times, unit.members) for unit in units})
            unit_ms = {name: direct[unit.label] for unit in units for name in unit.members}
        scale = "" if self._step_ms is None else (f" on the whole steps' scale (its share of the candidate plan's"
                                                   f" step in the same rounds, of {self._step_ms:.1f} ms)")
        for name, decision in judge_units(self.policy, units).items():
            timed = unit_ms.get(name)
            if timed is not None:
                decision.direct_ms = {SavedPrecision.RECOMPUTE.value: timed}
                decision.reason = (f"{decision.reason}; its re-runs timed directly: +{timed:.3f} ms a step{scale} (the"
                                   " recompute lever's price)")
            before, after = decision.bytes.get("fp32", 0), decision.bytes.get(SavedPrecision.RECOMPUTE.value)
            if not decision.lowers and after is not None and before > 0 and after <= before * keep:
                share = (before - after) / max(len(decision.group or (name,)), 1)
                decision.decision, decision.gain_bytes, decision.benefit = SavedPrecision.RECOMPUTE, int(share), share
                decision.reason = f"offered to the memory levers (they weigh its time against the step's):" \
                                  f" {decision.reason}"
            decisions[name].saved = decision
            if decision.lowers:
                result.choices[name] = decision.decision
                result.benefits[Candidate.saved(name)] = decision.benefit

    def _codec_ms(self, groups: list[tuple[str, ...]], options: tuple[SavedPrecision, ...],
                  ) -> list[dict[str, float]]:
        """Per group of operators saving the same tensors, what each codec's casts took per step, timed directly
        (:mod:`~lightning_comp.search.measurement.direct_timing`; empty where the codec was not profiled so)."""
        if not any(s in self._direct for s in options):
            return [{} for _ in groups]
        measured = []
        for group in groups:
            timed = {s.value: self._price_ms(self._direct[s], group) for s in options if s in self._direct}
            measured.append({value: ms for value, ms in timed.items() if ms is not None})
        return list(self.ctx.agree(measured))

    def _decide(self, results: dict[SavedPrecision, ProfileResult], eligible: list[str],
                options: tuple[SavedPrecision, ...], decisions: dict[str, OperatorDecision],
                result: SavedStageResult) -> SavedStageResult:
        """Each group of operators that save the same tensors judged together; forced and unshared ones settled."""
        included, modules = self.ctx.config.included(Dimension.SAVED), self.ctx.modules
        base = results[SavedPrecision.FP32]
        ran = [n for n in eligible if n in base.operators]
        groups = sharing_groups(ran, base.sharing) if options else []
        direct = self._codec_ms(groups, options)
        for group, codec_ms in zip(groups, direct):
            measured: dict[SavedPrecision, tuple[int, RatioEstimate]] = {
                s: (sum(results[s].operators[n].own_saved_bytes for n in group),
                    paired_ratio(base.summed_series(group), results[s].summed_series(group)))
                for s in options if all(n in results[s].operators for n in group)}
            shared = judge_saved(self.policy, sum(base.operators[n].own_saved_bytes for n in group), measured)
            held_by = tuple(sorted({s for n in group for s in base.sharing.get(n, ())} - set(group)))
            for name in group:
                decision = _share_of(shared, group)
                decision.held_by = held_by
                decision.direct_ms = dict(codec_ms)
                if included.matches(name, modules[name]):
                    decision.forced = True
                    if not decision.lowers:
                        smallest = options[0]  # fp8 with precisions={"saved": "auto"}
                        decision.decision = smallest
                        decision.reason = (f"included by CoMPSearch(include_dimensions={{'saved': ...}}) at"
                                           f" {smallest.value}")
                tried = decisions[name].saved
                if tried is not None and tried.unit is not None:  # its recompute unit was judged first, not taken
                    decision.reason = f"{decision.reason}; recompute judged first: {tried.reason}"
                decisions[name].saved = decision
                if decision.lowers:
                    result.choices[name] = decision.decision
                    result.benefits[Candidate.saved(name)] = decision.benefit
        forced = {n for n, d in decisions.items() if d.saved is not None and d.saved.forced}
        # a recomputed output is a recipe wherever it is saved, by whoever: sharing it never doubles it
        forced |= {n for n, saved in result.choices.items() if saved.recomputes}
        for name, why in unshared_choices(result.choices, base.sharing, forced).items():
            saved = decisions[name].saved
            assert saved is not None
            saved.keep_as_computed(why)
            result.drop(name)
        for name in ran:  # measured but not chosen: why its codec is not offered to the levers either
            saved = decisions[name].saved
            if saved is not None and saved.held_by and not saved.lowers and not saved.forced:
                saved.reason = (f"{saved.reason}; not offered to the memory levers: a tensor it saves is also saved"
                                f" by {', '.join(saved.held_by)}, which keep(s) it as computed or may recompute it,"
                                " so compressing it frees nothing")
        return result



def _installer(hooks: Any, attribute: str) -> Callable[[HookTimer | None], None]:
    """What hands a timer to ``hooks`` (the recompute hooks, or the codecs') for the steps a measurement times."""
    return lambda timer: setattr(hooks, attribute, timer)


def _share_of(shared: SavedDecision, group: tuple[str, ...]) -> SavedDecision:
    """One member's copy of its group's decision: an equal share of what the group gains."""
    share = replace(shared, bytes=dict(shared.bytes), time_ratios=dict(shared.time_ratios),
                    gain_bytes=shared.gain_bytes // len(group), benefit=shared.benefit / len(group))
    if len(group) > 1:
        share.group = group
        share.reason = f"{shared.reason} (judged with {', '.join(group)}: they save the same tensors)"
    return share
