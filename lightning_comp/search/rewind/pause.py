"""Take callbacks out of a Trainer for a while, and put them back where they were.

``CoMPSearch`` uses this for ``EarlyStopping``. Each trial of the search is judged by a validation run, and most
trials are then rewound. If ``EarlyStopping`` saw these validations, it would count a rewound trial against its
patience. A trial that the search rejects for a NaN loss would stop the whole fit (``check_finite``), which would
leave the rejected trial's weights in the model. So the search pauses ``EarlyStopping`` from its first trial until
the model holds its final state.

While a callback is paused, Lightning neither calls its hooks nor writes its state into checkpoints, because both go
through ``trainer.callbacks``. The pause therefore keeps each paused callback's ``state_dict()`` for the owner's
checkpoint state, and loads it back into a fresh callback after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_comp.adapters.lightning_internals import callbacks, set_callbacks

__all__ = ["CallbackPause"]


class CallbackPause:
    """Pauses the callbacks of a Trainer that ``select`` picks.

    Pausing replaces ``trainer.callbacks`` with a new list that does not hold them. A hook loop that is running keeps
    its own list, so pausing from inside a hook is safe. Resuming puts each callback back at its old position.

    Args:
        select: which callbacks to pause, e.g. ``lambda cb: isinstance(cb, EarlyStopping)``.
    """

    def __init__(self, select: Callable[[Callback], bool]) -> None:
        self._select = select
        self._paused: list[Callback] = []
        self._order: list[Callback] = []

    @property
    def active(self) -> bool:
        """Whether some callbacks are paused now."""
        return bool(self._paused)

    @property
    def paused(self) -> list[Callback]:
        """The paused callbacks, in their old order."""
        return list(self._paused)

    def pause(self, trainer: pl.Trainer, states: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Take the selected callbacks out of ``trainer.callbacks``. Does nothing if they are paused already.

        Args:
            trainer: the Trainer whose callbacks to pause.
            states: ``state_key -> state_dict`` from :meth:`states`, saved before a resume. Each matching callback
                loads its state, because the checkpoint could not hold it while the callback was paused.
        """
        if self._paused:
            return
        current = callbacks(trainer)
        chosen = [cb for cb in current if self._select(cb)]
        if not chosen:
            return
        for callback in chosen:
            if states and callback.state_key in states:
                callback.load_state_dict(dict(states[callback.state_key]))
        self._order = current
        self._paused = chosen
        set_callbacks(trainer, [cb for cb in current if cb not in chosen])

    def resume(self, trainer: pl.Trainer) -> None:
        """Put the paused callbacks back at their old positions. Does nothing if none is paused."""
        if not self._paused:
            return
        present = callbacks(trainer)
        restored = [cb for cb in self._order if cb in self._paused or cb in present]
        restored += [cb for cb in present if cb not in restored]  # callbacks added during the pause go last
        set_callbacks(trainer, restored)
        self._paused = []
        self._order = []

    def states(self) -> dict[str, dict[str, Any]]:
        """``state_key -> state_dict()`` of the paused callbacks (empty when none is paused)."""
        return {cb.state_key: cb.state_dict() for cb in self._paused}
