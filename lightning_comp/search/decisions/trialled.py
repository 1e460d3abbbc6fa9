"""The plan the batch stage hands the epoch stage: what it lowers, its forecast, its candidates in order, and what
each operator's decision says of it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from torch import nn

from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.batch_result import ParameterStageResult, SavedStageResult
from lightning_comp.search.decisions.groups import OperatorGroup
from lightning_comp.search.decisions.operators import Choice, OperatorDecision
from lightning_comp.search.decisions.refinement import GroupFlip
from lightning_comp.search.decisions.whole_step import ComparedPlan, PlanStep, StepComparison, TrialledPlan

__all__ = ["accept_refinement", "in_execution_order", "lowered_by", "members_of", "settle_decisions", "trialled_plan"]


def lowered_by(plan: PrecisionPlan, modules: dict[str, nn.Module]) -> set[str]:
    """The operators ``plan`` computes in low precision."""
    return {name for name, module in modules.items()
            if plan.of(Dimension.COMPUTE, name, type(module)) is not ComputePrecision.FP32}


def accept_refinement(lowered: set[str], refined: set[str], flips: list[GroupFlip], source_ratio: float,
                      margin: float) -> tuple[set[str], list[GroupFlip]]:
    """What the trialled plan lowers, and the flips as kept in it: ``refined`` and ``flips`` when the refined plan
    beats FP32 by ``margin`` (its start's median ratio to FP32 times the kept flips'), else ``lowered`` with no flip
    kept (a refinement from FP32 that gains less than the margin is not worth a trial)."""
    ratio = source_ratio * math.prod(f.ratio.ratio for f in flips if f.kept)
    if refined == lowered or ratio <= 1 - margin:
        return refined, flips
    return lowered, [dataclasses.replace(f, kept=False) for f in flips]


def trialled_plan(comparison: StepComparison, steps: dict[ComparedPlan, PlanStep], source: ComparedPlan,
                  flips: list[GroupFlip]) -> TrialledPlan:
    """The trialled plan's forecast: its source's step, or the last kept flip's."""
    kept = [f for f in flips if f.kept]
    fastest = comparison.fastest()
    ratio = comparison.median_to_fp32(source) * math.prod(f.ratio.ratio for f in kept)
    step_ms = kept[-1].step_ms if kept else steps[source].ms
    return TrialledPlan(source=source, refined=bool(kept), step_ms=step_ms, ratio_to_fp32=ratio,
                        fastest=fastest, fastest_ms=steps[fastest].ms, pace=comparison.pace())


def members_of(candidate: Candidate, groups: list[OperatorGroup]) -> tuple[str, ...]:
    """The operators a compute candidate lowers (its group's members where it names a group's glob)."""
    for group in groups:
        if group.exact_glob and group.pattern == candidate.operator:
            return group.members
    return (candidate.operator,)


def in_execution_order(order: list[str], compute: list[Candidate], groups: list[OperatorGroup],
                        saved: SavedStageResult, parameters: ParameterStageResult,
                        fp8: Sequence[Candidate] = ()) -> list[Candidate]:
    """Every candidate in execution order, each operator's together: a compute candidate at its first operator (its
    fp8 candidate after it), then that operator's saved, state and master candidates."""
    at: dict[str, list[Candidate]] = {}
    for candidate in (*compute, *fp8):
        at.setdefault(members_of(candidate, groups)[0], []).append(candidate)
    out: list[Candidate] = []
    for name in order:
        out += at.pop(name, [])
        if name in saved.choices:
            out.append(Candidate.saved(name))
        if name in parameters.state_choices:
            out.append(Candidate.state(name))
        if name in parameters.master_choices:
            out.append(Candidate.master(name))
    return out + [c for cs in at.values() for c in cs]  # forced ones that did not run


def settle_decisions(decisions: Mapping[str, OperatorDecision], order: Sequence[str], lowered: set[str],
                     flips: Sequence[GroupFlip], low: ComputePrecision) -> None:
    """Make every operator's decision say what the trialled plan (lowering exactly ``lowered``) does with it: the
    operators it lowers are candidates (fills between lowered operators, and groups a refinement flip lowered, with
    that reason), the others FP32 (a fill with a neighbour left FP32, a group a flip took back)."""
    flipped = {member: flip for flip in flips if flip.kept for member in flip.members}
    for name in order:
        decision = decisions[name]
        flip = flipped.get(name)
        if name in lowered and decision.decision is not Choice.CANDIDATE:
            why = (f"lowered by the refinement: {flip.describe(low.value)}" if flip is not None
                   else f"a fill between lowered operators ({decision.reason})")
            decision.decision, decision.reason = Choice.CANDIDATE, why
        elif name not in lowered and decision.decision in (Choice.CANDIDATE, Choice.FILL):
            if flip is not None:
                decision.keep_fp32(f"taken back to fp32 by the refinement: {flip.describe(low.value)}")
            elif decision.decision is Choice.FILL:
                decision.keep_fp32(f"a fill, left fp32: a neighbour stays fp32 ({decision.reason})")
            else:
                decision.keep_fp32(decision.reason)
