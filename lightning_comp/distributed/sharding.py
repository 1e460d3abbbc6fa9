"""A plan under sharded training: FSDP2 policies derived from a plan, and FSDP1 on a CPU.

- :func:`fsdp2_policy`: the ``MixedPrecisionPolicy`` of one FSDP2 unit (``fully_shard(module, mp_policy=...)``) that a
  plan implies. Where every operator whose parameters the unit manages computes in one 16-bit precision, the unit's
  parameters are all-gathered in it (half the bytes) and its gradients still reduced in FP32; anywhere else the
  unit stays FP32 and CoMP's hooks lower operator by operator, as they do for everything a policy cannot express
  (parameter-free operators, a unit mixing precisions, outputs). ``CoMPPrecision`` keeps every unit's policy on the
  plan in force (:mod:`lightning_comp.execution.fsdp2_policies`); use it in ``configure_model`` to shard with the
  right policy from the first step.
- :class:`CPUFSDPStrategy`: Lightning's ``FSDPStrategy`` on a CPU with gloo (Lightning refuses FSDP on a CPU
  accelerator, and FSDP1 needs a ``device_id`` there): to try FSDP1 with a plan on a laptop or in CI. For
  correctness, not speed.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from lightning_comp.adapters.lightning_internals import setup_fsdp_activation_checkpointing
from lightning_comp.execution.fsdp2_policies import fsdp2_policy

__all__ = ["CPUFSDPStrategy", "fsdp2_policy"]


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) on a CPU with gloo: wraps with ``device_id=torch.device("cpu")``, state dicts
    sharded (Lightning's default ``"full"`` offloads to the CPU, which fails on CPU tensors). Everything else is
    Lightning's, activation checkpointing included. Use ``accelerator="cpu"``; on GPUs use ``FSDPStrategy``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("state_dict_type", "sharded")
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                             mixed_precision=self.mixed_precision_config,
                                             sharding_strategy=self.sharding_strategy,
                                             device_id=torch.device("cpu"), **self.kwargs)
        setup_fsdp_activation_checkpointing(self, model)
        return model
