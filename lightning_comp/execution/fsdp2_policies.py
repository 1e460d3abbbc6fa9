"""FSDP2 units' ``MixedPrecisionPolicy`` derived from the plan in force, and kept on it when the plan changes.

:func:`fsdp2_policy` is the policy one unit (``fully_shard(module, mp_policy=...)``) gets from a plan: where every
operator whose parameters the unit manages computes in one 16-bit dtype (bf16 for bf16 and fp8 operators), its
parameters are all-gathered in that dtype (half the bytes) and its gradients still reduced in FP32; anywhere else
the unit stays FP32 and the plan's hooks lower operator by operator. The numerics are the hooks' either way (a lowered
operator computes with a 16-bit copy of its weight; the policy makes that copy before the all-gather instead of
after it).

:class:`PolicyFollower` re-derives every unit's policy each time a plan is put in force (a fixed plan at set-up, each
trial of a search, the plan it chooses, a later ``set_plan``), so a policy never outlives its plan: a trial that
keeps a unit in FP32 does not all-gather it in bf16 because an earlier plan lowered it. The cost is one pass over the
units per plan change (no collective, no re-sharding: FSDP2 reads the new dtypes at the unit's next all-gather). A
policy the user gave ``fully_shard`` that differs from the plan's is replaced, with a warning naming the units: the
plan decides each operator's precision.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_comp.adapters.torch_internals import FSDP2_MODULE, fsdp2_policy_of, set_fsdp2_policy
from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.operators.discovery import iter_operators, operator_name, operator_type
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.plan import PlanLike, plan_from_any

__all__ = ["PolicyFollower", "fsdp2_policy", "fsdp2_units"]


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


def fsdp2_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units of ``model`` (modules ``fully_shard`` sharded), named as plans name modules."""
    if FSDP2_MODULE is None:
        return []
    return [(operator_name(name), module) for name, module in model.named_modules() if isinstance(module, FSDP2_MODULE)]


class PolicyFollower:
    """Keeps each FSDP2 unit's ``MixedPrecisionPolicy`` on the plan in force (see the module docstring)."""

    def __init__(self) -> None:
        self._set: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self.changes = 0  # units whose policy changed, over every plan put in force

    def __getstate__(self) -> dict[str, Any]:
        # (a plugin travels to ddp_spawn's workers pickled: the units it set policies on are the parent's)
        return {"changes": self.changes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.changes = int(state.get("changes", 0))

    def follow(self, model: nn.Module, plan: PlanLike) -> list[str]:
        """Give every unit of ``model`` the policy ``plan`` implies; return the units whose policy changed."""
        changed, replaced = [], []
        for name, unit in fsdp2_units(model):
            wanted = fsdp2_policy(plan, unit, name)
            current = fsdp2_policy_of(unit)
            if current == wanted:
                self._set[unit] = wanted
                continue
            ours = self._set.get(unit)
            if ours is None and current != type(current)():  # the user's own, not a default one
                replaced.append(f"{name or '<root>'} ({_described(current)} -> {_described(wanted)})")
            set_fsdp2_policy(unit, wanted)
            self._set[unit] = wanted
            changed.append(name or "<root>")
        if replaced:
            rank_zero_warn(
                f"The plan decides each operator's precision, so the FSDP2 units' MixedPrecisionPolicy follows it:"
                f" the policy given to fully_shard was replaced for {'; '.join(replaced)}. Shard with"
                " mp_policy=fsdp2_policy(plan, module, name), or leave mp_policy out, to say the same.")
        self.changes += len(changed)
        return changed


def _described(policy: Any) -> str:
    def name(dtype: torch.dtype | None) -> str:
        return "fp32" if dtype is None else str(dtype).replace("torch.", "")

    return f"param_dtype {name(policy.param_dtype)}, reduce_dtype {name(policy.reduce_dtype)}"
