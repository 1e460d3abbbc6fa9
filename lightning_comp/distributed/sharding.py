"""A plan under sharded training: FSDP2 policies derived from a plan, and FSDP1 on a CPU.

- :func:`fsdp2_policy`: the ``MixedPrecisionPolicy`` of one FSDP2 unit (``fully_shard(module, mp_policy=...)``) that a
  plan implies. Where every operator whose parameters the unit manages computes in one 16-bit precision, the unit's
  parameters are all-gathered in it (half the bytes) and its gradients still reduced in FP32; anywhere else the
  unit stays FP32 and CoMP's hooks lower operator by operator, as they do for everything a policy cannot express
  (parameter-free operators, a unit mixing precisions, outputs). Use it in ``configure_model``, with
  ``CoMPPrecision(plan)`` as the Trainer's plugin.
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
from lightning_comp.adapters.torch_internals import FSDP2_MODULE
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.operators.discovery import iter_operators, operator_name, operator_type
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PlanLike, plan_from_any

__all__ = ["CPUFSDPStrategy", "fsdp2_policy"]


def fsdp2_policy(plan: PlanLike, module: nn.Module, name: str = "") -> Any:
    """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` for sharding ``module`` (called ``name`` in the model)
    under ``plan``: ``param_dtype`` the one 16-bit dtype every operator in it that holds parameters computes in (units
    already sharded inside it excluded; bf16 for ``fp8`` operators, which scale that bf16 weight to float8 at each
    call), else ``None`` (FP32); ``reduce_dtype`` FP32; inputs and outputs left to the
    plan's hooks (``cast_forward_inputs=False``).

    Args:
        plan: the plan (anything ``CoMPPrecision`` accepts).
        module: the module about to be sharded with ``fully_shard``.
        name: its name in the model, as the plan names it (``"blocks.0"``); ``""`` for the model itself.

    Raises:
        UnsupportedSetupError: if this torch has no FSDP2.
    """
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError as error:  # pragma: no cover - a torch without distributed
        raise UnsupportedSetupError(f"torch {torch.__version__} has no FSDP2 (MixedPrecisionPolicy).") from error
    resolved = plan_from_any(plan)
    prefix = f"{name}." if name else ""
    inner = [operator_name(n) for n, m in module.named_modules()  # units sharded already: their own policies
             if n and FSDP2_MODULE is not None and isinstance(m, FSDP2_MODULE)]
    precisions = set()
    for op_name, op in iter_operators(module, traced=False):
        if any(op_name == u or op_name.startswith(u + ".") for u in inner) \
                or not any(True for _ in op.parameters(recurse=False)):
            continue
        precisions.add(resolved.of(Dimension.COMPUTE, prefix + op_name if op_name else name, operator_type(op)))
    # bf16 and fp8 operators both take bf16 weights (an fp8 one scales its weight to float8 at each call)
    dtypes = {precision.dtype for precision in precisions}
    low = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    return MixedPrecisionPolicy(param_dtype=low if low != torch.float32 else None, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


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
