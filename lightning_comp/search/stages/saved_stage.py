"""The batch stage's second dimension: in which precision each operator stores what it saves for backward.

Runs for ``objective="memory"`` and ``objective="balanced"`` once the compute candidates are known. On top of the
candidate plan, the training step is profiled with every eligible operator saving as computed, ``bf16`` and
``fp8`` (interleaved rounds, as for compute precision): per operator, the bytes it saves and its time, pack and
unpack included. The decisions follow from them (:mod:`lightning_comp.search.decisions.saved`); the plan with every
saved lowering is then timed as a whole step beside the candidate plan, and kept only if the objective's policy
finds it better as a whole.

Saved lowerings join the compute candidates in the epoch stage's group testing as candidates of the ``saved``
dimension (:class:`~lightning_comp.search.candidates.Candidate`), in execution order beside their operator, so a
layer whose gradients suffer is isolated like any other candidate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp.execution.recompute import recompute_unsuitable
from lightning_comp.numerics.precision import SavedPrecision
from lightning_comp.operators.kinds import OperatorKind, classify
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.objectives import policy_for
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.saved import (
    SavedDecision,
    SavedStepCheck,
    judge_saved,
    sharing_groups,
    unshared_choices,
)
from lightning_comp.search.decisions.whole_step import StepComparison
from lightning_comp.search.measurement.clocks import Clock
from lightning_comp.search.measurement.estimates import RatioEstimate, paired_ratio
from lightning_comp.search.measurement.profiling import OperatorProfiler, ProfileResult
from lightning_comp.search.measurement.step_timing import StepTimer
from lightning_comp.search.ranks import agree, reduce_mean, reduce_profile
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.stages.batch_result import SavedStageResult

__all__ = ["SavedStage"]

_RECOMPUTE = SavedPrecision.RECOMPUTE.value  # the profiled configuration in which the cheap operators recompute


class SavedStage:
    """Measures and decides the saved precision of each operator (see the module docstring).

    Args:
        config: the search's settings.
        plugin: the plugin that puts each measured plan into effect.
        progress: where measured rounds are shown.
    """

    def __init__(self, config: SearchConfig, plugin: CoMPPrecision, progress: SearchProgress | None = None) -> None:
        self.config = config
        self.policy = policy_for(config)
        self.plugin = plugin
        self.progress = progress

    def eligible(self, modules: dict[str, torch.nn.Module], order: list[str]) -> list[str]:
        """Operators whose saved precision may be lowered: all that ran, but shape-only and excluded ones."""
        excluded = self.config.excluded
        return [n for n in order if classify(modules[n]) is not OperatorKind.SHAPE
                and not excluded.matches(n, modules[n])]

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None], clock: Clock,
                base: PrecisionPlan, modules: dict[str, torch.nn.Module], order: list[str],
                decisions: dict[str, OperatorDecision]) -> SavedStageResult:
        """Measure, decide per operator (into each ``decisions[name].saved``), and check the plan as a whole step."""
        eligible = self.eligible(modules, order)
        # bf16 shrinks only what an operator computing in fp32 saves: not worth profiling when every one is lowered
        options = tuple(s for s in self.policy.saved_options if s is not SavedPrecision.BF16
                        or any(not base.of(Dimension.COMPUTE, n, type(modules[n])).is_low for n in eligible))
        recomputable = [n for n in eligible if self.policy.recomputes and recompute_unsuitable(modules[n]) is None]
        if not options and not recomputable:  # e.g. saved_precision="bf16" with every operator computing in 16 bits
            return SavedStageResult()
        results = self._profile(trainer, pl_module, step, clock, base, eligible, options, recomputable)
        result = SavedStageResult()
        if recomputable:
            self._decide_recompute(results, recomputable, modules, decisions, result)
        codec = [n for n in eligible if n not in result.choices]
        self._decide(results, codec, options, modules, decisions, result)
        result.choices, result.benefits = agree(trainer, (result.choices, result.benefits))
        if result.choices:
            result.check = self._whole_step(trainer, pl_module, step, clock, base, result.choices)
            if not result.check.pays:
                for name in list(result.choices):
                    saved = decisions[name].saved
                    if saved is not None and not saved.forced:
                        saved.keep_as_computed(f"saves as computed: {result.check.verdict}")
                        result.drop(name)
        return result

    def _profile(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None], clock: Clock,
                 base: PrecisionPlan, eligible: list[str], options: tuple[SavedPrecision, ...],
                 recomputable: list[str]) -> dict[str, ProfileResult]:
        """The candidate plan profiled with every eligible operator saving as computed and at each option, and with
        every recomputable one recomputing."""
        config, plugin = self.config, self.plugin
        plans = {"fp32": base, **{s.value: base.with_assignment(Dimension.SAVED, dict.fromkeys(eligible, s.value))
                                  for s in options}}
        if recomputable:
            plans[_RECOMPUTE] = base.with_assignment(Dimension.SAVED,
                                                     dict.fromkeys(recomputable, SavedPrecision.RECOMPUTE.value))
        # Profiled as training steps run (calibrated cast boundaries, so a lowered operator's output stays low where
        # training keeps it low, and the tensors operators share are the ones training shares). A saved precision
        # does not move a cast boundary: one calibrating step of the base plan serves every configuration.
        with plugin.measured_step(base):
            step()
        configs: dict[str, Callable[[], Any]] = {
            label: functools.partial(plugin.measured_step, plan) for label, plan in plans.items()}
        profiler = OperatorProfiler(pl_module, clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:  # the bar counts rounds (each measures every configuration)
            self.progress.extend_stage(config.profile_warmup + config.profile_steps)
            profiler.on_round = functools.partial(self.progress.round_done, "saved precision, per operator")
        results = profiler.profile(configs, step)
        reduce_profile(trainer, results)
        return results

    def _decide_recompute(self, results: dict[str, ProfileResult], recomputable: list[str],
                          modules: dict[str, torch.nn.Module], decisions: dict[str, OperatorDecision],
                          result: SavedStageResult) -> None:
        """The cheap operators' recomputation, judged as one group against the whole step: what recomputing an
        operator frees shows in its consumers' saved bytes (the next Linear no longer holds the GELU's output),
        and what it costs in the backward of every operator that unpacks it."""
        base, recomputed = results["fp32"], results[_RECOMPUTE]
        ran = [n for n in base.order if n in base.operators and n in recomputed.operators]
        if not ran:
            return
        before, after = base.saved_bytes, recomputed.saved_bytes
        time = paired_ratio(_summed(base, ran), _summed(recomputed, ran))
        group = tuple(n for n in recomputable if n in base.operators)
        shared = judge_saved(self.policy, before, {SavedPrecision.RECOMPUTE: (after, time)})
        shared.reason = (f"{shared.reason} (the {len(group)} cheap operators recompute together: the step's saved"
                         f" bytes {before / 2**20:.2f} -> {after / 2**20:.2f} MiB, the step x{time.ratio:.2f})")
        for name in group:
            decision = _share_of(shared, group)
            decision.reason = shared.reason
            decisions[name].saved = decision
            if decision.lowers:
                result.choices[name] = decision.decision
                result.benefits[Candidate.saved(name)] = decision.benefit

    def _decide(self, results: dict[str, ProfileResult], eligible: list[str], options: tuple[SavedPrecision, ...],
                modules: dict[str, torch.nn.Module], decisions: dict[str, OperatorDecision],
                result: SavedStageResult) -> SavedStageResult:
        """Each group of operators that save the same tensors judged together; forced and unshared ones settled."""
        included = self.config.included_saved
        base = results["fp32"]
        ran = [n for n in eligible if n in base.operators]
        for group in sharing_groups(ran, base.sharing) if options else []:
            measured: dict[SavedPrecision, tuple[int, RatioEstimate]] = {
                s: (sum(results[s.value].operators[n].own_saved_bytes for n in group),
                    paired_ratio(_summed(base, group), _summed(results[s.value], group)))
                for s in options if all(n in results[s.value].operators for n in group)}
            shared = judge_saved(self.policy, sum(base.operators[n].own_saved_bytes for n in group), measured)
            for name in group:
                decision = _share_of(shared, group)
                if included.matches(name, modules[name]):
                    decision.forced = True
                    if not decision.lowers:
                        smallest = options[0]  # fp8 with saved_precision="auto"
                        decision.decision = smallest
                        decision.reason = f"included by CoMPSearch(include_saved=...) at {smallest.value}"
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
        return result

    def _whole_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Callable[[], None], clock: Clock,
                    base: PrecisionPlan, choices: dict[str, SavedPrecision]) -> SavedStepCheck:
        """Time the candidate plan with and without the saved lowerings as whole steps, and judge the difference."""
        config, plugin = self.config, self.plugin
        with_saved = base.with_assignment(Dimension.SAVED, {name: saved.value for name, saved in choices.items()})
        plans = {"fp32": PrecisionPlan(), "candidates": base, "saved": with_saved}
        configs: dict[str, Callable[[], Any]] = {
            label: functools.partial(plugin.measured_step, plan) for label, plan in plans.items()}
        timer = StepTimer(clock, config.profile_steps, config.profile_warmup)
        if self.progress is not None:
            self.progress.extend_stage(config.profile_warmup + config.profile_steps)
            timer.on_round = functools.partial(self.progress.round_done, "saved precision, whole steps")
        times = timer.time(configs, step)
        saved = {k: reduce_mean(trainer, float(v)) for k, v in timer.saved_bytes(pl_module, configs, step).items()}
        steps = StepComparison(times.ms)
        memory_ratio = saved["saved"] / saved["candidates"] if saved["candidates"] > 0 else 1.0
        ok, bound = self.policy.saved_step(steps, memory_ratio)
        shown = (f"saved bytes x{memory_ratio:.2f} of the candidates' ({saved['saved'] / 2**20:.1f} vs"
                 f" {saved['candidates'] / 2**20:.1f} MiB), step time {steps.ratio('saved', 'fp32').describe()} of"
                 " fp32")
        verdict = agree(trainer, "pays" if ok else f"as a whole step not {bound}: {shown}")
        return SavedStepCheck(pays=verdict == "pays", verdict=verdict, description=shown, saved_bytes=saved,
                              step_ms={k: min(v) for k, v in times.ms.items()}, step_ratios=steps.ratios())


def _share_of(shared: SavedDecision, group: tuple[str, ...]) -> SavedDecision:
    """One member's copy of its group's decision: an equal share of what the group gains."""
    share = replace(shared, bytes=dict(shared.bytes), time_ratios=dict(shared.time_ratios),
                    gain_bytes=shared.gain_bytes // len(group), benefit=shared.benefit / len(group))
    if len(group) > 1:
        share.group = group
        share.reason = f"{shared.reason} (judged with {', '.join(group)}: they save the same tensors)"
    return share


def _summed(result: ProfileResult, names: Sequence[str]) -> list[float]:
    """The per-round total time of ``names`` together."""
    series = [result.series(name) for name in names]
    return [sum(values) for values in zip(*series)]
