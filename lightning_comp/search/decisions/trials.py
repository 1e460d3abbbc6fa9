"""A convergence trial's verdict: its metric against the FP32 reference's, NaN/Inf, FP16 skipped steps."""

from __future__ import annotations

import math
from enum import Enum

from lightning_comp.search.config import Mode, SearchConfig, ToleranceMode

__all__ = ["TrialVerdict", "blind_trials", "judge_trial", "metric_bound"]


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


def blind_trials(config: SearchConfig, start: float | None, reference: float | None) -> str | None:
    """Why the trials cannot tell a plan that stops learning from the FP32 reference (``None``: they can, or it is
    not known): the monitored metric the search started from is itself within the tolerance of the reference trial's,
    so a trial whose plan learned nothing during it would pass as well as one that learned what FP32 did.

    Seen in the project's own benchmark: cnn's trials of 2 batches ended at 2.3564 against the reference's 2.3576
    (chance is 2.30), and a plan whose 8-bit moments cost 0.1-0.2 of val_loss over 120 steps passed.

    Args:
        config: the search's settings (monitor, mode, tolerance).
        start: the monitored metric when the search started (the warm-up's last validation; ``None``: none ran).
        reference: the FP32 reference trial's metric.
    """
    if start is None or reference is None or not (math.isfinite(start) and math.isfinite(reference)):
        return None
    verdict, _ = judge_trial(config, start, nonfinite_loss=False, skipped_steps=0, steps=1, reference=reference)
    if verdict is not TrialVerdict.PASS:
        return None
    return (f"the {config.monitor} the search started from ({start:.6g}) is itself within the tolerance of the FP32"
            f" reference trial's ({reference:.6g}, bound {metric_bound(config, reference):.6g}): a plan that learned"
            " nothing during its trial would pass, so the trials could not tell a plan that slows learning from one"
            " that does not; lengthen them (trial_batches, trial_epochs) or start the search later (warmup_epochs)")
