"""The batch stage's forecast of the trialled plan's step, checked against the steps training then measured.

The batch stage times forward and backward of one batch; a training step also runs the optimizer, Lightning's loop
and the data loader. That part is the same for every compute plan, so it is taken from training itself: the FP32
reference trial's median step minus the batch stage's FP32 step (*outside*, in ms). The forecast of the trialled
plan's training step is then ``ratio * fp32 + outside`` and is set beside the first candidate trial's median step
(the trial of every candidate: the trialled plan). A gap beyond the rounds' noise means the batch stage measured
another step than training runs (hooks, casts, weight re-casts, calibration): a defect, not a figure.

The same correction gives the forecast against one global autocast region (``bf16-mixed``) where it was timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.decisions.batch_result import BatchStageResult
from lightning_comp.search.decisions.whole_step import ComparedPlan
from lightning_comp.search.state import TrialRecord

__all__ = ["forecast_check"]


def forecast_check(batch: BatchStageResult | None, trials: Sequence[TrialRecord]) -> dict[str, Any] | None:
    """The forecast of the trialled plan's training step against training's (``None``: nothing to check yet).

    Returns:
        ``fp32_forecast_ms`` and ``plan_forecast_ms`` (the batch stage's steps, real time), ``outside_ms``,
        ``forecast_ratio`` and ``training_ratio`` (to the FP32 reference's training step), ``gap`` (training over
        forecast, minus 1), ``autocast_forecast_speedup`` (the autocast reference's forecast step over the plan's,
        where timed) and ``comparable`` with ``note`` (why not, e.g. a trial that also lowers saved tensors).
    """
    if batch is None or batch.trialled is None or ComparedPlan.FP32 not in batch.steps:
        return None
    reference = next((t for t in trials if t.group is None), None)
    first = next((t for t in trials if t.group is not None), None)
    if reference is None or first is None or reference.median_step_ms is None or first.median_step_ms is None:
        return None
    fp32_ms = batch.steps[ComparedPlan.FP32].wall_ms
    plan_ms = batch.trialled.ratio_to_fp32 * fp32_ms
    reference_ms, trained_ms = float(reference.median_step_ms), float(first.median_step_ms)
    outside = reference_ms - fp32_ms
    forecast_ratio = (plan_ms + outside) / reference_ms
    training_ratio = trained_ms / reference_ms
    out: dict[str, Any] = {
        "fp32_forecast_ms": round(fp32_ms, 4), "plan_forecast_ms": round(plan_ms, 4), "outside_ms": round(outside, 4),
        "reference_training_ms": round(reference_ms, 4), "plan_training_ms": round(trained_ms, 4),
        "forecast_ratio": round(forecast_ratio, 4), "training_ratio": round(training_ratio, 4),
        "gap": round(training_ratio / forecast_ratio - 1, 4), "trial": first.label,
    }
    autocast = batch.steps.get(ComparedPlan.AUTOCAST)
    if autocast is not None:
        out["autocast_forecast_speedup"] = round((autocast.wall_ms + outside) / (plan_ms + outside), 4)
    dimensions = {candidate.dimension for candidate in first.group or ()}
    out["comparable"] = dimensions <= {Dimension.COMPUTE} and first.group == tuple(
        c for c in batch.candidates if c.dimension is Dimension.COMPUTE)
    if not out["comparable"]:
        out["note"] = ("the first trial is not the trialled compute plan alone (it also lowers "
                       f"{sorted(d.value for d in dimensions - {Dimension.COMPUTE})} or a part of it)")
    return out
