"""A convergence trial's verdict: its metric against the FP32 reference's, NaN/Inf, FP16 skipped steps."""

from __future__ import annotations

import math
from enum import Enum

from lightning_comp.search.config import Mode, SearchConfig, ToleranceMode

__all__ = ["TrialVerdict", "judge_trial", "metric_bound"]


class TrialVerdict(str, Enum):
    """Whether a trial converged like the FP32 reference."""

    PASS = "pass"
    FAIL = "fail"


def metric_bound(config: SearchConfig, reference: float) -> float:
    """The worst metric a trial may end with, given the reference trial's."""
    slack = config.tolerance * (abs(reference) if config.tolerance_mode is ToleranceMode.RELATIVE else 1.0)
    return reference + slack if config.mode is Mode.MIN else reference - slack


def judge_trial(config: SearchConfig, metric: float | None, *, nonfinite_loss: bool, skipped_steps: int,
                steps: int, reference: float | None) -> tuple[TrialVerdict, str]:
    """The verdict and its reason for a closed trial.

    Args:
        config: the search's settings (tolerance, mode, the skipped steps an FP16 trial may have).
        metric: the monitored metric it ended with.
        nonfinite_loss: whether a training loss of it was NaN/Inf.
        skipped_steps: optimizer steps its FP16 loss scaler skipped.
        steps: optimizer steps it took.
        reference: the FP32 reference trial's metric; ``None`` for the reference itself.
    """
    value = float("nan") if metric is None else metric
    if nonfinite_loss or not math.isfinite(value):
        return TrialVerdict.FAIL, "NaN/Inf loss or metric"
    skipped = skipped_steps / max(steps, 1)
    if skipped > config.measurement.max_skipped_fraction:
        return TrialVerdict.FAIL, f"fp16 loss scaler skipped {skipped:.0%} of steps"
    if reference is None:
        return TrialVerdict.PASS, "reference"
    bound = metric_bound(config, reference)
    minimise = config.mode is Mode.MIN
    ok = value <= bound if minimise else value >= bound
    relation = "<=" if minimise else ">="
    if ok:
        return TrialVerdict.PASS, f"{value:.6g} {relation} {bound:.6g}"
    return TrialVerdict.FAIL, f"{value:.6g} not {relation} {bound:.6g} (reference {reference:.6g})"
