"""The convergence-aware two-stage search for a model's precision plan, one module per part.

==========================  ===========================================================================
module                      part
==========================  ===========================================================================
``callback``                ``CoMPSearch``: the Lightning hooks, delegating to the parts below
``config``                  ``SearchConfig`` and ``Objective``: validated settings
``checks``                  set-up checks (plugin, strategy, validation, selectors, monitor)
``batch_stage``             per-operator measurements on one batch; the candidates
``comparison``              decisions from measurements (pure functions)
``trials``                  convergence trials, verdicts, the end of the search
``loop``                    the loop budget, cut epochs, rewinds (the only part that steers ``fit_loop``)
``record``                  the decision record: written, logged, printed
``ranks``                   rank agreement under DDP
``state``                   ``SearchState`` and ``TrialRecord``: typed state, checkpoint form
==========================  ===========================================================================
"""

from lightning_comp.search.callback import CoMPSearch
from lightning_comp.search.config import Objective, SearchConfig
from lightning_comp.search.state import SearchState, TrialRecord

__all__ = ["CoMPSearch", "Objective", "SearchConfig", "SearchState", "TrialRecord"]
