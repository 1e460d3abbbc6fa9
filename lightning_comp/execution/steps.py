"""The kinds of Lightning step a forward can belong to."""

from __future__ import annotations

from enum import Enum

__all__ = ["StepKind"]


class StepKind(str, Enum):
    """The kind of Lightning step a forward belongs to; cast boundaries are calibrated per kind."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"
    PREDICT = "predict"
