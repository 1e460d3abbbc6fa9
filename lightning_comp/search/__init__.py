"""The convergence-aware two-stage search for a model's precision plan.

Packages and modules, each importing only those above it in this table:

=================  ==========================================================================================
part               what it holds
=================  ==========================================================================================
``config``         :class:`SearchConfig` and its enums (:class:`Objective`, ...): validated settings
``candidates``     :class:`~lightning_comp.search.candidates.Candidate`: what a trial lowers
``measurement/``   clocks, machine load, profilers, ratio estimates
``decisions/``     per-operator, saved-precision, whole-step and trial decisions; objective policies; group testing
``state``          :class:`SearchState` and :class:`TrialRecord`: typed state, checkpoint form
``ranks``          rank agreement under DDP
``record/``        the decision record: progress, text, loggers, JSON
``rewind/``        snapshots, paused callbacks, the loop budget
``checks``         set-up checks (plugin, strategy, validation, selectors, monitor)
``compiled``       the search on a compiled model: measured and trialled eagerly
``stages/``        the batch stage and the epoch stage
``callback``       :class:`CoMPSearch`: the Lightning hooks, delegating to the parts above
=================  ==========================================================================================
"""

from lightning_comp.search.callback import CoMPSearch
from lightning_comp.search.config import (
    LowPrecision,
    Mode,
    Objective,
    SavedPrecisions,
    SearchConfig,
    Timing,
    ToleranceMode,
)
from lightning_comp.search.state import Phase, SearchState, TrialRecord

__all__ = ["CoMPSearch", "LowPrecision", "Mode", "Objective", "Phase", "SavedPrecisions", "SearchConfig",
           "SearchState", "Timing", "ToleranceMode", "TrialRecord"]
