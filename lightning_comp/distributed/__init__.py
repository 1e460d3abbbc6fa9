"""Synchronous data-parallel training across many workers, as the distributed-RNN paper does it.

=====================  ==========================================================================================
module                 what it holds
=====================  ==========================================================================================
``grad_compression``   :class:`HalfPrecisionDDPStrategy`: gradients all-reduced in bf16/fp16 on any backend,
                       with a byte counter
``lr_schedule``        :class:`WorkerScaledLR`: a learning rate that stays convergent at O(100) workers
``sharding``           :func:`fsdp2_policy` (FSDP2 units' policies from a plan), :class:`CPUFSDPStrategy` (FSDP1
                       on a CPU)
=====================  ==========================================================================================
"""

from lightning_comp.distributed.grad_compression import (
    CommStats,
    GradCommDtype,
    HalfPrecisionDDPStrategy,
    counting_comm_hook,
    half_precision_ddp_strategy,
)
from lightning_comp.distributed.lr_schedule import WorkerScaledLR, WorkerScaledLRConfig, worker_scaled_lr
from lightning_comp.distributed.sharding import CPUFSDPStrategy, fsdp2_policy

__all__ = ["CPUFSDPStrategy", "CommStats", "GradCommDtype", "HalfPrecisionDDPStrategy", "WorkerScaledLR",
           "WorkerScaledLRConfig", "counting_comm_hook", "fsdp2_policy", "half_precision_ddp_strategy",
           "worker_scaled_lr"]
