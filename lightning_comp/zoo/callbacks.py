"""Small callbacks used by the example app and the benchmarks."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

__all__ = ["EpochTimer"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochTimer(Callback):
    """Record the wall time and throughput of the training part of each epoch.

    The time of an epoch runs from ``on_train_epoch_start`` to the end of its last training batch, so the validation
    that Lightning runs at the end of the epoch is excluded. CUDA is synchronised at both ends. The first epoch includes
    warm-up (allocator, kernel selection), and under ``CoMPSearch`` the first epochs are warm-up and trial epochs; use
    ``epochs`` to pick the ones you want.

    Attributes:
        epochs: One dict per finished training epoch: ``{"epoch", "seconds", "samples", "samples_per_s"}``
            (samples counted on this process).
    """

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self._start = 0.0
        self._last_end = 0.0
        self._samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the clock."""
        _sync(pl_module.device)
        self._start = self._last_end = time.perf_counter()
        self._samples = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch and note when it ended."""
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._samples += len(first) if hasattr(first, "__len__") else 1
        _sync(pl_module.device)
        self._last_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Store the epoch's record (skipped when no batch ran)."""
        if self._samples == 0:
            return
        seconds = self._last_end - self._start
        self.epochs.append(
            {
                "epoch": float(trainer.current_epoch),
                "seconds": seconds,
                "samples": float(self._samples),
                "samples_per_s": self._samples / seconds if seconds > 0 else float("nan"),
            }
        )
