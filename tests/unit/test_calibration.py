"""What the first step of each kind calibrated, kept per plan (lightning_comp.execution.calibration)."""

from __future__ import annotations

import gc

import torch
from torch import nn

from lightning_comp.execution import StepKind
from lightning_comp.execution.calibration import Calibration, Calibrations, CastBoundaries

CPU = torch.device("cpu")


def test_a_calibration_answers_per_kind_and_unions_the_fed_low_operators() -> None:
    calibration = Calibration()
    assert not calibration and not calibration.calibrated(StepKind.TRAIN)
    assert calibration.chained(StepKind.TRAIN) == frozenset() and calibration.fed_low() == frozenset()
    calibration.record(StepKind.TRAIN, CastBoundaries(frozenset({"fc"}), frozenset({"head"})))
    calibration.record(StepKind.VALIDATION, CastBoundaries(frozenset(), frozenset({"side"})))
    assert calibration and calibration.calibrated(StepKind.TRAIN) and not calibration.calibrated(StepKind.TEST)
    assert calibration.chained(StepKind.TRAIN) == {"fc"} and calibration.chained(StepKind.VALIDATION) == frozenset()
    assert calibration.fed_low() == {"head", "side"}
    calibration.clear()
    assert not calibration and not calibration.calibrated(StepKind.TRAIN)


def test_calibrations_are_kept_per_model_plan_and_device_and_forgotten_in_place() -> None:
    calibrations = Calibrations()
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    first = calibrations.of(model, ("plan", "a"), CPU)
    first.record(StepKind.TRAIN, CastBoundaries(frozenset({"x"}), frozenset()))
    assert calibrations.of(model, ("plan", "a"), CPU) is first  # a plan applied again reuses its calibration
    assert calibrations.of(model, ("plan", "b"), CPU) is not first
    assert calibrations.of(other, ("plan", "a"), CPU) is not first
    assert calibrations.of(model, ("plan", "a"), torch.device("meta")) is not first
    calibrations.forget()
    assert calibrations.of(model, ("plan", "a"), CPU) is first and not first  # the same object, emptied
    del other
    gc.collect()
    replacement = nn.Linear(2, 2)
    assert not calibrations.of(replacement, ("plan", "a"), CPU)  # a dead model's calibration never matches
