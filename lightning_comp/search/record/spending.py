"""The record's ``memory_spending``: the memory levers taken cheapest bytes first, and their frontier.

The frontier is the step's bytes against its time after each lever taken
(:mod:`lightning_comp.search.decisions.cheapest_bytes`); :mod:`lightning_comp.search.record.figures` draws it.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_comp.search.decisions.batch_result import BatchStageResult
from lightning_comp.search.record.batch import peak_record

__all__ = ["spending_record"]

MiB = 2**20


def spending_record(batch: BatchStageResult | None) -> dict[str, Any] | None:
    """The record form of the memory objective's spending (``None``: it did not run)."""
    spending = None if batch is None else batch.memory_spending
    if spending is None:
        return None
    selection = spending.selection
    return {
        "start_mib": _mib(spending.start_bytes),
        "start_ms": round(spending.start_ms, 4),
        "max_ms": _finite(spending.max_ms),
        "bound_of": spending.bound_of,
        "target_mib": None if spending.target_bytes is None else _mib(spending.target_bytes),
        "amp_step_mib": None if spending.amp_step_bytes is None else _mib(spending.amp_step_bytes),
        "taken": {label: {"value": option.value, "freed_mib": _mib(option.bytes_saved),
                          "extra_ms": round(option.extra_ms, 4)} for label, option in selection.chosen.items()},
        "skipped": dict(selection.skipped),
        "stopped": selection.stopped,
        "met": selection.met,
        "final_mib": _mib(spending.final_bytes),
        "final_vs_amp": (None if not spending.amp_step_bytes
                         else round(spending.final_bytes / spending.amp_step_bytes, 4)),
        "forecast_ms": round(spending.forecast_ms, 4),
        "measured_ms": None if spending.measured_ms is None else round(spending.measured_ms, 4),
        "measured_fast_ms": None if spending.measured_fast_ms is None else round(spending.measured_fast_ms, 4),
        "given_back": list(spending.given_back),
        "other_base": None if spending.other_base is None else {
            "base": spending.other_base.base, "start_mib": _mib(spending.other_base.start_bytes),
            "final_mib": _mib(spending.other_base.final_bytes), "end_ms": round(spending.other_base.end_ms, 4),
            "max_ms": _finite(spending.other_base.max_ms), "met": spending.other_base.met,
            "why": spending.other_base.why},
        "process_peaks": {label: peak_record(peak) for label, peak in spending.process_peaks.items()},
        "process_target_mib": (None if spending.process_target_bytes is None
                               else _mib(spending.process_target_bytes)),
        "process_met": spending.process_met,
        "process_limit_mib": (None if spending.process_limit_bytes is None
                              else _mib(spending.process_limit_bytes)),
        "process_reference": spending.process_reference,
        "update_costs": {variant: {"per_tensor_ms": round(cost.per_tensor_ms, 5),
                                   "per_million_elements_ms": round(cost.per_element_ms * 1e6, 4),
                                   "operators": cost.samples} for variant, cost in spending.update_costs.items()},
        "codec_costs": {codec: {"per_operator_ms": round(cost.per_operator_ms, 5),
                                "per_mib_ms": round(cost.per_byte_ms * MiB, 4),
                                "operators": cost.samples} for codec, cost in spending.codec_costs.items()},
        "frontier": [{"lever": p.lever or None, "value": p.value or None, "step_mib": _mib(p.step_bytes),
                      "step_ms": round(p.step_ms, 4), "mib_per_ms": _finite(p.bytes_per_ms / MiB),
                      "forced": math.isnan(p.bytes_per_ms), "past_bound": p.past_bound}
                     for p in selection.frontier],
    }


def _mib(nbytes: float) -> float:
    return round(nbytes / MiB, 3)


def _finite(value: float) -> float | None:
    """``value`` rounded, ``None`` where it is infinite or undefined (JSON has neither)."""
    return round(value, 4) if math.isfinite(value) else None
