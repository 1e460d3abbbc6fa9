"""Rank agreement under DDP: every rank takes every decision from the same numbers.

Measurements differ from rank to rank (each times its own batch); decisions must not. Timings are averaged over
ranks before any comparison, and decisions taken on rank 0 are broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch

from lightning_comp.search.measurement.profiling import ProfileResult

__all__ = ["agree", "reduce_mean", "reduce_profile"]

T = TypeVar("T")


def reduce_mean(trainer: pl.Trainer, value: float) -> float:
    """The mean of ``value`` over all ranks (``value`` itself in a single process)."""
    if trainer.world_size <= 1:
        return float(value)
    tensor = torch.tensor(float(value), dtype=torch.float64, device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(tensor, reduce_op="mean"))


def reduce_profile(trainer: pl.Trainer, results: Mapping[Any, ProfileResult]) -> None:
    """Average per-operator times and saved-for-backward bytes over ranks, in place.

    Bytes matter as much as times: the memory and balanced objectives decide from them, and batches of different
    shapes on different ranks save different amounts.
    """
    if trainer.world_size <= 1:
        return
    for result in results.values():
        names = sorted(result.operators)
        values = torch.tensor([[result.operators[n].forward_ms, result.operators[n].backward_ms,
                                result.operators[n].compute_ms, float(result.operators[n].saved_bytes)]
                               for n in names], dtype=torch.float64)
        reduced = trainer.strategy.reduce(values.to(trainer.strategy.root_device), reduce_op="mean").cpu()
        for name, row in zip(names, reduced.tolist()):
            m = result.operators[name]
            m.forward_ms, m.backward_ms, m.compute_ms = row[:3]
            m.saved_bytes = int(round(row[3]))


def agree(trainer: pl.Trainer, obj: T) -> T:
    """Rank 0's ``obj`` on every rank."""
    return trainer.strategy.broadcast(obj, src=0)  # type: ignore[no-any-return]
