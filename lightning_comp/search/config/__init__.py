"""``CoMPSearch``'s settings: :class:`SearchConfig` (what the user wants), its nested :class:`MeasurementConfig`
(how the search measures) with named presets, and the enums of their choices (:mod:`.choices`)."""

from lightning_comp.search.config.choices import (
    AUTO_VALUES,
    DimensionChoice,
    Fp8Choice,
    LowPrecision,
    Mode,
    Objective,
    Timing,
    ToleranceMode,
)
from lightning_comp.search.config.measurement import MEASUREMENT_PRESETS, MeasurementConfig
from lightning_comp.search.config.settings import SearchConfig

__all__ = ["AUTO_VALUES", "MEASUREMENT_PRESETS", "DimensionChoice", "Fp8Choice", "LowPrecision", "MeasurementConfig",
           "Mode", "Objective", "SearchConfig", "Timing", "ToleranceMode"]
