"""One of the user's training steps on one batch, run again and again by the batch stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_comp.errors import SearchConfigError

__all__ = ["TrainingStepRunner"]


class TrainingStepRunner:
    """Runs the user's ``training_step`` plus backward on one batch, without logging, stepping or gradient sync.

    Args:
        pl_module: the model.
        batch: the batch.
        batch_idx: its index, as ``training_step`` receives it.
    """

    def __init__(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.pl_module = pl_module
        self.batch = batch
        self.batch_idx = batch_idx

    def __call__(self) -> None:
        """One forward and backward (gradients are dropped at the end).

        Raises:
            SearchConfigError: if ``training_step`` returns no loss tensor under automatic optimization.
        """
        module = self.pl_module
        module.log = _ignore  # type: ignore[method-assign]
        module.log_dict = _ignore  # type: ignore[method-assign]
        try:
            output = module.training_step(self.batch, self.batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if module.automatic_optimization:
                if not isinstance(loss, torch.Tensor):
                    raise SearchConfigError(
                        "CoMPSearch profiles the training step, but training_step returned"
                        f" {type(output).__name__} instead of a loss tensor (or a dict with 'loss')."
                    )
                loss.backward()
        finally:
            del module.log
            del module.log_dict
            for param in module.parameters():
                param.grad = None


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
