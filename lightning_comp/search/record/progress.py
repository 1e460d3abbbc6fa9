"""Progress of the search's long phases, shown the way Lightning's progress bar shows training.

- Batch stage: a transient bar under the training bar, in the validation bar's slot (free during training), counting
  measured rounds: ``CoMP batch stage (46 operators): fp32/bf16 rounds 3/8``; more rounds extend its total.
- Trials: the training bar's description names the trial: ``Epoch 2 | CoMP trial 3 of at most 13 (group of 2)``.

Shown with :class:`~lightning.pytorch.callbacks.TQDMProgressBar` (Lightning's default), silent when the progress
bar is disabled or is another kind (e.g. ``RichProgressBar``), and on ranks other than 0.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

__all__ = ["SearchProgress"]


class SearchProgress:
    """Updates Lightning's TQDM progress bar during the search; does nothing where no such bar is shown.

    Args:
        trainer: the Trainer whose progress bar is used.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        bar = trainer.progress_bar_callback
        shown = isinstance(bar, TQDMProgressBar) and bar.is_enabled and trainer.is_global_zero
        self._bar: TQDMProgressBar | None = bar if shown and isinstance(bar, TQDMProgressBar) else None
        self._stage: Tqdm | None = None

    @property
    def shown(self) -> bool:
        """Whether anything is displayed."""
        return self._bar is not None

    # ------------------------------------------------------------------------------------------------ batch stage
    def start_stage(self, operators: int, total: int) -> None:
        """Open the batch stage's bar: ``total`` rounds expected so far."""
        if self._bar is None:
            return
        self.close_stage()
        self._stage = Tqdm(desc=f"CoMP batch stage ({operators} operators)", total=total, leave=False,
                           position=2 * self._bar.process_position + 1, dynamic_ncols=True, file=sys.stdout,
                           smoothing=0, mininterval=0, miniters=1, bar_format=self._bar.BAR_FORMAT)

    def round_done(self, what: str) -> None:
        """One round of ``what`` (e.g. ``"per operator, fp32/bf16"``) measured."""
        if self._stage is not None:
            self._stage.set_postfix_str(what, refresh=False)
            self._stage.update(1)

    def extend_stage(self, rounds: int) -> None:
        """``rounds`` more rounds will be measured than announced."""
        if self._stage is not None and rounds:
            self._stage.total = (self._stage.total or 0) + rounds
            self._stage.refresh()

    def close_stage(self) -> None:
        """Close the batch stage's bar."""
        if self._stage is not None:
            self._stage.close()
            self._stage = None

    # ----------------------------------------------------------------------------------------------------- trials
    def trial(self, trainer: pl.Trainer, number: int, at_most: int, label: str) -> None:
        """Name the running trial in the training bar's description (from its first batch on)."""
        bar = self._bar
        if bar is None:
            return
        try:
            train: Any = bar.train_progress_bar
        except TypeError:  # not created yet (no training epoch shown)
            return
        suffix = f" | CoMP trial {number} of at most {at_most}" + (f" ({label})" if label else "")
        train.set_description(f"Epoch {trainer.current_epoch}{suffix}", refresh=False)
