"""``CoMPFSDPPrecision``: ``CoMPPrecision`` in the form Lightning's ``FSDPStrategy`` (FSDP1) accepts."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from torch import Tensor
from typing_extensions import override

from lightning_comp.execution.saved_tensors import DEFAULT_MIN_SAVED_BYTES
from lightning_comp.execution.update_path import UpdatePath
from lightning_comp.plan.plan import PlanLike
from lightning_comp.plugins.comp import CoMPPrecision

__all__ = ["CoMPFSDPPrecision"]


class CoMPFSDPPrecision(CoMPPrecision, FSDPPrecision):  # type: ignore[misc]  # scaler: CoMPPrecision's property
    """Train with a per-operator precision plan under ``FSDPStrategy`` (FSDP1), which accepts only an
    ``FSDPPrecision``: ``Trainer(strategy=FSDPStrategy(...), plugins=[CoMPFSDPPrecision(plan)])``.

    It is a :class:`~lightning_comp.CoMPPrecision` in every respect but these:

    - FSDP gets no ``MixedPrecision`` of its own (``mixed_precision_config`` is ``None``): the flat parameters stay
      FP32 and so does the gradient reduction; the plan lowers each operator inside the forward, whatever the
      auto-wrap policy, with or without Lightning's activation checkpointing.
    - FP16 plans scale the loss once and use ``ShardedGradScaler``, whose overflow check spans every rank's gradient
      shard (a plain ``GradScaler`` lets a rank whose shard overflowed skip a step the others take).
    - Lowered weights are not re-cast in backward (``recast_weights_in_backward=False``): under FSDP1 a module's
      weights are views of the unsharded flat parameter, so there is no 16-bit copy to drop; autocast's own copies
      are what the forward keeps.
    - Gradient clipping by norm is refused, as Lightning's ``FSDPPrecision`` refuses it.

    Args:
        plan: as :class:`~lightning_comp.CoMPPrecision`.
        allow_slow_fp16: as :class:`~lightning_comp.CoMPPrecision`.
        scaler: a ``ShardedGradScaler`` for FP16 plans instead of a default one.
        min_saved_bytes: as :class:`~lightning_comp.CoMPPrecision`.
        update_path: as :class:`~lightning_comp.CoMPPrecision`.
        release_gradients_after_step: as :class:`~lightning_comp.CoMPPrecision` (the parameters the optimizer
            steps, FSDP1's flat ones or FSDP2's sharded ones, get ``None`` as their ``zero_grad`` would give them).
    """

    def __init__(self, plan: PlanLike = None, *, allow_slow_fp16: bool = False,
                 scaler: torch.amp.GradScaler | None = None, min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES,
                 update_path: UpdatePath | str = UpdatePath.AUTO, release_gradients_after_step: bool = True) -> None:
        # FSDPPrecision.__init__ is not run: it would assign ``scaler``, which is CoMPPrecision's (read-only) property
        # (CoMPPrecision's own chain ends in Lightning's Precision, which takes no argument)
        CoMPPrecision.__init__(self, plan, allow_slow_fp16=allow_slow_fp16, scaler=scaler,
                               recast_weights_in_backward=False, min_saved_bytes=min_saved_bytes,
                               update_path=update_path, release_gradients_after_step=release_gradients_after_step)
        self._desired_input_dtype = torch.float32  # what FSDPPrecision's init contexts read

    @override
    def _new_scaler(self, device_type: str) -> torch.amp.GradScaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device_type)

    @property
    @override
    def mixed_precision_config(self) -> None:  # type: ignore[override]
        """``None``: FSDP keeps FP32 flat parameters and reduces gradients in FP32; the plan lowers per operator."""
        return None

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """No autocast of its own (``FSDPPrecision``'s is CUDA's, for the whole model): the plan's hooks lower."""
        return nullcontext()

    @override
    def convert_input(self, data: Any) -> Any:
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        return data

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss once (``FSDPPrecision.pre_backward`` would scale it a second time)."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return LightningPrecision.pre_backward(self, tensor, module)
