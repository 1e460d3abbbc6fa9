"""The decision record's form of the batch stage's result: per operator, per whole step, per stage check.

The batch stage's result is typed (:class:`~lightning_comp.search.decisions.batch_result.BatchStageResult`); this
module is the one place that turns it into the record's plain JSON types (the record's keys are the values of the
compared plans' enums).
"""

from __future__ import annotations

from typing import Any

from lightning_comp.search.decisions.batch_result import BatchStageResult, Fp8StageResult, ParameterStageResult
from lightning_comp.search.decisions.fp8 import Fp8Decision
from lightning_comp.search.decisions.operators import OperatorDecision
from lightning_comp.search.decisions.parameters import ParameterDecision
from lightning_comp.search.decisions.refinement import GroupFlip
from lightning_comp.search.decisions.saved import SavedDecision
from lightning_comp.search.decisions.whole_step import TrialledPlan
from lightning_comp.search.measurement.process_memory import StepPeak

__all__ = ["batch_record", "fp8_record", "operator_record", "parameter_record", "peak_record", "saved_record"]


def batch_record(batch: BatchStageResult | None) -> dict[str, Any]:
    """The decision record's form of the batch stage's result (empty measurements before it ran, or without it)."""
    if batch is None:
        return {"operators": {}, "groups": {}, "timing": None, "step_ms": {}, "step_wall_ms": {}, "step_ratios": {},
                "step_saved_bytes": {}, "step_process_peaks": {}, "trialled_plan": None, "refinements": [],
                "parameter_step": {}, "fp8_stage": {}, "memory": {}}
    steps = batch.steps
    return {
        "operators": {name: operator_record(decision) for name, decision in batch.decisions.items()},
        "groups": {group.pattern: {"members": list(group.members),
                                   "selector": group.pattern if group.exact_glob else None}
                   for group in batch.groups},
        "timing": batch.timing,
        "step_ms": {plan.value: step.ms for plan, step in steps.items()},
        "step_wall_ms": {plan.value: step.wall_ms for plan, step in steps.items()},
        "step_ratios": {plan.value: step.ratio.to_dict() for plan, step in steps.items() if step.ratio is not None},
        "step_saved_bytes": {plan.value: step.saved_bytes for plan, step in steps.items()
                             if step.saved_bytes is not None},
        "step_process_peaks": {plan.value: peak_record(step.process_peak) for plan, step in steps.items()
                               if step.process_peak is not None},
        "trialled_plan": None if batch.trialled is None else _trialled(batch.trialled),
        "refinements": [_flip(flip) for flip in batch.flips],
        "parameter_step": _parameter_stage(batch.parameters),
        "fp8_stage": _fp8_stage(batch.fp8),
        "memory": {plan.value: {"saved_bytes": memory.saved_bytes, "peak_bytes": memory.peak_bytes,
                                "reserved_bytes": memory.reserved_bytes, "live_bytes": memory.live_bytes,
                                "os_bytes": memory.os_bytes, "how": memory.how}
                   for plan, memory in batch.memory.items()},
    }


def peak_record(peak: StepPeak) -> dict[str, Any]:
    """The record form of the peak the process needed for a step: MiB (``None`` where not measured here), what the
    allocator adds over the live peak, and how each figure was measured."""
    def mib(nbytes: int | None) -> float | None:
        return None if nbytes is None else round(nbytes / 2**20, 3)

    return {"live_mib": mib(peak.live_bytes), "os_mib": mib(peak.os_bytes), "reserved_mib": mib(peak.reserved_bytes),
            "allocated_mib": mib(peak.allocated_bytes), "allocator_adds_mib": mib(peak.allocator_bytes),
            "tensor_mib": mib(peak.tensor_bytes), "how": peak.how}


def _trialled(trialled: TrialledPlan) -> dict[str, Any]:
    return {"from": trialled.source.value, "refined": trialled.refined, "step_ms": trialled.step_ms,
            "ratio_to_fp32": round(trialled.ratio_to_fp32, 4), "fastest_measured": trialled.fastest.value,
            "fastest_ms": trialled.fastest_ms}


def _flip(flip: GroupFlip) -> dict[str, Any]:
    return {"group": flip.group, "members": list(flip.members), "to": "low" if flip.to_low else "fp32",
            "expected_gain_ms": round(flip.expected_gain_ms, 5), "ratio": flip.ratio.to_dict(), "kept": flip.kept,
            "step_ms": flip.step_ms}


