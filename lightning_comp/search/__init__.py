"""The convergence-aware two-stage search for a model's precision plan.

:class:`CoMPSearch` is the Lightning callback and :class:`SearchConfig` its settings. Its parts (measurement,
decisions, state, record, rewind, stages) form layers of their own, each importing only those below it: the order is
in ``docs/architecture.md`` and ``tests/unit/test_layers.py`` checks it. Each module's docstring says what it holds.
"""

from lightning_comp.search.callback import CoMPSearch
from lightning_comp.search.config import (
    LowPrecision,
    MeasurementConfig,
    Mode,
    Objective,
    SearchConfig,
    Timing,
    ToleranceMode,
)
from lightning_comp.search.state import Phase, SearchState, TrialRecord

__all__ = ["CoMPSearch", "LowPrecision", "MeasurementConfig", "Mode", "Objective", "Phase", "SearchConfig",
           "SearchState", "Timing", "ToleranceMode", "TrialRecord"]
