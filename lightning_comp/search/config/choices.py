"""The enums of ``CoMPSearch``'s choices, and the one rule that parses a per-dimension choice.

Every choice is a :class:`~lightning_comp.common.spelled_enum.SpelledEnum`: spelled by its value in any case, and a
bad spelling is a :class:`~lightning_comp.errors.SearchConfigError` whose advice (``"use 'min' or 'max'"``) is
generated from the enum. A plan dimension the search decides besides compute (``saved``, ``state``, ``master``) is
chosen by :func:`parse_dimension_choice`: ``"auto"`` (every value :data:`AUTO_VALUES` lists, the first that pays),
``"off"`` (the dimension stays as FP32 training does it), or one value of that dimension.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_comp.common.spelled_enum import SpelledEnum, quoted
from lightning_comp.errors import CoMPError, SearchConfigError
from lightning_comp.numerics.precision import MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.plan.dimensions import Dimension, DimensionValue

__all__ = ["AUTO_VALUES", "DimensionChoice", "Fp8Choice", "LowPrecision", "Mode", "Objective", "Timing",
           "ToleranceMode", "dimension_advice", "parse_dimension_choice", "tried_values"]


class _Setting(SpelledEnum):
    """A choice of ``CoMPSearch``: a bad spelling is a :class:`SearchConfigError`."""

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return SearchConfigError


class Mode(_Setting):
    """Which way the monitored metric is better."""

    MIN = "min"  # lower is better (a loss)
    MAX = "max"  # higher is better (an accuracy)


class ToleranceMode(_Setting):
    """How ``tolerance`` is counted."""

    RELATIVE = "relative"  # a fraction of the reference trial's |metric|
    ABSOLUTE = "absolute"  # in the metric's own units


class Objective(_Setting):
    """What the batch stage optimises."""

    THROUGHPUT = "throughput"  # lower an operator when it gets faster
    MEMORY = "memory"  # lower an operator when it saves memory for backward (and is not much slower)
    BALANCED = "balanced"  # lower an operator when the geometric mean of its time and memory ratios improves
    # memory and balanced also search the saved, state and master dimensions (SearchConfig.precisions)


class Timing(_Setting):
    """What the batch stage's clock counts on a CPU (on CUDA it always uses CUDA events)."""

    AUTO = "auto"  # wall time while the machine is quiet; this process's CPU time once other processes compete
    WALL = "wall"  # real time with the user's intra-op threads
    CPU = "cpu"  # CPU time of the measuring thread, with one intra-op thread


class LowPrecision(_Setting):
    """The 16-bit precision the search tries for the compute dimension."""

    AUTO = "auto"  # what the device runs natively: BF16, else FP16, else no search
    BF16 = "bf16"
    FP16 = "fp16"
    OFF = "off"  # no compute lowering: every operator computes in FP32; only the memory dimensions are searched


class Fp8Choice(_Setting):
    """Whether the search tries fp8 compute on top of its 16-bit one, and with which recipe."""

    AUTO = "auto"  # fp8 (per-tensor scales) where the device has native fp8 matmuls (CUDA sm89+), else none
    OFF = "off"  # no fp8
    FP8 = "fp8"  # per-tensor scales (torchao's tensorwise), measured even where fp8 is emulated
    FP8_ROWWISE = "fp8-rowwise"  # per-row scales (torchao's rowwise), measured even where fp8 is emulated

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        return {"tensorwise": "fp8", "rowwise": "fp8-rowwise", "fp8_rowwise": "fp8-rowwise"}


class DimensionChoice(_Setting):
    """The two choices every searched dimension has besides naming one of its values."""

    AUTO = "auto"  # every value of AUTO_VALUES, the first that pays
    OFF = "off"  # nothing tried: as FP32 training does it


#: Per dimension the search decides besides compute: the values ``"auto"`` tries, smallest first. ``recompute``
#: (nothing stored; only for cheap operators, judged as a group) comes after the stored ones.
AUTO_VALUES: dict[Dimension, tuple[DimensionValue, ...]] = {
    Dimension.SAVED: (SavedPrecision.FP8, SavedPrecision.BF16, SavedPrecision.RECOMPUTE),
    Dimension.STATE: (StatePrecision.INT8, StatePrecision.BF16),
    Dimension.MASTER: (MasterPrecision.BF16,),
}


def dimension_advice(dimension: Dimension) -> str:
    """What a choice of ``dimension`` may be, for messages: ``"use 'auto', 'off', '8bit' or 'bf16'"``."""
    return "use " + quoted([DimensionChoice.AUTO, DimensionChoice.OFF, *AUTO_VALUES[dimension]])


def parse_dimension_choice(dimension: Dimension, value: object) -> str:
    """The choice ``value`` spells for ``dimension``: ``DimensionChoice.AUTO``, ``.OFF`` or a value of it.

    Raises:
        SearchConfigError: naming ``value`` and the valid choices.
    """
    if dimension not in AUTO_VALUES:
        raise SearchConfigError(f"CoMPSearch(precisions={{{dimension.value!r}: ...}}) is invalid: the search decides"
                                f" the dimensions {quoted(d.value for d in AUTO_VALUES)} there"
                                " (compute: low_precision).")
    try:
        return DimensionChoice.parse(value)
    except SearchConfigError:
        pass
    try:
        parsed = dimension.parse_value(value)
    except CoMPError:
        parsed = None
    if parsed not in AUTO_VALUES[dimension]:
        raise SearchConfigError(f"CoMPSearch(precisions={{{dimension.value!r}: {value!r}}}) is invalid:"
                                f" {dimension_advice(dimension)}.")
    return parsed  # type: ignore[return-value]


def tried_values(dimension: Dimension, choice: str) -> tuple[DimensionValue, ...]:
    """The values of ``dimension`` the search may try under ``choice`` (a parsed one), smallest first."""
    if choice == DimensionChoice.AUTO:
        return AUTO_VALUES[dimension]
    if choice == DimensionChoice.OFF:
        return ()
    return (dimension.parse_value(choice),)