def _parameter_stage(result: ParameterStageResult) -> dict[str, Any]:
    out: dict[str, Any] = {"state": {n: s.value for n, s in result.state_choices.items()},
                           "master": {n: m.value for n, m in result.master_choices.items()}}
    if result.skipped is not None:
        out["skipped"] = result.skipped
    return out


def _fp8_stage(result: Fp8StageResult) -> dict[str, Any]:
    out: dict[str, Any] = {"precision": None if result.precision is None else result.precision.value,
                           "candidates": {n: p.value for n, p in result.choices.items()}}
    if result.skipped is not None:
        out["skipped"] = result.skipped
    return out


def operator_record(decision: OperatorDecision) -> dict[str, Any]:
    """One operator's measurements and decision, as the record holds them."""
    out: dict[str, Any] = {"type": decision.type, "kind": decision.kind.value, "params": decision.params}
    if decision.fp32 is not None:
        out["fp32"] = decision.fp32.to_dict()
    if decision.low is not None:
        out["low"] = decision.low.to_dict()
    if decision.time is not None:
        out.update(time_ratio=decision.time.ratio, time_spread=[decision.time.low, decision.time.high],
                   rounds=decision.time.rounds)
    if decision.in_plan is not None:
        out["in_plan"] = decision.in_plan.to_dict()
    if decision.in_plan_time is not None:
        out.update(in_plan_time_ratio=decision.in_plan_time.ratio,
                   in_plan_time_spread=[decision.in_plan_time.low, decision.in_plan_time.high])
    out.update(gain_ms=float(decision.gain_ms), gain_bytes=int(decision.gain_bytes), benefit=float(decision.benefit),
               decision=decision.decision.value, reason=decision.reason)
    if decision.memory_ratio is not None:
        out["memory_ratio"] = decision.memory_ratio
    if decision.settled is not None:
        out["settled"] = decision.settled
    if decision.own_decision is not None:
        out["own_decision"] = decision.own_decision.value
    if decision.group_size > 1:
        out.update(group=decision.group, group_size=decision.group_size)
    if decision.excluded:
        out["excluded"] = True
    if decision.forced:
        out["forced"] = True
    if decision.saved is not None:
        out["saved"] = saved_record(decision.saved)
    if decision.parameters is not None:
        out["parameters"] = parameter_record(decision.parameters)
    if decision.fp8 is not None:
        out["fp8"] = fp8_record(decision.fp8)
    return out


def fp8_record(decision: Fp8Decision) -> dict[str, Any]:
    """One operator's fp8 decision, as the record holds it."""
    out: dict[str, Any] = {"precision": decision.precision.value, "lowers": decision.lowers, "reason": decision.reason,
                           "low_ms": decision.low_ms, "fp8_ms": decision.fp8_ms}
    if decision.time is not None:
        out["time_ratio"] = decision.time.to_dict()
    if decision.group:
        out["group"] = list(decision.group)
    if decision.forced:
        out["forced"] = True
    return out


def saved_record(decision: SavedDecision) -> dict[str, Any]:
    """One operator's saved-precision decision, as the record holds it."""
    out: dict[str, Any] = {"bytes": dict(decision.bytes), "time_ratio": dict(decision.time_ratios),
                           "decision": decision.decision.value, "reason": decision.reason,
                           "gain_bytes": int(decision.gain_bytes), "benefit": float(decision.benefit)}
    if decision.group is not None:
        out["group"] = list(decision.group)
    if decision.held_by:
        out["held_by"] = list(decision.held_by)
    if decision.forced:
        out["forced"] = True
    if decision.direct_ms:
        out["direct_ms"] = {value: round(ms, 4) for value, ms in decision.direct_ms.items()}
    return out


def parameter_record(decision: ParameterDecision) -> dict[str, Any]:
    """One operator's optimizer-state and master-weight decision, as the record holds it."""
    return {"state": decision.state.value, "master": decision.master.value, "reason": decision.reason,
            "params": decision.params, "bytes": {k.value: v for k, v in decision.bytes.items()},
            "update_ms": {k.value: v for k, v in decision.update_ms.items()},
            "time_ratio": {k.value: v for k, v in decision.time_ratios.items()}, "gain_bytes": int(decision.gain_bytes),
            "state_benefit": float(decision.state_benefit), "master_benefit": float(decision.master_benefit),
            **({"forced": True} if decision.forced else {})}
