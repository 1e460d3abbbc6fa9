"""The forward hooks a plan puts on its operators, per operator, and which operators need them at all.

Every hook costs a module call its fast path (``nn.Module.__call__`` runs the slow one as soon as a module has any
hook), about 10 us per call on a CPU: on a model of a hundred small operators, hooking them all costs a third of a
step. So an operator carries hooks only where they change something (:attr:`HookNeeds.always_hooked`, plus what a
calibrating step finds):

- an operator that computes in a lower precision, or saves other than as computed (its region, casts, saved-tensor
  hooks; an operator saving ``recompute`` records its recipes in its hooks);
- an FP32 operator whose parameters a ``master`` entry holds in bf16 (it computes with FP32 copies of them);
- a shape-only operator (a lowered producer's output stays low through it);
- any operator inside a lowered ``FUNCTIONAL`` operator's region (it shields its own call from that region);
- an FP32 operator that a calibrating step saw receive a 16-bit input (it casts it back to FP32): the user's own
  16-bit tensors, or a chained output routed to it.

Every other FP32 operator would only cost: lowered operators' outputs return to FP32 before anything but an operator
of their own precision consumes them (the cast boundaries). A calibrating step (the first of each kind after a plan
is applied, when the call pattern is found) runs with every operator hooked; the executor then takes the hooks off
those that did nothing (:class:`HookRegistry`). A step runs inside saved-tensor hooks only where the plan needs them:
its parameters are watched where an operator compresses what it saves, and a training step's forward records
recipes where an operator recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from lightning_comp.execution.compiled_regions import EagerCall, untraceable
from lightning_comp.execution.hooks import HookedOperator, PostHook, PreHook
from lightning_comp.operators.kinds import OperatorKind

__all__ = ["HookNeeds", "HookRegistry"]


class _Handle(Protocol):
    """A ``RemovableHandle`` or an ``EagerCall``."""

    def remove(self) -> None: ...


@dataclass(frozen=True)
class HookNeeds:
    """The hooks a plan's operators need (see the module docstring).

    Attributes:
        always_hooked: the operators whose forward hooks change something in every step; none at all when no
            operator computes in a lower precision or saves other than as computed.
        compresses: an operator saves in a lower precision (``bf16``/``fp8``).
        recomputes: an operator saves ``recompute``.
    """

    always_hooked: frozenset[str] = frozenset()
    compresses: bool = False
    recomputes: bool = False

    @staticmethod
    def of(operators: Mapping[str, HookedOperator]) -> HookNeeds:
        """What ``operators`` (name -> operator) need."""
        return HookNeeds(_always_hooked(operators), any(op.saved.compresses for op in operators.values()),
                         any(op.saved.recomputes for op in operators.values()))


def _always_hooked(operators: Mapping[str, HookedOperator]) -> frozenset[str]:
    if not any(op.low or op.saved.changes or op.fp32_copies for op in operators.values()):
        return frozenset()
    regions = [op.name for op in operators.values() if op.kind is OperatorKind.FUNCTIONAL and op.low]

    def inside_region(name: str) -> bool:
        return any(region != name and (region == "" or name.startswith(region + ".")) for region in regions)

    return frozenset(name for name, op in operators.items()
                     if op.low or op.saved.changes or op.fp32_copies or op.transparent or inside_region(name))


class HookRegistry:
    """The registered hooks of each operator, by name.

    Args:
        make: builds an operator's pre-hook (with kwargs) and post-hook (``always_call``).
    """

    def __init__(self, make: Callable[[HookedOperator], tuple[PreHook, PostHook]]) -> None:
        self._make = make
        self._handles: dict[str, list[_Handle]] = {}

    def hook(self, operators: Iterable[HookedOperator], *, compiled: bool) -> list[str]:
        """Register the hooks of each of ``operators`` not hooked yet; return the names of those it hooked.

        Args:
            operators: the operators.
            compiled: the model runs under ``torch.compile``: an operator Dynamo cannot trace is called eagerly
                between its hooks (:class:`~lightning_comp.execution.compiled_regions.EagerCall`).
        """
        added = []
        for op in operators:
            if op.name in self._handles:
                continue
            pre_hook, post_hook = self._make(op)
            if compiled and untraceable(op.module):  # a graph break inside its region would drop it
                self._handles[op.name] = [EagerCall(op.module, pre_hook, post_hook)]
            else:
                self._handles[op.name] = [
                    op.module.register_forward_pre_hook(pre_hook, with_kwargs=True),
                    # first among the post-hooks: the module's parameters are put back before anything after the
                    # forward (FSDP2 reshards in a post-hook it appended when the model was sharded)
                    op.module.register_forward_hook(post_hook, always_call=True, prepend=True),
                ]
            added.append(op.name)
        return added

    def unhook(self, names: Iterable[str]) -> None:
        """Remove the hooks of the operators ``names`` (those hooked)."""
        for name in names:
            for handle in self._handles.pop(name, ()):
                handle.remove()

    def clear(self) -> None:
        """Remove every hook."""
        self.unhook(list(self._handles))

    def __contains__(self, name: object) -> bool:
        return name in self._handles

    def __len__(self) -> int:
        """How many hook handles are registered (2 per hooked operator, 1 per operator called eagerly)."""
        return sum(len(handles) for handles in self._handles.values())

    def __bool__(self) -> bool:
        return bool(self._handles)
