"""Keep ``ModelCheckpoint`` from choosing a "best" checkpoint among trials the search may rewind.

While the search's trials run, every trial but the one it keeps is rewound: weights a trial trained are thrown away.
A ``ModelCheckpoint`` that went on scoring and saving its top-k checkpoints meanwhile could make a rejected trial's
file its ``best_model_path`` (the file a user deploys, or ``trainer.test(ckpt_path="best")`` loads), and with
``save_top_k=1`` delete the best file of the run's own trajectory to make room for it.

:class:`CheckpointHold` therefore holds each ``ModelCheckpoint``'s top-k saving (monitored or not) from the search's
first trial until the model holds its final state. Its ``save_last`` goes on as before, at the moments it would
(``last.ckpt``: what a run killed inside the search resumes from; ``save_last="link"`` writes a file meanwhile, as
there is no top-k file of the search to link to). When the search keeps the trial that has just been validated, that
validation is scored at once, so the kept trial's end can be the best checkpoint; after a rewind, scoring resumes with
the next validation (``last.ckpt`` is written after that scoring, as ModelCheckpoint writes it after a save). So
during the search no top-k file is written, and none that is written later holds a rejected
trial's weights; ``best_model_path``, ``best_k_models`` and ``kth_best_model_path`` never name one.

This reaches into ``ModelCheckpoint``'s private ``_save_topk_checkpoint`` and ``_last_global_step_saved`` (Lightning
2.6): the hold shadows the method on the instance and takes the shadow away on release.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_comp.adapters.lightning_internals import callbacks

__all__ = ["CheckpointHold"]

_SHADOWED = "_save_topk_checkpoint"


class CheckpointHold:
    """Holds the top-k saving of a Trainer's ``ModelCheckpoint`` callbacks while the search's trials run."""

    def __init__(self) -> None:
        self._held: list[tuple[ModelCheckpoint, Any]] = []  # (callback, its own save_last)

    @property
    def active(self) -> bool:
        """Whether some checkpoint callbacks are held now."""
        return bool(self._held)

    @property
    def held(self) -> list[ModelCheckpoint]:
        """The held callbacks."""
        return [checkpoint for checkpoint, _ in self._held]

    def hold(self, trainer: pl.Trainer) -> None:
        """Hold the top-k saving of every ``ModelCheckpoint`` of ``trainer`` (again on resume; idempotent)."""
        for checkpoint in callbacks(trainer):
            if not isinstance(checkpoint, ModelCheckpoint) or checkpoint in self.held:
                continue

            def held_topk(trainer: pl.Trainer, monitor_candidates: Any,
                          checkpoint: ModelCheckpoint = checkpoint) -> None:
                # no top-k file now; but ModelCheckpoint writes last.ckpt only where it saved at this step: let it
                checkpoint._last_global_step_saved = trainer.global_step

            setattr(checkpoint, _SHADOWED, held_topk)
            self._held.append((checkpoint, checkpoint.save_last))
            if checkpoint.save_last == "link":  # nothing of the search's to link to: write last.ckpt itself
                checkpoint.save_last = True

    def release(self, trainer: pl.Trainer, score: bool = False) -> None:
        """Give every held callback its top-k saving back.

        Args:
            trainer: the Trainer.
            score: the model holds the state its latest validation measured (the kept trial, just validated):
                score that validation now, as the callback would have (it may become the best checkpoint), and
                write ``last.ckpt`` after it, as the callback does after a save.
        """
        held, self._held = self._held, []
        for checkpoint, save_last in held:
            if _SHADOWED in vars(checkpoint):
                delattr(checkpoint, _SHADOWED)
            checkpoint.save_last = save_last
            if score and _may_save(trainer, checkpoint):
                candidates = checkpoint._monitor_candidates(trainer)
                checkpoint._save_topk_checkpoint(trainer, candidates)
                # as the callback itself: last.ckpt follows a save (its own hook now skips this step as saved)
                checkpoint._save_last_checkpoint(trainer, candidates)


def _may_save(trainer: pl.Trainer, checkpoint: ModelCheckpoint) -> bool:
    """Whether ``checkpoint`` would score a validation now (as its own ``on_validation_end``; the held top-k saving
    marked this step saved, so its own skip check cannot be asked)."""
    every = checkpoint._every_n_epochs
    fast_dev_run = bool(getattr(trainer, "fast_dev_run", False))  # (set in Trainer.__init__; unknown to mypy)
    return (not fast_dev_run and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
            and every >= 1 and (trainer.current_epoch + 1) % every == 0)
