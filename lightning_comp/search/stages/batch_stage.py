"""The batch stage: which operators are worth a convergence trial, measured on one batch of the user's training.

At the first batch of the search, the training step is run repeatedly on that batch, in FP32 and with every
operator lowered, to measure each operator's forward and backward time and the bytes it saves for backward
(:mod:`lightning_comp.search.measurement`). The lowered steps run at the cast boundaries training with that plan has
(a lowered output stays low into a lowered consumer), so no operator is charged a cast training would not pay; where
the candidate plan keeps a neighbour in FP32, its candidates are measured again at that plan's own boundaries.
Operators playing the same part in repeated blocks are decided as one group
(:mod:`lightning_comp.search.decisions.groups`); each group's decision follows from its pooled measurements
(:mod:`lightning_comp.search.decisions.operators`): groups whose low-precision cost does not beat FP32 by the margin
stay FP32, cheap operators between two lowered operators are lowered with them. The candidate plan is then timed as
a whole step beside FP32, AMP's plan (what one global autocast region lowers in this step), the all-low and
compute-only plans, and one global autocast region as a reference; the objective's policy
(:mod:`lightning_comp.search.decisions.objectives`) decides which of them the epoch stage trials (throughput: the
fastest by the median, then refined one group at a time by whole steps,
:mod:`lightning_comp.search.stages.refine_stage`); if nothing beats FP32, the search ends. The trialled plan is
written whole (one glob per group it lowers whole). With the memory and balanced objectives, the saved stage
(:mod:`lightning_comp.search.stages.saved_stage`) adds the saved-precision candidates, and the parameter stage
(:mod:`lightning_comp.search.stages.parameter_stage`) the optimizer-state and master-weight ones; where the plan
those levers build on is an alternative to the candidates, they are measured and spent on the candidates too and the
better end is kept (:func:`~lightning_comp.search.decisions.levers_base.better_end`; also where the
candidates are the base and an alternative's cost is within the margin of theirs). Where fp8 is
searched, the fp8 stage (:mod:`lightning_comp.search.stages.fp8_stage`) adds fp8 candidates for the lowered Linears
that are faster in fp8 than in bf16.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.devices.device_classes import model_device
from lightning_comp.devices.lowering import Lowering, autocast_available, lowering_for
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import COMPUTE_CLASS_KINDS, classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig, Timing
from lightning_comp.search.decisions.batch_result import (
    BatchStageResult,
    Fp8StageResult,
    StepMemory,
)
from lightning_comp.search.decisions.cheapest_bytes import OtherBase
from lightning_comp.search.decisions.groups import OperatorGroup, group_operators
from lightning_comp.search.decisions.levers_base import better_end, measured_beside
from lightning_comp.search.decisions.operators import (
    Choice,
    OperatorDecision,
    decide_operators,
    recheck_at_plan_boundaries,
)
from lightning_comp.search.decisions.refinement import GroupFlip
from lightning_comp.search.decisions.trial_plans import (
    PlanRole,
    cheap_runs,
    compute_candidates,
    plan_for,
)
from lightning_comp.search.decisions.trialled import (
    accept_refinement,
    in_execution_order,
    lowered_by,
    members_of,
    settle_decisions,
    trialled_plan,
)
from lightning_comp.search.decisions.whole_step import (
    ALTERNATIVES,
    ComparedPlan,
    PlanStep,
    ProfiledPlan,
    StepComparison,
)
from lightning_comp.search.measurement.autocast_lowering import lowered_under_autocast
from lightning_comp.search.measurement.clock_choice import TimingChoice, choose_timing, cpu_clock, is_busy, sample_load
from lightning_comp.search.measurement.clocks import ClockKind, single_intra_op_thread
from lightning_comp.search.measurement.estimates import ExtraRounds, Verdict
from lightning_comp.search.measurement.machine_load import LoadMeter
from lightning_comp.search.measurement.process_memory import StepPeak
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult
from lightning_comp.search.measurement.step_timing import StepTimer, StepTimes, TrainingStepRunner
from lightning_comp.search.ranks import agree, reduce_profile
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.rewind.snapshot import capture_rng, restore_rng
from lightning_comp.search.stages.context import StageContext, Step
from lightning_comp.search.stages.fp8_stage import Fp8Stage
from lightning_comp.search.stages.memory_stage import memory_levers
from lightning_comp.search.stages.refine_stage import Refiner

__all__ = ["BatchStage"]

FP32, CANDIDATES = ComparedPlan.FP32, ComparedPlan.CANDIDATES
CLEARLY_SLOWER = 2.0  # a whole step this many times the fastest one's in its first round is not timed again


@dataclass(frozen=True)
class _Measured:
    """What the stage measured before it settles on a trialled plan (see :meth:`BatchStage._settle`)."""

    modules: dict[str, nn.Module]
    lowerable: list[str]
    order: list[str]
    groups: list[OperatorGroup]
    alternatives: dict[ComparedPlan, PrecisionPlan]
    amp: set[str]
    comparison: StepComparison
    steps: dict[ComparedPlan, PlanStep]
    step_saved: dict[ComparedPlan, float]
    results: dict[ProfiledPlan, ProfileResult]
    budget: ExtraRounds
    timing: TimingChoice


class BatchStage:
    """Measures the operators of a model on one batch and decides the candidates of the epoch stage.

    Args:
        config: the search's settings.
        low: the 16-bit precision searched.
        plugin: the plugin that puts each measured plan into effect.
        progress: where measured rounds are shown (nothing is shown without it).
        fp8: the fp8 precision searched on top of ``low`` (``None``: none).
    """

    def __init__(self, config: SearchConfig, low: ComputePrecision, plugin: CoMPPrecision,
                 progress: SearchProgress | None = None, fp8: ComputePrecision | None = None) -> None:
        self.config = config
        self.low = low
        self.plugin = plugin
        self.progress = progress
        self.fp8 = fp8

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
            restore: Callable[[], None]) -> BatchStageResult:
        """Measure and decide; ``restore`` puts the run's state back afterwards (the stage trains nothing).

        Returns:
            Rank 0's result, on every rank.
        """
        plugin, config = self.plugin, self.config
        device = model_device(pl_module)
        rng = capture_rng()
        wrapper = lightning.fsdp1_wrapper(trainer, pl_module)
        step = TrainingStepRunner(pl_module, batch, batch_idx, None if wrapper is None else (trainer, wrapper))
        try:
            with plugin.measured_step(PrecisionPlan()):  # a model's first step traces the operators it computes in
                step()
            timing = agree(trainer, choose_timing(config.measurement.timing, device.type,
                                                  lambda: sample_load(step, lambda more: agree(trainer, more))))
            meter = LoadMeter()
            meter.start()
            result = self.measure(trainer, pl_module, step, timing)
            load = meter.stop()
            auto = config.measurement.timing is Timing.AUTO
            if auto and timing.clock is ClockKind.WALL and agree(trainer, is_busy(load)):
                timing = cpu_clock("this process's CPU time with one intra-op thread: the machine became busy during"
                                   f" the wall-time measurement ({load.describe()}), which was repeated", load)
                result = self.measure(trainer, pl_module, step, timing)
        finally:
            if self.progress is not None:
                self.progress.close_stage()
            # fp32 first: a measured plan may hold bf16 masters, which must be fp32 again before the snapshot's
            # values are copied into them
            plugin.try_plan(PlanRole.TRIAL.mark(PrecisionPlan(), trial="fp32 reference"))
            restore()
            restore_rng(rng)
        result.timing = timing.to_dict()
        return agree(trainer, result)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step,
                timing: TimingChoice) -> BatchStageResult:
        """Per-operator and whole-step measurements with ``timing``'s clock, and the decisions they give."""
        device = model_device(pl_module)
        modules = dict(iter_operators(pl_module))
        ctx = StageContext(trainer, pl_module, self.plugin, self.config, self.low, step, timing.make_clock(),
                           modules, self.progress)
        policy = ctx.policy
        lowerable = [n for n, m in modules.items() if lowering_for(m, self.low, device) not in (None, Lowering.NONE)]
        with self.plugin.measured_step(PrecisionPlan(), calibrated=False):  # the model in fp32, under AMP's region
            amp = ctx.agree(sorted(lowered_under_autocast(modules, step, device.type, self.low)))
        if self.progress is not None:  # per-operator rounds, then whole-step rounds
            self.progress.start_stage(len(lowerable), 2 * ctx.first_rounds)
        with single_intra_op_thread(timing.single_thread):
            results = self._profile_operators(ctx, lowerable)
            # every rank must time the same whole-step plans (each timing is a collective): rank 0's decisions
            decisions = ctx.agree(decide_operators(self.config, policy, self.low, modules, lowerable, results))
            order = results[ProfiledPlan.FP32].order
            groups = group_operators([n for n in order if decisions[n].group], modules)
            runs = cheap_runs(order, decisions, modules)
            names = [n for n in order if decisions[n].is_candidate]
            candidate_plan = plan_for(self.low, runs, [Candidate(n) for n in names]) if names else None
            all_low = self._all_low(lowerable)[Dimension.COMPUTE]
            if candidate_plan is not None and candidate_plan[Dimension.COMPUTE] != all_low:
                # its cast boundaries differ from the all-low plan's the operators were measured at
                plan_profile = self._profile_at_boundaries(ctx, candidate_plan)
                dropped = ctx.agree(recheck_at_plan_boundaries(policy, decisions, plan_profile))
                for name, why in dropped.items():
                    decisions[name].keep_fp32(why)
                if dropped:
                    runs = cheap_runs(order, decisions, modules)
                    names = [n for n in order if decisions[n].is_candidate]
                    candidate_plan = plan_for(self.low, runs, [Candidate(n) for n in names]) if names else None
            alternatives = self._alternatives(modules, lowerable, order, decisions, candidate_plan, set(amp))
            plans = {CANDIDATES: candidate_plan} if candidate_plan is not None else {}
            plans.update(alternatives)
            times, step_saved, peaks, budget = self._time_whole_steps(ctx, plans)
        comparison = StepComparison(times.ms)
        policy.set_pace(ctx.agree(comparison.pace()))  # what the memory objectives' slowdown is bounded against
        ratios = comparison.ratios()
        steps = {plan: PlanStep(ms=ctx.reduce_mean(min(ms)), wall_ms=ctx.reduce_mean(min(times.wall_ms[plan])),
                                ratio=ratios.get(plan), saved_bytes=step_saved.get(plan),
                                process_peak=peaks.get(plan))
                 for plan, ms in times.ms.items()}
        winner = ctx.agree(policy.winner(comparison, step_saved, list(alternatives), bool(names)))
        measured = _Measured(modules, lowerable, order, groups, alternatives, set(amp), comparison, steps, step_saved,
                             results, budget, timing)
        beside = ctx.agree(measured_beside(policy, comparison, step_saved, list(alternatives), bool(names), winner))
        if beside is None:
            return self._settle(ctx, measured, winner, names, runs, decisions)
        # the levers spent on an alternative (the base rule's choice, or its runner-up), then on the candidates: the
        # better end is kept
        alternative = self._settle(ctx, measured, beside, names, runs, copy.deepcopy(decisions))
        candidates = self._settle(ctx, measured, None, names, runs, decisions)
        return self._better_end(ctx, candidates, alternative, beside)

    def _settle(self, ctx: StageContext, measured: _Measured, winner: ComparedPlan | None, names: list[str],
                runs: list[Any], decisions: dict[str, OperatorDecision]) -> BatchStageResult:
        """The stage's result with ``winner`` (``None``: the candidates ``names``, or FP32) as the trialled compute
        plan: ``decisions`` settled on it, the fp8 and memory stages run on top of it."""
        policy, steps, order, groups = ctx.policy, measured.steps, measured.order, measured.groups
        comparison, modules = measured.comparison, measured.modules
        if winner is not None:
            names, runs = self._adopt(ctx, winner, measured.alternatives[winner], order, decisions, steps), []
        elif names:
            names = self._check_candidates(ctx, comparison, names, decisions)
        source = winner or (CANDIDATES if names else FP32)
        lowered = lowered_by(plan_for(self.low, runs, [Candidate(n) for n in names]), modules)
        flips: list[GroupFlip] = []
        if policy.refines and self.config.measurement.extra_profile_time > 0:
            with single_intra_op_thread(measured.timing.single_thread):
                refined, flips = Refiner(ctx, measured.budget, steps[FP32].wall_ms).refine(lowered, groups, decisions)
            lowered, flips = accept_refinement(lowered, refined, flips, comparison.median_to_fp32(source),
                                               self.config.measurement.speed_margin)
        trialled = trialled_plan(comparison, steps, source, flips)
        settle_decisions(decisions, order, lowered, flips, self.low)
        compute = compute_candidates([n for n in order if n in lowered]
                                     + sorted(n for n in lowered if n not in order), groups)
        base = plan_for(self.low, [], compute)  # the trialled plan is written out whole: its fills are candidates
        fp8 = Fp8StageResult()
        if self.fp8 is not None:
            with single_intra_op_thread(measured.timing.single_thread):
                fp8 = Fp8Stage(ctx, self.fp8).measure(base, compute, groups, decisions)
        with single_intra_op_thread(measured.timing.single_thread):
            amp_plan = self._fixed_plan(ComparedPlan.AMP, modules, measured.lowerable, order, decisions, measured.amp)
            saved, parameters, spending = memory_levers(ctx, base, order, decisions, steps, measured.step_saved,
                                                        source, amp_plan, comparison)
        candidates = in_execution_order(order, compute, groups, saved, parameters,
                                        [Candidate.in_fp8(name) for name in fp8.choices])
        benefits = {candidate: sum(decisions[m].benefit for m in members_of(candidate, groups))
                    for candidate in compute}
        benefits.update(fp8.benefits)
        benefits.update(saved.benefits)
        benefits.update(parameters.benefits)
        return BatchStageResult(
            decisions=decisions, candidates=tuple(candidates), benefits=benefits, runs=[], saved=saved,
            parameters=parameters, order=order, steps=steps,
            memory={label: StepMemory(r.saved_bytes, r.peak_bytes) for label, r in measured.results.items()
                    if label is ProfiledPlan.FP32 or self.low.is_low},
            groups=[g for g in groups if g.size > 1], flips=flips, trialled=trialled, memory_spending=spending,
            fp8=fp8,
        )

    def _better_end(self, ctx: StageContext, candidates: BatchStageResult, alternative: BatchStageResult,
                    label: ComparedPlan) -> BatchStageResult:
        """Of the levers' ends on the candidates and on the alternative ``label``, the better by
        :func:`~lightning_comp.search.decisions.levers_base.better_end` (a tie keeps the candidates);
        the one kept names the other's end."""
        candidates_end, alternative_end = candidates.memory_spending, alternative.memory_spending
        if candidates_end is None or alternative_end is None:
            return candidates if alternative_end is None else alternative
        why = ctx.agree(better_end(ctx.policy.objective, candidates_end, alternative_end))
        if why is not None:  # the alternative's end is the better
            kept, kept_end, other_end, other = alternative, alternative_end, candidates_end, CANDIDATES
        else:
            kept, kept_end, other_end, other = candidates, candidates_end, alternative_end, label
            tie = "no worse (a tie keeps the candidates)"
            why = ctx.agree(better_end(ctx.policy.objective, alternative_end, candidates_end)) or tie
        kept_end.other_base = OtherBase(
            base=other.describe(self.low), start_bytes=other_end.start_bytes, final_bytes=other_end.final_bytes,
            end_ms=other_end.end_ms, max_ms=other_end.max_ms, met=other_end.selection.met, why=why)
        return kept

    # ---------------------------------------------------------------------------------------------- measuring
    def _profile_operators(self, ctx: StageContext, lowerable: list[str]) -> dict[ProfiledPlan, ProfileResult]:
        """Every operator's time and saved bytes in FP32 and with everything lowerable lowered, with extra rounds
        while an operator cannot be decided (within the budget); averaged over ranks."""
        config, plugin, step = ctx.config, ctx.plugin, ctx.step
        measurement = config.measurement
        profiler = OperatorProfiler(ctx.pl_module, ctx.clock, measurement.profile_steps, measurement.profile_warmup)
        profiler.on_round = ctx.show_rounds(0, f"per operator, fp32/{self.low.value}")
        # Weight copies are saved as recipes, as in training (recast_weights_in_backward): not counted as saved bytes.
        # The all-low plan runs at its training cast boundaries (calibrated): an operator's output stays low where
        # its consumers compute low too, so no operator is charged an output cast that training with its
        # neighbours lowered does not pay. The candidate plan's own boundaries are checked afterwards
        # (_profile_at_boundaries).
        all_low = self._all_low(lowerable)
        configs: dict[ProfiledPlan, Callable[[], Any]] = {
            ProfiledPlan.FP32: ctx.measured(PrecisionPlan(), calibrated=False)}
        if self.low.is_low:  # (low_precision="off": every operator computes in FP32, its only profile)
            configs[ProfiledPlan.LOW] = ctx.measured(all_low)
        if measurement.profile_warmup == 0:  # the calibrating step traces, slower than a step: never a measured one
            with plugin.measured_step(all_low):
                step()
        started = time.perf_counter()
        results = profiler.profile(configs, step)

        def undecided() -> bool:
            decided = decide_operators(config, ctx.policy, self.low, ctx.modules, lowerable, results)
            return any(d.settled is False for d in decided.values())

        if not self.low.is_low:
            results[ProfiledPlan.LOW] = results[ProfiledPlan.FP32]  # nothing lowered: the same profile
        self._extend_while(ctx, ExtraRounds(config, time.perf_counter() - started, ctx.first_rounds),
                           undecided, lambda more: profiler.extend(results, configs, step, more))
        reduce_profile(ctx.trainer, {label: results[label] for label in configs})  # (an alias is reduced once)
        return results

    def _all_low(self, lowerable: list[str]) -> PrecisionPlan:
        """The plan lowering every operator that can compute in the searched precision on the device."""
        return PrecisionPlan.from_dict({n: self.low.value for n in lowerable})

    def _profile_at_boundaries(self, ctx: StageContext, plan: PrecisionPlan) -> dict[ProfiledPlan, ProfileResult]:
        """Every operator's time under ``plan`` at its training cast boundaries (beside FP32, interleaved): where
        an operator next to one ``plan`` keeps in FP32 pays the casts it would pay in training; averaged over
        ranks."""
        config = ctx.config
        # half the first profile's rounds: it only drops candidates that clearly stop paying (the whole step decides
        # the rest), and the calibrating round it needs is a warm-up one
        rounds, warmup = max(2, (config.measurement.profile_steps + 1) // 2), max(config.measurement.profile_warmup, 1)
        profiler = OperatorProfiler(ctx.pl_module, ctx.clock, rounds, warmup)
        profiler.on_round = ctx.show_rounds(rounds + warmup, "per operator, at the plan's casts")
        results = profiler.profile({
            ProfiledPlan.FP32: ctx.measured(PrecisionPlan(), calibrated=False),
            ProfiledPlan.AT_PLAN: ctx.measured(plan)}, ctx.step)
        reduce_profile(ctx.trainer, results)
        return results

    def _time_whole_steps(self, ctx: StageContext, plans: dict[ComparedPlan, PrecisionPlan],
                          ) -> tuple[StepTimes[ComparedPlan], dict[ComparedPlan, float], dict[ComparedPlan, StepPeak],
                                     ExtraRounds]:
        """Whole steps of FP32 and of ``plans``, interleaved, with extra rounds while a comparison the policy
        decides from is undecided; (objectives that weigh memory) the bytes each saves for backward and the peak the
        process needs for a step of each (rank 0's); and what is left of the whole-step budget (the refinement's)."""
        config, step = ctx.config, ctx.step
        configs: dict[ComparedPlan, Callable[[], Any]] = {
            label: ctx.measured(plan) for label, plan in {FP32: PrecisionPlan(), **plans}.items()}
        device_type = model_device(ctx.pl_module).type
        if autocast_available(device_type) and not self.plugin.compiled and self.low.is_low:
            configs[ComparedPlan.AUTOCAST] = self._autocast_region(device_type)
        timer = StepTimer(ctx.clock, config.measurement.profile_steps, config.measurement.profile_warmup)
        timer.on_round = ctx.show_rounds(0, f"whole steps, {len(configs)} plans")
        started = time.perf_counter()
        times = timer.time(configs, step, rounds=1)
        # a plan whose first round took twice the fastest's cannot win (an emulated 16-bit type: 30-100x): it is not
        # timed again, and every comparison with it is made over that round
        first = {label: ms[0] for label, ms in times.ms.items()}
        contenders = set(ctx.agree(sorted(label for label, ms in first.items()
                                          if label is FP32 or ms <= CLEARLY_SLOWER * min(first.values()))))
        if config.measurement.profile_steps > 1:
            timer.time({k: v for k, v in configs.items() if k in contenders}, step, into=times,
                       rounds=config.measurement.profile_steps - 1, warmup=0)
        # extra rounds time only the plans of undecided comparisons; the set only shrinks

        def undecided() -> bool:  # (every rank times rank 0's contenders: each timing is a collective)
            involved = ctx.agree(sorted(ctx.policy.undecided(StepComparison(times.ms), list(plans))))
            contenders.intersection_update(involved)
            return bool(contenders)

        budget = ExtraRounds(config, time.perf_counter() - started, ctx.first_rounds)
        self._extend_while(ctx, budget, undecided,
                           lambda more: timer.time({k: v for k, v in configs.items() if k in contenders},
                                                   step, into=times, rounds=more, warmup=0))
        saved: dict[ComparedPlan, float] = {}
        peaks: dict[ComparedPlan, StepPeak] = {}
        if ctx.policy.weighs_memory:
            saved = {k: ctx.reduce_mean(float(v)) for k, v in timer.saved_bytes(ctx.pl_module, configs, step).items()}
            peaks = ctx.agree(timer.step_peaks(configs, step, model_device(ctx.pl_module)))
        return times, saved, peaks, budget

    def _autocast_region(self, device_type: str) -> Callable[[], AbstractContextManager[None]]:
        """What puts the reference step in force: no plan (FP32, no hooks at work) inside one global autocast region
        of the searched precision, as Lightning's ``bf16-mixed``/``16-mixed`` train."""
        plugin, dtype = self.plugin, self.low.dtype

        @contextmanager
        def region() -> Iterator[None]:
            with plugin.measured_step(PrecisionPlan(), calibrated=False), torch.autocast(device_type, dtype=dtype):
                yield

        return region

    def _extend_while(self, ctx: StageContext, budget: ExtraRounds, undecided: Callable[[], bool],
                      add: Callable[[int], Any]) -> None:
        """Measure more rounds (``add(rounds)``) while something is ``undecided`` and the budget lasts; every rank
        measures as many rounds as rank 0 asks for."""
        while True:
            more = ctx.agree(budget.next_rounds() if undecided() else 0)
            if not more:
                return
            if self.progress is not None:
                self.progress.extend_stage(more)
            with budget.spending():
                add(more)

    # ---------------------------------------------------------------------------------------------- deciding
    def _alternatives(self, modules: dict[str, nn.Module], lowerable: list[str], order: list[str],
                      decisions: dict[str, OperatorDecision], candidate_plan: PrecisionPlan | None,
                      amp: set[str]) -> dict[ComparedPlan, PrecisionPlan]:
        """Whole-step alternatives to the per-operator candidate plan (``None``: no candidate), timed beside it.

        ``amp`` is the fixed policy a user would otherwise pick: the operators one global autocast region lowers
        (:mod:`lightning_comp.search.measurement.autocast_lowering`); FP32, the other fixed policy, is always timed.
        The others catch effects per-operator timings miss: casts vanish inside long low-precision runs
        (``ALL_LOW``), and cheap operators lowered between lowered ones can cost more than the casts they save,
        e.g. a bf16 LayerNorm on a CPU (``COMPUTE``: the compute operators alone, by class: matmul, convolution,
        attention and recurrent modules, embeddings and other modules with weights). Only plans that differ from the
        candidate plan and from each other are timed; ``CoMPSearch(exclude=...)`` holds in each.
        """
        seen = {PrecisionPlan()[Dimension.COMPUTE].entries}
        if candidate_plan is not None:
            seen.add(candidate_plan[Dimension.COMPUTE].entries)
        out: dict[ComparedPlan, PrecisionPlan] = {}
        for label in ALTERNATIVES:
            plan = self._fixed_plan(label, modules, lowerable, order, decisions, amp)
            if plan[Dimension.COMPUTE].entries not in seen:
                seen.add(plan[Dimension.COMPUTE].entries)
                out[label] = plan
        return out

    def _fixed_plan(self, label: ComparedPlan, modules: dict[str, nn.Module], lowerable: list[str], order: list[str],
                    decisions: dict[str, OperatorDecision], amp: set[str]) -> PrecisionPlan:
        """The whole-step alternative ``label`` (of :data:`ALTERNATIVES`), built whether or not it is timed (see
        :meth:`_alternatives`)."""
        allowed = [n for n in order if n in lowerable and not decisions[n].excluded]
        if label is ComparedPlan.AMP:
            lowered = [n for n in allowed if n in amp]
        elif label is ComparedPlan.COMPUTE:
            # by class, as a user's type rule names them (a leaf judged as compute for the kernels it runs, such as
            # a parameter-free attention, is lowered here only when it pays by itself: as a candidate)
            lowered = [n for n in allowed if classify(modules[n]) in COMPUTE_CLASS_KINDS]
        else:
            lowered = allowed
        return PrecisionPlan.from_dict(dict.fromkeys(lowered, self.low.value))

    def _adopt(self, ctx: StageContext, winner: ComparedPlan, plan: PrecisionPlan, order: list[str],
               decisions: dict[str, OperatorDecision], steps: dict[ComparedPlan, PlanStep]) -> list[str]:
        """Make the operators of the winning alternative ``plan`` the candidates (no cheap-operator fills: the plan
        was timed as it is); return them."""
        lowered = {selector for selector, precision in plan[Dimension.COMPUTE].entries
                   if precision is not ComputePrecision.FP32}
        what = winner.describe(self.low)
        timing = f"({steps[winner].ms:.3f} vs {steps[FP32].ms:.3f} ms per step in fp32"
        timing += f", {steps[CANDIDATES].ms:.3f} ms for the candidates)" if CANDIDATES in steps else ")"
        if steps[FP32].saved_bytes is not None:
            incumbent = CANDIDATES if CANDIDATES in steps else FP32
            timing += (f"; {(steps[winner].saved_bytes or 0.0) / 2**20:.1f} MiB saved for backward vs"
                       f" {(steps[incumbent].saved_bytes or 0.0) / 2**20:.1f} MiB for the {incumbent.value}")
        for name in order:
            decision = decisions[name]
            if name in lowered:
                decision.decision = Choice.CANDIDATE
                decision.reason = f"lowered as in {what}, {ctx.policy.better} {timing}"
            elif decision.decision in (Choice.CANDIDATE, Choice.FILL):
                decision.keep_fp32(f"left fp32: {what} is {ctx.policy.better} {timing}")
        return [n for n in order if n in lowered or decisions[n].forced]

    def _check_candidates(self, ctx: StageContext, steps: StepComparison, names: list[str],
                          decisions: dict[str, OperatorDecision]) -> list[str]:
        """The candidates, unless their plan as a whole does not pay (then only the forced ones stay)."""
        verdict = ctx.agree(ctx.policy.candidates_pay(steps))
        if verdict is Verdict.BELOW:
            return names
        ratio = steps.ratio(CANDIDATES, FP32).describe()
        policy = ctx.policy
        bound = policy.bound_against_fp32(steps, CANDIDATES) if policy.weighs_memory else Verdict.BELOW
        if bound is not Verdict.BELOW:  # the slowdown bound decided (or could not), not the comparison with fp32
            within = "cannot be told within" if bound is Verdict.UNDECIDED else "past"
            why = (f"candidate plan as a whole {within} {policy.slowdown:g}x of the fastest fixed policy's step"
                   f" ({policy.pace.describe(self.low)})")
        else:
            why = ("cannot be told apart from fp32 as a whole step" if verdict is Verdict.UNDECIDED
                   else "candidate plan as a whole not better than fp32")
        for name in names:
            decisions[name].keep_fp32(f"{why} (step time {ratio})")
        return [n for n in names if decisions[n].forced]
