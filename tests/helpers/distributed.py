"""What the 2-process test scripts share: every parameter in full on every rank, and the gloo group released."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_comp.operators.discovery import operator_name

__all__ = ["ReleaseProcessGroup", "full_parameters"]


def full_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter in full, named as the plan names modules (all ranks must call this: it gathers)."""
    from torch.distributed.tensor import DTensor

    model = trainer.strategy.model
    if type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return {operator_name(n): p.detach().clone() for n, p in pl_module.named_parameters()}
    return {operator_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in pl_module.named_parameters()}


class ReleaseProcessGroup(pl.Callback):
    """Destroy the gloo group at the end of the fit, in every rank's process (a gloo group left to interpreter
    shutdown can abort a finished rank)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
