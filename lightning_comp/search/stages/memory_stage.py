"""The batch stage's memory dimensions (:func:`memory_levers`: the saved and parameter stages in turn) and the
memory and balanced objectives' last step on them: every memory lever measured
(:mod:`~lightning_comp.search.stages.memory_lever_options`), cheapest bytes first.

The saved stage (:mod:`lightning_comp.search.stages.saved_stage`) and the parameter stage
(:mod:`lightning_comp.search.stages.parameter_stage`) measure, per operator (or unit), what each saved precision,
recompute, optimizer-state format and bf16 master frees and what it costs. Judged one by one, or kept or dropped all
together by one whole step, they spend the step time badly: an 8-bit state that costs more per byte than a cheap
recompute is kept with it, or a recompute too slow as a whole drops the cheap part. Here they are ranked together by
bytes freed per millisecond added (:mod:`lightning_comp.search.decisions.cheapest_bytes`) and taken cheapest first
while the step stays within ``max_slowdown_vs_fastest`` of the pace (the fastest fixed policy measured), until
``memory_budget`` is met when one is set; the balanced objective takes each only where it makes the step better in
time x memory (the share of the step's bytes it frees exceeds the share of time it adds).

The step's bytes are the search's accounting of its peak: the weights, their gradients, the optimizer state and what
the step saves for backward. The step's time is the candidate plan's forward and backward plus the optimizer's own
update; each lever adds its measured time by the median of its paired rounds (the slow end of a few rounds' interval
is where one load spike lands: it priced a bf16 store at 12x its median in one run), and the whole-step check below
catches a forecast the medians made too kind. The chosen plan is then timed as a whole
step beside the candidate plan (forward and backward measured, updates added): if it runs slower than allowed beyond
the rounds' doubt (the fast end of their ratio's interval past the bound), the allowance is shrunk by the forecast's
error (by the median) and the levers past it are given back, so a forecast that was too kind does not carry the plan
past the bound. Where the rounds cannot tell the plan's step from the bound, the forecast stands: the levers fill the
room up to the bound by construction, so the median of four rounds falls past it about every other search, and on
the default example such a check gave back 20 MiB of levers for a step read 0.65 % past the bound (1146.5 against
1139.0 ms), a coin flip that changed the plan from run to run.

Where the batch stage's paired rounds cannot tell the plan the levers build on from the pace (the interval of their
step ratio holds 1), the bound is ``max_slowdown_vs_fastest`` of that plan's own step (:func:`bound_step`): the
rounds measure both as fast, and the room the levers get is then the bound's share of the step, not that share plus
a difference the rounds cannot tell from noise. On the default example the candidates measured x0.98-x1.04 of the
compute-only plan (the pace) in three searches, every interval holding 1, and the room swung 25.7-38.1 ms (x0.11-x0.17
of the step) with that noise; how many levers fit followed it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning_comp.execution.optimizer_states import state_bytes
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.config import Objective
from lightning_comp.search.decisions.batch_result import ParameterStageResult, SavedStageResult
from lightning_comp.search.decisions.cheapest_bytes import (
    LeverOption,
    MemorySpending,
    Selection,
    levers_past,
    take_cheapest,
)
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.whole_step import ComparedPlan, Pace, PlanStep, StepComparison
from lightning_comp.search.measurement.estimates import Verdict, paired_ratio
from lightning_comp.search.measurement.optimizer_timing import UpdateVariant
from lightning_comp.search.measurement.step_timing import StepTimer
from lightning_comp.search.stages.context import StageContext
from lightning_comp.search.stages.measured_peaks import measure_excess
from lightning_comp.search.stages.memory_lever_options import LeverBuilder, LeverChange
from lightning_comp.search.stages.parameter_stage import ParameterStage
from lightning_comp.search.stages.saved_stage import SavedStage

__all__ = ["CheapestBytesStage", "bound_step", "memory_levers", "on_pace_scale"]

CANDIDATES, PARAMETERS = ComparedPlan.CANDIDATES, ComparedPlan.PARAMETERS


class CheapestBytesStage:
    """Ranks and takes the memory levers (see the module docstring).

    Args:
        ctx: the batch stage's run.
    """

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.config = ctx.config

    def run(self, base: PrecisionPlan, decisions: dict[str, OperatorDecision], saved: SavedStageResult,
            parameters: ParameterStageResult, fp32_ms: float, candidates_ms: float,
            step_saved: dict[ComparedPlan, float], candidates_saved: float,
            amp_plan: PrecisionPlan | None = None, bound_ms: float | None = None,
            bound_of: str = "") -> MemorySpending:
        """Take levers into ``saved`` and ``parameters`` (whose choices are rewritten), decisions updated.

        Args:
            base: the candidate plan (compute precisions only).
            decisions: the operators' decisions, with the saved and parameter stages' measurements.
            saved: the saved stage's result (its choices are replaced by what is taken).
            parameters: the parameter stage's result (likewise).
            fp32_ms: the FP32 plan's forward and backward.
            candidates_ms: the candidate plan's forward and backward.
            step_saved: bytes saved for backward per whole-step plan timed.
            candidates_saved: bytes the candidate plan saves for backward.
            amp_plan: AMP's plan (the operators one autocast region lowers): a fractional ``memory_budget`` is judged
                against its step's measured tensor peak (``None``: by the accounting alone).
            bound_ms: the forward and backward (ms) the slowdown bound is a multiple of (:func:`bound_step`;
                ``None``: the pace's, FP32's step times the pace's ratio to it).
            bound_of: what ``bound_ms`` is, in words, for the record.
        """
        ctx = self.ctx
        model = ctx.pl_module
        optimizers = ctx.trainer.optimizers
        persistent = float(2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
        persistent += float(state_bytes(optimizers[0])) if len(optimizers) == 1 else 0.0
        update_ms = sum(d.parameters.update_ms.get(UpdateVariant.FP32, 0.0) for d in decisions.values()
                        if d.parameters is not None)
        amp_saved = next((step_saved[p] for p in (ComparedPlan.AMP, ComparedPlan.AUTOCAST) if p in step_saved), None)
        amp_bytes = None if amp_saved is None else persistent + amp_saved
        target = self.config.budget_bytes(amp_bytes if amp_bytes is not None else persistent + candidates_saved)
        pace_ms = (fp32_ms * ctx.policy.pace.ratio_to_fp32 if bound_ms is None else bound_ms) + update_ms
        max_ms = self.config.slowdown_vs_fastest * pace_ms
        start_bytes, start_ms = persistent + candidates_saved, candidates_ms + update_ms
        builder = LeverBuilder(self.ctx)
        levers, changes = builder.build(base, decisions)
        # a budget the job needs goes past the default bound, not past one the user set
        past = self.config.max_slowdown_vs_fastest is None
        weigh = self.config.objective is Objective.BALANCED
        selection = ctx.agree(take_cheapest(levers, start_bytes, start_ms, max_ms, target, past_bound=past,
                                            weigh_time=weigh))
        spending = MemorySpending(start_bytes=start_bytes, start_ms=start_ms, max_ms=max_ms, target_bytes=target,
                                  amp_step_bytes=amp_bytes, selection=selection,
                                  levers={label: _candidates(change) for label, change in changes.items()},
                                  options={lever.label: list(lever.options) for lever in levers},
                                  update_costs={variant.value: cost for variant, cost in builder.update_costs.items()},
                                  codec_costs={codec.value: cost for codec, cost in builder.codec_costs.items()},
                                  bound_of=bound_of)
        self._spend(spending, base, changes, decisions, saved, parameters, update_ms)
        amp_plan = amp_plan if amp_bytes is not None else None  # AMP's not timed: a fraction is of the start's
        excess = measure_excess(ctx, spending, base, _with_choices(base, saved, parameters), amp_plan,
                                parameters.state_choices)
        if excess > 0 and spending.selection.met:
            # a budget is judged by what the step needs: the process needs more than the accounting counts (the
            # allocator, temporaries), so the levers are taken further by what it needs beyond the budget
            spending.process_target_bytes = spending.final_bytes - excess
            spending.selection = ctx.agree(take_cheapest(levers, start_bytes, start_ms, max_ms,
                                                         spending.process_target_bytes, past_bound=past,
                                                         weigh_time=weigh))
            spending.given_back = []
            self._spend(spending, base, changes, decisions, saved, parameters, update_ms)
            measure_excess(ctx, spending, base, _with_choices(base, saved, parameters), amp_plan,
                           parameters.state_choices)
        return spending

    def _spend(self, spending: MemorySpending, base: PrecisionPlan, changes: dict[str, dict[str, LeverChange]],
               decisions: dict[str, OperatorDecision], saved: SavedStageResult, parameters: ParameterStageResult,
               update_ms: float) -> None:
        """Write the selection's levers into the stages' choices, and time the plan whole once."""
        selection = spending.selection
        spending.forecast_ms = selection.frontier[-1].step_ms
        spending.final_bytes = selection.frontier[-1].step_bytes
        self._apply(selection, changes, decisions, saved, parameters)
        if selection.chosen and math.isfinite(spending.max_ms):
            self._check(base, spending, changes, decisions, saved, parameters, update_ms)
            spending.final_bytes = spending.start_bytes - sum(o.bytes_saved
                                                              for o in spending.selection.chosen.values())

    # ------------------------------------------------------------------------------------------------ levers
    # ------------------------------------------------------------------------------------------------ applying
    def _apply(self, selection: Selection, changes: dict[str, dict[str, LeverChange]],
               decisions: dict[str, OperatorDecision], saved: SavedStageResult,
               parameters: ParameterStageResult) -> None:
        """Rewrite the stages' choices to what is taken; each operator's decision says why."""
        # the levers' operators start from nothing taken (a forced choice stays: its lever is taken first anyway)
        for name in _saved_lever_operators(changes):
            entry = decisions[name].saved
            if name in saved.choices and not (entry is not None and entry.forced):
                saved.drop(name)
        for name in _parameter_lever_operators(changes):
            params = decisions[name].parameters
            if not (params is not None and params.forced):
                parameters.drop(name)
        value_of = {point.lever: point for point in selection.frontier if point.lever}
        for label, writes in changes.items():
            option = selection.chosen.get(label)
            if option is None:
                why = selection.skipped.get(label, selection.stopped if selection.stopped else "not needed")
                for name in _candidates_of(writes):
                    self._keep(name, decisions, f"not taken: {why}", label)
                continue
            point = value_of.get(label)
            per_ms = "free" if point is None or math.isinf(point.bytes_per_ms) else (
                f"{point.bytes_per_ms / 2**20:.2f} MiB per ms" if not math.isnan(point.bytes_per_ms) else "included")
            why = (f"taken, cheapest bytes first: {option.value} frees {option.bytes_saved / 2**20:.2f} MiB for"
                   f" {option.extra_ms:.3f} ms ({per_ms})")
            for name, values in writes[option.value].values.items():
                self._take(name, values, option, len(writes[option.value].values), decisions, saved, parameters, why)

    def _take(self, name: str, values: dict[Dimension, str], option: LeverOption, members: int,
              decisions: dict[str, OperatorDecision], saved: SavedStageResult, parameters: ParameterStageResult,
              why: str) -> None:
        decision = decisions[name]
        share = option.bytes_saved / max(members, 1)
        if Dimension.SAVED in values and decision.saved is not None:
            precision = SavedPrecision(values[Dimension.SAVED])
            measured = decision.saved.reason
            decision.saved.decision, decision.saved.reason = precision, f"{why}; measured: {measured}"
            decision.saved.gain_bytes, decision.saved.benefit = int(share), share
            saved.choices[name] = precision
            saved.benefits[Candidate.saved(name)] = share
        if decision.parameters is not None and (Dimension.STATE in values or Dimension.MASTER in values):
            params = decision.parameters
            params.state = StatePrecision(values.get(Dimension.STATE, StatePrecision.FP32.value))
            params.master = MasterPrecision(values.get(Dimension.MASTER, MasterPrecision.FP32.value))
            params.reason, params.gain_bytes = f"{why}; measured: {params.reason}", int(option.bytes_saved)
            parameters.gains[name] = int(option.bytes_saved)
            if params.state.managed:
                parameters.state_choices[name] = params.state
                parameters.benefits[Candidate.state(name)] = option.bytes_saved
            if params.master.managed:
                parameters.master_choices[name] = params.master
                parameters.benefits[Candidate.master(name)] = option.bytes_saved

    @staticmethod
    def _keep(name: str, decisions: dict[str, OperatorDecision], why: str, label: str) -> None:
        """``name`` keeps what it had in the dimension of the lever ``label`` (unless forced), with ``why``."""
        decision = decisions[name]
        if label.startswith("saved:"):
            entry = decision.saved
            if entry is not None and not entry.forced:
                entry.keep_as_computed(f"saves as computed: {why}; measured: {entry.reason}")
        elif decision.parameters is not None and not decision.parameters.forced:
            params = decision.parameters
            params.keep_fp32(f"optimizer's own state, fp32 master: {why}; measured: {params.reason}")

    # ------------------------------------------------------------------------------------------------ checking
    def _check(self, base: PrecisionPlan, spending: MemorySpending, changes: dict[str, dict[str, LeverChange]],
               decisions: dict[str, OperatorDecision], saved: SavedStageResult, parameters: ParameterStageResult,
               update_ms: float) -> None:
        """Time the chosen plan whole beside the candidate plan; give back the levers past the bound if it is
        slower than forecast."""
        ctx = self.ctx
        config = ctx.config
        chosen = _with_choices(base, saved, parameters)
        configs: dict[ComparedPlan, Callable[[], Any]] = {CANDIDATES: ctx.measured(base),
                                                          PARAMETERS: ctx.measured(chosen)}
        timer = StepTimer(ctx.clock, config.measurement.profile_steps, config.measurement.profile_warmup)
        timer.on_round = ctx.show_rounds(ctx.first_rounds, "memory levers, whole steps")
        measured = timer.time(configs, ctx.step)
        ctx.plugin.try_plan(base)  # the masters back in fp32 before anything else runs
        forward = ctx.agree(paired_ratio(measured.ms[CANDIDATES], measured.ms[PARAMETERS]))
        updates = sum(option.extra_ms for label, option in spending.selection.chosen.items()
                      if label.startswith("state:"))
        # forward and backward as measured (the median of paired rounds), the updates as the levers measured them
        spending.measured_ms = (spending.start_ms - update_ms) * forward.ratio + update_ms + updates
        spending.measured_fast_ms = (spending.start_ms - update_ms) * forward.low + update_ms + updates
        if any(p.past_bound for p in spending.selection.frontier):
            return  # a budget taken past the bound keeps its levers: the record shows the step
        back = levers_past(spending.selection, spending.start_ms, spending.max_ms, spending.measured_ms,
                           spending.measured_fast_ms)
        if not back:
            return  # within the bound, or within the rounds' doubt of it
        spending.given_back = list(back)
        why = (f"given back: the plan timed whole ran at {spending.measured_ms:.2f} ms (at least"
               f" {spending.measured_fast_ms:.2f} ms), past the {spending.max_ms:.2f} ms allowed (forecast"
               f" {spending.forecast_ms:.2f} ms)")
        for label, fallback in back.items():
            for name in _candidates_of(changes[label]):
                if label.startswith("saved:"):
                    if name in saved.choices:
                        saved.drop(name)
                else:
                    parameters.drop(name)
                self._keep(name, decisions, why, label)
            if fallback is None:
                spending.selection.chosen.pop(label, None)
                continue
            option = _options(spending, label, fallback)[0]
            spending.selection.chosen[label] = option
            for name, values in changes[label][fallback].values.items():
                self._take(name, values, option, len(changes[label][fallback].values), decisions, saved, parameters,
                           f"{why}: back to {fallback}")


def _options(spending: MemorySpending, label: str, value: str) -> list[LeverOption]:
    """The option ``value`` of lever ``label`` as the frontier reached it."""
    levers = spending.options.get(label, [])
    return [o for o in levers if o.value == value]


def memory_levers(ctx: StageContext, base: PrecisionPlan, order: list[str], decisions: dict[str, OperatorDecision],
                  steps: dict[ComparedPlan, PlanStep], step_saved: dict[ComparedPlan, float], source: ComparedPlan,
                  amp_plan: PrecisionPlan | None = None, comparison: StepComparison | None = None,
                  ) -> tuple[SavedStageResult, ParameterStageResult, MemorySpending | None]:
    """The batch stage's memory dimensions on top of the trialled plan ``base`` (timed whole as ``source``): the
    saved stage and the parameter stage, for the objectives that weigh memory; their levers are then taken cheapest
    bytes first (:class:`CheapestBytesStage`; for ``"balanced"`` only while each makes the step better in time x
    memory).

    ``amp_plan`` (AMP's plan, the operators one autocast region lowers) is what a fractional ``memory_budget`` is
    measured against (:meth:`CheapestBytesStage.run`); ``comparison`` (the whole steps' paired rounds) tells whether
    the bound is of the pace's step or of ``source``'s (:func:`bound_step`).

    Returns:
        The saved and parameter stages' results (as taken) and the spending (``None``: an objective that weighs no
        memory).
    """
    policy = ctx.policy
    if not policy.weighs_memory:
        return SavedStageResult(), ParameterStageResult(), None
    saved = SavedStageResult()
    source_ms = on_pace_scale(steps, source)
    if (policy.saved_options or policy.recomputes) and not ctx.plugin.compiled:  # compiled: AOTAutograd decides
        # what is saved; the prices on the scale of the step the room is a share of
        saved = SavedStage(ctx).measure(base, order, decisions, step_ms=source_ms)
    with_saved = base.with_assignment(Dimension.SAVED, {n: s.value for n, s in saved.choices.items()})
    fp32_ms = steps[ComparedPlan.FP32].ms
    candidates_saved = step_saved.get(source, step_saved.get(ComparedPlan.FP32, 0.0))
    bound_ms, bound_of = ctx.agree(bound_step(comparison, steps, source, policy.pace, ctx.low))
    parameters = ParameterStage(ctx).measure(with_saved, decisions, fp32_ms, source_ms, candidates_saved, bound_ms)
    spending = CheapestBytesStage(ctx).run(base, decisions, saved, parameters, fp32_ms, source_ms, step_saved,
                                           candidates_saved, amp_plan, bound_ms, bound_of)
    return saved, parameters, spending


def bound_step(comparison: StepComparison | None, steps: dict[ComparedPlan, PlanStep], source: ComparedPlan,
               pace: Pace, low: ComputePrecision) -> tuple[float | None, str]:
    """The forward and backward (ms, on the pace's scale) the levers' slowdown bound is a multiple of, and what it
    is in words: ``source``'s own step where the paired rounds cannot tell it from the pace's (the interval of their
    ratio holds 1), else ``None`` (the pace's).

    Args:
        comparison: the whole steps' paired rounds (``None``: not kept; the pace's step).
        steps: the whole steps timed.
        source: the plan the levers build on, as it was timed whole.
        pace: the fastest fixed policy timed.
        low: the 16-bit precision searched (for the words).
    """
    pace_words = f"the pace, {pace.describe(low)}"
    if comparison is None or source == pace.plan or source not in comparison.ms or pace.plan not in comparison.ms:
        return None, pace_words
    ratio = comparison.ratio(source, pace.plan)
    if ratio.against(1.0) is not Verdict.UNDECIDED:
        return None, pace_words
    return on_pace_scale(steps, source), (f"{source.describe(low)}, whose step the rounds could not tell from the"
                                          f" pace's ({pace.describe(low)}: {ratio.describe()})")


def on_pace_scale(steps: dict[ComparedPlan, PlanStep], plan: ComparedPlan) -> float:
    """``plan``'s forward and backward (ms) on the scale the pace and its bound are: FP32's step times the median of
    ``plan``'s paired per-round ratios to FP32 (FP32's own step where ``plan`` was not timed; its fastest round
    where it has no ratio).

    The base plan was judged within the bound by those paired rounds; measured instead by its own fastest round
    against a pace scaled from FP32's, a base within the bound by its rounds came out past it in one run of three
    (231.96 against 231.45 ms allowed), leaving the levers nothing.
    """
    fp32_ms = steps[ComparedPlan.FP32].ms
    step = steps.get(plan)
    if step is None:
        return fp32_ms
    return step.ms if step.ratio is None else fp32_ms * step.ratio.ratio


def _with_choices(base: PrecisionPlan, saved: SavedStageResult, parameters: ParameterStageResult) -> PrecisionPlan:
    plan = base.with_assignment(Dimension.SAVED, {n: s.value for n, s in saved.choices.items()})
    plan = plan.with_assignment(Dimension.STATE, {n: s.value for n, s in parameters.state_choices.items()})
    return plan.with_assignment(Dimension.MASTER, {n: m.value for n, m in parameters.master_choices.items()})


def _candidates(writes: dict[str, LeverChange]) -> list[Candidate]:
    out: list[Candidate] = []
    for change in writes.values():
        for name, values in change.values.items():
            for dimension in values:
                candidate = Candidate(name, dimension)
                if candidate not in out:
                    out.append(candidate)
    return out


def _saved_lever_operators(changes: dict[str, dict[str, LeverChange]]) -> set[str]:
    return {n for label, writes in changes.items() if label.startswith("saved:") for n in _candidates_of(writes)}


def _parameter_lever_operators(changes: dict[str, dict[str, LeverChange]]) -> set[str]:
    return {n for label, writes in changes.items() if label.startswith("state:") for n in _candidates_of(writes)}


def _candidates_of(writes: dict[str, LeverChange]) -> list[str]:
    return sorted({name for change in writes.values() for name in change.values})
