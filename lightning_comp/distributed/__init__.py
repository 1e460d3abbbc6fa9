"""Training under a plan across many workers: synchronous data parallelism, as the distributed-RNN paper does it, and
sharding.

:func:`half_precision_ddp_strategy` all-reduces gradients in bf16/fp16 on any backend, with a byte counter;
:class:`WorkerScaledLR` keeps the learning rate convergent at O(100) workers; :func:`fsdp2_policy` derives FSDP2 units'
policies from a plan, and :class:`CPUFSDPStrategy` runs FSDP1 on a CPU. Each module's docstring says what it holds.
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
