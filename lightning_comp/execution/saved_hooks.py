"""Saved-tensor hooks that hand tensors on to the hooks already in force around them.

Autograd calls only the innermost pair of :func:`torch.autograd.graph.saved_tensors_hooks`. The executor installs
pairs of its own inside whatever the user or a profiler has in force (``torch.autograd.graph.save_on_cpu``, a memory
probe, a user's own hooks): the weight re-cast recipes (:mod:`lightning_comp.execution.weight_casts`) and the
saved-precision codecs (:mod:`lightning_comp.execution.saved_tensors`). Each packs what it handles itself and hands
every other tensor, and what it stores of its own (a compressed tensor), on to the outer pair, so that, e.g., a
compressed activation still moves to the CPU under ``save_on_cpu``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_comp.adapters.torch_internals import saved_tensors_hooks_enabled, top_saved_tensors_hooks

__all__ = ["HookTimer", "OuterHooks", "hooks_installable", "take_back"]

#: What a measurement enters around a piece of the hooks' work (a codec's cast, a recipe's re-run), with the name of
#: the operator it is charged to (:mod:`lightning_comp.search.measurement.direct_timing`).
HookTimer = Callable[[str], AbstractContextManager[Any]]


@dataclass(frozen=True)
class _HandedOn:
    """A tensor packed by the outer hooks, with the unpack hook that restores it."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


class OuterHooks:
    """The saved-tensor hooks in force where this object is made (none: tensors are kept as they are)."""

    def __init__(self) -> None:
        self._hooks = top_saved_tensors_hooks()

    def hand_on(self, tensor: torch.Tensor) -> Any:
        """What to save for ``tensor`` so that the outer hooks pack it (``tensor`` itself where there are none);
        :func:`take_back` restores it."""
        if self._hooks is None:
            return tensor
        pack, unpack = self._hooks
        return _HandedOn(pack(tensor), unpack)


def take_back(saved: Any) -> Any:
    """The tensor :meth:`OuterHooks.hand_on` handed on (anything else is returned as it is)."""
    if isinstance(saved, _HandedOn):
        return saved.unpack(saved.packed)
    return saved


def hooks_installable() -> bool:
    """Whether saved-tensor hooks take effect now: autograd records (grad mode on, not inference mode) and torch has
    not disabled saved-tensor hooks."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and saved_tensors_hooks_enabled()
