"""The search's hold on Lightning's fit loop: the loop budget, cut epochs, validation inside an epoch, rewinds.

This is the only part of the search that changes the Trainer's loop, always through
:mod:`lightning_comp.adapters.lightning_internals`. Rejected trials are given back: ``max_epochs`` (and ``max_steps``)
grow by what they trained, so the user's training is not shortened.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.rewind.snapshot import TrainingSnapshot

__all__ = ["LoopBudget", "no_epoch_follows", "rewind"]


class LoopBudget:
    """The user's ``max_epochs``/``max_steps``, and the extensions the search adds to them."""

    def __init__(self) -> None:
        self.user_max_epochs: int | None = None
        self.user_max_steps: int | None = None
        self._val_check_batch: int | float | None = None  # the Trainer's, while a trial of batches changes it
        self._changed_val_check = False
        self._epoch_length: int | float | None = None  # the Trainer's, while a rejected trial of batches cuts one
        self._extended: weakref.ref[pl.Trainer] | None = None  # the Trainer whose limits this budget set last
        self._set_epochs: int | None = None
        self._set_steps: int | None = None

    def remember(self, trainer: pl.Trainer) -> None:
        """Read the user's limits at the start of a fit.

        A second ``fit`` on a Trainer this budget already extended finds the extended limits there: they are read
        back as the user's own (unless the user changed them since), so the extension is not counted twice.
        """
        max_epochs: int | None = trainer.fit_loop.max_epochs
        max_steps: int | None = trainer.fit_loop.max_steps
        if self._extended is not None and self._extended() is trainer:
            if max_epochs == self._set_epochs:
                max_epochs = self.user_max_epochs
            if max_steps == self._set_steps:
                max_steps = self.user_max_steps
        self.user_max_epochs, self.user_max_steps = max_epochs, max_steps

    def extend(self, trainer: pl.Trainer, epochs: int, steps: int) -> None:
        """Set the limits to the user's plus ``epochs`` and ``steps`` (unlimited ones stay unlimited)."""
        self._extended = weakref.ref(trainer)
        if self.user_max_epochs is not None and self.user_max_epochs >= 0:
            self._set_epochs = self.user_max_epochs + int(epochs)
            lightning.set_max_epochs(trainer, self._set_epochs)
        if self.user_max_steps is not None and self.user_max_steps > 0:
            self._set_steps = self.user_max_steps + int(steps)
            lightning.set_max_steps(trainer, self._set_steps)

    def validate_after(self, trainer: pl.Trainer, batches: int) -> None:
        """Validate after ``batches`` batches of this epoch (a trial of batches ends there)."""
        if lightning.val_check_batch(trainer) != batches:
            if not self._changed_val_check:
                self._val_check_batch = lightning.val_check_batch(trainer)
                self._changed_val_check = True
            lightning.set_val_check_batch(trainer, batches)

    def restore_validation(self, trainer: pl.Trainer) -> None:
        """Give the Trainer its own validation schedule back."""
        if self._changed_val_check:
            lightning.set_val_check_batch(trainer, self._val_check_batch)
            self._val_check_batch = None
            self._changed_val_check = False

    def end_epoch_after_this_batch(self, trainer: pl.Trainer) -> None:
        """Cut the current epoch short (a rejected trial of batches); the next epoch is whole again."""
        self._epoch_length = lightning.epoch_length(trainer)
        lightning.set_epoch_length(trainer, lightning.batches_done_this_epoch(trainer))

    def restore_epoch_length(self, trainer: pl.Trainer) -> None:
        """Undo :meth:`end_epoch_after_this_batch` at the end of the cut epoch."""
        if self._epoch_length is not None:
            lightning.set_epoch_length(trainer, self._epoch_length)
            self._epoch_length = None


def no_epoch_follows(trainer: pl.Trainer) -> bool:
    """Whether training ends with the current epoch: a stop was requested, or max_steps or max_epochs is reached."""
    max_epochs = trainer.fit_loop.max_epochs
    return (trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
            or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1))


def rewind(trainer: pl.Trainer, pl_module: pl.LightningModule, plugin: CoMPPrecision | None,
           snapshot: dict[str, Any], epoch: int | None = None) -> None:
    """Restore ``snapshot`` bit for bit, the loss scaler included, and re-seed the samplers for ``epoch``.

    A snapshot taken while no plan used fp16 holds no scaler state; a rejected fp16 trial leaves behind a scaler
    whose scale it has backed off. Dropping the plan first drops that scaler (a user-supplied one is kept and
    restored from the snapshot), so the next fp16 plan starts from a fresh scaler, as the first fp16 trial did.
    """
    if plugin is not None:
        plugin.try_plan(PrecisionPlan())
    TrainingSnapshot.from_state(snapshot).restore(trainer, pl_module, None if plugin is None else plugin.scaler)
    if epoch is not None:
        lightning.set_sampler_epochs(trainer, epoch)
