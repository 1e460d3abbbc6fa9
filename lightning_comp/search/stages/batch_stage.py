"""The batch stage: which operators are worth a convergence trial, measured on one batch of the user's training.

At the first batch of the search, the training step is run repeatedly on that batch, in FP32 and with every
operator lowered, to measure each operator's forward and backward time and the bytes it saves for backward
(:mod:`lightning_comp.search.measurement`). The lowered steps run at the cast boundaries training with that plan has
(a lowered output stays low into a lowered consumer), so no operator is charged a cast training would not pay; where
the candidate plan keeps a neighbour in FP32, its candidates are measured again at that plan's own boundaries. Each
operator's decision follows from its measurements (:mod:`lightning_comp.search.decisions.operators`): operators whose
low-precision cost does not beat FP32 by the margin stay FP32 and are never trialled, cheap operators between two
lowered operators are lowered with them. The candidate plan is then timed as a whole step beside the fixed policies
(FP32, and AMP's plan: what one global autocast region lowers in this step) and the all-low and compute-only plans,
and the objective's policy (:mod:`lightning_comp.search.decisions.objectives`) decides which of them the epoch stage
trials, keeping the candidates unless an alternative wins by ``switch_margin``; if nothing beats FP32, the search
ends. With the memory and balanced objectives, the saved stage
(:mod:`lightning_comp.search.stages.saved_stage`) adds the saved-precision candidates, and the parameter stage
(:mod:`lightning_comp.search.stages.parameter_stage`) the optimizer-state and master-weight ones.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp.devices.device_classes import model_device
from lightning_comp.devices.lowering import Lowering, lowering_for
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.operators.kinds import classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig, Timing
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.decisions.operators import (
    HEAVY_KINDS,
    Choice,
    OperatorDecision,
    decide_operators,
    recheck_at_plan_boundaries,
)
from lightning_comp.search.decisions.trial_plans import cheap_runs, plan_for
from lightning_comp.search.decisions.whole_step import StepComparison
from lightning_comp.search.measurement.autocast_lowering import lowered_under_autocast
from lightning_comp.search.measurement.clock_choice import TimingChoice, choose_timing, cpu_clock, is_busy, sample_load
from lightning_comp.search.measurement.clocks import Clock, ClockKind, single_intra_op_thread
from lightning_comp.search.measurement.estimates import Verdict
from lightning_comp.search.measurement.extra_rounds import ExtraRounds
from lightning_comp.search.measurement.machine_load import LoadMeter
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult
from lightning_comp.search.measurement.step_runner import TrainingStepRunner
from lightning_comp.search.measurement.step_timing import StepTimer, StepTimes
from lightning_comp.search.ranks import agree, reduce_mean, reduce_profile
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.rewind.snapshot import capture_rng, restore_rng
from lightning_comp.search.stages.batch_result import BatchStageResult, ParameterStageResult, SavedStageResult
from lightning_comp.search.stages.parameter_stage import ParameterStage
from lightning_comp.search.stages.saved_stage import SavedStage

__all__ = ["ALTERNATIVES", "BatchStage"]

# The whole-step alternatives to the per-operator candidate plan, in words ("{low}": the searched precision)
ALTERNATIVES = {
    "amp": "AMP's plan (what one global {low} autocast region lowers)",
    "all_low": "the all-{low} plan",
    "compute": "the plan of compute operators only",
}

Step = Callable[[], None]


class BatchStage:
    """Measures the operators of a model on one batch and decides the candidates of the epoch stage.

    Args:
        config: the search's settings.
        low: the 16-bit precision searched.
        plugin: the plugin that puts each measured plan into effect.
        progress: where measured rounds are shown (nothing is shown without it).
    """

    def __init__(self, config: SearchConfig, low: ComputePrecision, plugin: CoMPPrecision,
                 progress: SearchProgress | None = None) -> None:
        self.config = config
        self.policy = policy_for(config)
        self.low = low
        self.plugin = plugin
        self.progress = progress

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
            restore: Callable[[], None]) -> BatchStageResult:
        """Measure and decide; ``restore`` puts the run's state back afterwards (the stage trains nothing).

        Returns:
            Rank 0's result, on every rank.
        """
        plugin, config = self.plugin, self.config
        device = model_device(pl_module)
        rng = capture_rng()
        step = TrainingStepRunner(pl_module, batch, batch_idx)
        try:
            with plugin.measured_step(PrecisionPlan()):  # a model's first step traces the operators it computes in
                step()
            timing = agree(trainer, choose_timing(config.timing, device.type, lambda: sample_load(step)))
            meter = LoadMeter()
            meter.start()
            result = self.measure(trainer, pl_module, step, timing)
            load = meter.stop()
            if config.timing is Timing.AUTO and timing.clock is ClockKind.WALL and agree(trainer, is_busy(load)):
                timing = cpu_clock("this process's CPU time with one intra-op thread: the machine became busy during"
                                   f" the wall-time measurement ({load.describe()}), which was repeated", load)
                result = self.measure(trainer, pl_module, step, timing)
        finally:
            if self.progress is not None:
                self.progress.close_stage()
            # fp32 first: a measured plan may hold bf16 masters, which must be fp32 again before the snapshot's
            # values are copied into them
            plugin.try_plan(PrecisionPlan().with_provenance(role="trial", trial="fp32 reference"))
            restore()
            restore_rng(rng)
        result.timing = timing.to_dict()
        return agree(trainer, result)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step,
                timing: TimingChoice) -> BatchStageResult:
        """Per-operator and whole-step measurements with ``timing``'s clock, and the decisions they give."""
        device = model_device(pl_module)
        modules = dict(iter_operators(pl_module))
        lowerable = [n for n, m in modules.items() if lowering_for(m, self.low, device) not in (None, Lowering.NONE)]
        clock = timing.make_clock()
        with self.plugin.measured_step(PrecisionPlan(), calibrated=False):  # the model in fp32, under AMP's region
            amp = agree(trainer, sorted(lowered_under_autocast(modules, step, device.type, self.low)))
        if self.progress is not None:  # per-operator rounds, then whole-step rounds
            self.progress.start_stage(len(lowerable), 2 * self._first_rounds)
        with single_intra_op_thread(timing.single_thread):
            results = self._profile_operators(trainer, pl_module, step, clock, modules, lowerable)
            # every rank must time the same whole-step plans (each timing is a collective): rank 0's decisions
            decisions = agree(trainer, decide_operators(self.config, self.policy, self.low, modules, lowerable,
                                                        results))
            order = results["fp32"].order
            runs = cheap_runs(order, decisions, modules)
            names = [n for n in order if decisions[n].is_candidate]
            candidate_plan = plan_for(self.low, runs, [Candidate(n) for n in names]) if names else None
            all_low = self._all_low(lowerable)[Dimension.COMPUTE]
            if candidate_plan is not None and candidate_plan[Dimension.COMPUTE] != all_low:
                # its cast boundaries differ from the all-low plan's the operators were measured at
                plan_profile = self._profile_at_boundaries(trainer, pl_module, step, clock, candidate_plan)
                dropped = agree(trainer, recheck_at_plan_boundaries(self.policy, decisions, plan_profile))
                for name, why in dropped.items():
                    decisions[name].keep_fp32(why)
                if dropped:
                    runs = cheap_runs(order, decisions, modules)
                    names = [n for n in order if decisions[n].is_candidate]
                    candidate_plan = plan_for(self.low, runs, [Candidate(n) for n in names]) if names else None
            alternatives = self._alternatives(modules, lowerable, order, decisions, candidate_plan, set(amp))
            plans = {"candidates": candidate_plan} if candidate_plan is not None else {}
            plans.update(alternatives)
            times, step_saved = self._time_whole_steps(trainer, pl_module, step, clock, plans)
        steps = StepComparison(times.ms)
        step_ms = {k: reduce_mean(trainer, min(v)) for k, v in times.ms.items()}
        winner = agree(trainer, self.policy.winner(steps, step_saved, list(alternatives), bool(names)))
        if winner is not None:
            names, runs = self._adopt(winner, alternatives[winner], order, decisions, step_ms, step_saved), []
        elif names:
            names = self._check_candidates(trainer, steps, names, decisions)
        saved = SavedStageResult()
        parameters = ParameterStageResult()
        base = plan_for(self.low, runs, [Candidate(n) for n in names])
        if (self.policy.saved_options or self.policy.recomputes) and not self.plugin.compiled:  # compiled: AOTAutograd
            # decides what is saved
            with single_intra_op_thread(timing.single_thread):
                saved = SavedStage(self.config, self.plugin, self.progress).measure(
                    trainer, pl_module, step, clock, base, modules, order, decisions)
        if self.policy.weighs_memory:
            with_saved = base.with_assignment(Dimension.SAVED, {n: s.value for n, s in saved.choices.items()})
            chosen = winner or ("candidates" if names else "fp32")  # the plan the candidates now are
            saved_bytes = step_saved.get(chosen, step_saved.get("fp32", 0.0))
            chosen_ms = {"fp32": step_ms["fp32"], "candidates": step_ms.get(chosen, step_ms["fp32"])}
            if saved.check is not None and saved.check.pays:
                saved_bytes = saved.check.saved_bytes.get("saved", saved_bytes)
            with single_intra_op_thread(timing.single_thread):
                parameters = ParameterStage(self.config, self.low, self.plugin, self.progress).measure(
                    trainer, pl_module, step, clock, with_saved, decisions, chosen_ms, saved_bytes)
        compute = set(names)
        candidates: list[Candidate] = []
        for name in order:  # execution order, each operator's candidates together (compute, saved, state, master)
            if name in compute:
                candidates.append(Candidate(name))
            if name in saved.choices:
                candidates.append(Candidate.saved(name))
            if name in parameters.state_choices:
                candidates.append(Candidate.state(name))
            if name in parameters.master_choices:
                candidates.append(Candidate.master(name))
        candidates += [Candidate(n) for n in names if Candidate(n) not in candidates]  # forced ones that did not run
        benefits = {Candidate(n): decisions[n].benefit for n in names}
        benefits.update(saved.benefits)
        benefits.update(parameters.benefits)
        return BatchStageResult(
            decisions=decisions, candidates=tuple(candidates), benefits=benefits, runs=runs, saved=saved,
            parameters=parameters,
            order=order, step_ms=step_ms,
            step_wall_ms={k: reduce_mean(trainer, min(v)) for k, v in times.wall_ms.items()},
            step_ratios=steps.ratios(), step_saved_bytes=step_saved,
            memory={label: {"saved_bytes": r.saved_bytes, "peak_bytes": r.peak_bytes} for label, r in results.items()},
        )

    # ---------------------------------------------------------------------------------------------- measuring
    def _profile_operators(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step, clock: Clock,
                           modules: dict[str, torch.nn.Module], lowerable: list[str]) -> dict[str, ProfileResult]:
        """Every operator's time and saved bytes in FP32 and with everything lowerable lowered, with extra rounds
        while an operator cannot be decided (within the budget); averaged over ranks."""
        config, plugin = self.config, self.plugin
        profiler = OperatorProfiler(pl_module, clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:
            profiler.on_round = functools.partial(self.progress.round_done, f"per operator, fp32/{self.low.value}")
        # Weight copies are saved as recipes, as in training (recast_weights_in_backward): not counted as saved bytes.
        # The all-low plan runs at its training cast boundaries (calibrated): an operator's output stays low where
        # its consumers compute low too, so no operator is charged an output cast that training with its
        # neighbours lowered does not pay. The candidate plan's own boundaries are checked afterwards
        # (_profile_at_boundaries).
        all_low = self._all_low(lowerable)
        configs: dict[str, Callable[[], Any]] = {
            "fp32": functools.partial(plugin.measured_step, PrecisionPlan(), calibrated=False),
            "low": functools.partial(plugin.measured_step, all_low)}
        if config.profile_warmup == 0:  # the calibrating step traces, slower than a step: never a measured one
            with plugin.measured_step(all_low):
                step()
        started = time.perf_counter()
        results = profiler.profile(configs, step)

        def undecided() -> bool:
            decided = decide_operators(config, self.policy, self.low, modules, lowerable, results)
            return any(d.settled is False for d in decided.values())

        self._extend_while(trainer, ExtraRounds(config, time.perf_counter() - started, self._first_rounds),
                           undecided, lambda more: profiler.extend(results, configs, step, more))
        reduce_profile(trainer, results)
        return results

    def _all_low(self, lowerable: list[str]) -> PrecisionPlan:
        """The plan lowering every operator that can compute in the searched precision on the device."""
        return PrecisionPlan.from_dict({n: self.low.value for n in lowerable})

    def _profile_at_boundaries(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step, clock: Clock,
                               plan: PrecisionPlan) -> dict[str, ProfileResult]:
        """Every operator's time under ``plan`` at its training cast boundaries (beside FP32, interleaved): where
        an operator next to one ``plan`` keeps in FP32 pays the casts it would pay in training; averaged over
        ranks."""
        config, plugin = self.config, self.plugin
        # half the first profile's rounds: it only drops candidates that clearly stop paying (the whole step decides
        # the rest), and the calibrating round it needs is a warm-up one
        rounds, warmup = max(2, (config.profile_steps + 1) // 2), max(config.profile_warmup, 1)
        profiler = OperatorProfiler(pl_module, clock, rounds, warmup)
        if self.progress is not None:
            self.progress.extend_stage(rounds + warmup)
            profiler.on_round = functools.partial(self.progress.round_done, "per operator, at the plan's casts")
        results = profiler.profile({
            "fp32": functools.partial(plugin.measured_step, PrecisionPlan(), calibrated=False),
            "plan": functools.partial(plugin.measured_step, plan)}, step)
        reduce_profile(trainer, results)
        return results

    def _time_whole_steps(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step, clock: Clock,
                          plans: dict[str, PrecisionPlan]) -> tuple[StepTimes, dict[str, float]]:
        """Whole steps of FP32 and of ``plans``, interleaved, with extra rounds while a comparison the policy
        decides from is undecided; and (objectives that weigh memory) the bytes each saves for backward."""
        config = self.config
        configs: dict[str, Callable[[], Any]] = {
            label: functools.partial(self.plugin.measured_step, plan)
            for label, plan in {"fp32": PrecisionPlan(), **plans}.items()}
        timer = StepTimer(clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:
            timer.on_round = functools.partial(self.progress.round_done, f"whole steps, {len(configs)} plans")
        started = time.perf_counter()
        times = timer.time(configs, step)
        contenders = set(configs)  # extra rounds time only the plans of undecided comparisons; the set only shrinks

        def undecided() -> bool:  # (every rank times rank 0's contenders: each timing is a collective)
            involved = agree(trainer, sorted(self.policy.undecided(StepComparison(times.ms), list(plans))))
            contenders.intersection_update(involved)
            return bool(contenders)

        self._extend_while(trainer, ExtraRounds(config, time.perf_counter() - started, self._first_rounds),
                           undecided, lambda more: timer.time({k: v for k, v in configs.items() if k in contenders},
                                                              step, into=times, rounds=more, warmup=0))
        saved: dict[str, float] = {}
        if self.policy.weighs_memory:
            saved = {k: reduce_mean(trainer, float(v)) for k, v in timer.saved_bytes(pl_module, configs, step).items()}
        return times, saved

    @property
    def _first_rounds(self) -> int:
        return self.config.profile_warmup + self.config.profile_steps

    def _extend_while(self, trainer: pl.Trainer, budget: ExtraRounds, undecided: Callable[[], bool],
                      add: Callable[[int], Any]) -> None:
        """Measure more rounds (``add(rounds)``) while something is ``undecided`` and the budget lasts; every rank
        measures as many rounds as rank 0 asks for."""
        while True:
            more = agree(trainer, budget.next_rounds() if undecided() else 0)
            if not more:
                return
            if self.progress is not None:
                self.progress.extend_stage(more)
            with budget.spending():
                add(more)

    # ---------------------------------------------------------------------------------------------- deciding
    def _alternatives(self, modules: dict[str, torch.nn.Module], lowerable: list[str], order: list[str],
                      decisions: dict[str, OperatorDecision], candidate_plan: PrecisionPlan | None,
                      amp: set[str]) -> dict[str, PrecisionPlan]:
        """Whole-step alternatives to the per-operator candidate plan (``None``: no candidate), timed beside it.

        ``amp`` is the fixed policy a user would otherwise pick: the operators one global autocast region lowers
        (:mod:`lightning_comp.search.measurement.autocast_lowering`); FP32, the other fixed policy, is always timed.
        The others catch effects per-operator timings miss: casts vanish inside long low-precision runs
        (``all_low``), and cheap operators lowered between lowered ones can cost more than the casts they save,
        e.g. a bf16 LayerNorm on a CPU (``compute``: the compute operators alone). Only plans that differ from the
        candidate plan and from each other are timed; ``CoMPSearch(exclude=...)`` holds in each.
        """
        low = self.low.value
        allowed = [n for n in order if n in lowerable and not decisions[n].excluded]
        heavy = [n for n in allowed if classify(modules[n]) in HEAVY_KINDS]
        options = {
            "amp": PrecisionPlan.from_dict({n: low for n in allowed if n in amp}),
            "all_low": PrecisionPlan.from_dict({n: low for n in allowed}),
            "compute": PrecisionPlan.from_dict({n: low for n in heavy}),
        }
        seen = {PrecisionPlan()[Dimension.COMPUTE].entries}
        if candidate_plan is not None:
            seen.add(candidate_plan[Dimension.COMPUTE].entries)
        out: dict[str, PrecisionPlan] = {}
        for label, plan in options.items():
            if plan[Dimension.COMPUTE].entries not in seen:
                seen.add(plan[Dimension.COMPUTE].entries)
                out[label] = plan
        return out

    def _adopt(self, winner: str, plan: PrecisionPlan, order: list[str], decisions: dict[str, OperatorDecision],
               step_ms: dict[str, float], saved: dict[str, float]) -> list[str]:
        """Make the operators of the winning alternative ``plan`` the candidates (no cheap-operator fills: the plan
        was timed as it is); return them."""
        lowered = {selector for selector, precision in plan[Dimension.COMPUTE].entries
                   if precision is not ComputePrecision.FP32}
        what = ALTERNATIVES[winner].format(low=self.low)
        timing = f"({step_ms[winner]:.3f} vs {step_ms['fp32']:.3f} ms per step in fp32"
        timing += f", {step_ms['candidates']:.3f} ms for the candidates)" if "candidates" in step_ms else ")"
        if saved:
            incumbent = "candidates" if "candidates" in saved else "fp32"
            timing += (f"; {saved[winner] / 2**20:.1f} MiB saved for backward vs {saved[incumbent] / 2**20:.1f} MiB"
                       f" for the {incumbent}")
        for name in order:
            decision = decisions[name]
            if name in lowered:
                decision.decision = Choice.CANDIDATE
                decision.reason = f"lowered as in {what}, {self.policy.better} {timing}"
            elif decision.decision in (Choice.CANDIDATE, Choice.FILL):
                decision.keep_fp32(f"left fp32: {what} is {self.policy.better} {timing}")
        return [n for n in order if n in lowered or decisions[n].forced]

    def _check_candidates(self, trainer: pl.Trainer, steps: StepComparison, names: list[str],
                          decisions: dict[str, OperatorDecision]) -> list[str]:
        """The candidates, unless their plan as a whole does not pay (then only the forced ones stay)."""
        verdict = agree(trainer, self.policy.candidates_pay(steps))
        if verdict is Verdict.BELOW:
            return names
        ratio = steps.ratio("candidates", "fp32").describe()
        why = ("cannot be told apart from fp32 as a whole step" if verdict is Verdict.UNDECIDED
               else "candidate plan as a whole not better than fp32")
        for name in names:
            decisions[name].keep_fp32(f"{why} (step time {ratio})")
        return [n for n in names if decisions[n].forced]
