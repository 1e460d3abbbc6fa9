"""Low-precision weight copies that are re-cast in backward instead of being kept for it.

A lowered ``Linear``/``Conv`` computes with a 16-bit copy of its FP32 master weight, and autograd keeps that copy
alive until backward (to compute the input gradient): 2 bytes per lowered parameter held through every forward, on
top of the FP32 master, its gradient and the optimizer state. :class:`WeightCastRecorder` makes those copies itself,
remembers which parameter each came from, and, through :func:`torch.autograd.graph.saved_tensors_hooks`, saves a
recipe instead of the copy; backward casts the master again. That trades one extra cast per weight and step for
the copies' memory, and is bit-exact (the master has not changed between forward and backward).

The saved-tensor hooks are in force only inside the forward of an operator that makes such copies
(:meth:`WeightCastRecorder.saving`, entered by its pre-hook): every other tensor a step saves (FP32 operators', the
loss's, the model's own functional code) goes to autograd without a Python call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_comp.adapters.torch_internals import tensor_base, tensor_version
from lightning_comp.errors import UsageError
from lightning_comp.execution.saved_hooks import OuterHooks, hooks_installable, take_back

__all__ = ["WeightCastRecorder"]


@dataclass(frozen=True)
class _Recipe:
    """How to rebuild a saved weight copy (or a view of it) from its master parameter."""

    name: str
    param: nn.Parameter
    dtype: torch.dtype
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def rebuild(self) -> torch.Tensor:
        """The copy, cast again from the master.

        Raises:
            UsageError: if the master was modified in place since the copy was made.
        """
        if tensor_version(self.param) != self.version:
            raise UsageError(
                f"Parameter {self.name!r} was modified in place between forward and backward (version"
                f" {self.version} -> {tensor_version(self.param)}); its {self.dtype} copy cannot be rebuilt for"
                " backward. Step the optimizer after backward, or use CoMPPrecision(recast_weights_in_backward=False)."
            )
        with torch.no_grad():
            return self.param.to(self.dtype).as_strided(self.size, self.stride, self.offset)


class WeightCastRecorder:
    """Makes 16-bit weight copies during a step and saves them for backward as recipes (see module docstring)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], str, nn.Parameter]] = {}
        self._active = False

    @property
    def active(self) -> bool:
        """Whether a step is recording (copies made now are saved as recipes)."""
        return self._active

    def cast(self, name: str, param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """A differentiable ``dtype`` copy of ``param``; while :attr:`active`, backward casts it again instead."""
        copy = param.to(dtype)
        if self._active and copy is not param:
            self._copies[id(copy)] = (weakref.ref(copy), name, param)
        return copy

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the copies :meth:`cast` makes during one step (a no-op where autograd records nothing), so that
        the operators making them save recipes (:meth:`saving`)."""
        if not hooks_installable():
            yield
            return
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._copies.clear()

    def saving(self) -> AbstractContextManager[Any] | None:
        """The saved-tensor hooks one operator's forward runs in while a step records (``None`` otherwise): its
        weight copies are saved as recipes.

        Saved-tensor hooks already in force around it (``torch.autograd.graph.save_on_cpu``, a memory probe) keep
        receiving every other saved tensor: only the innermost pair of hooks is called, so this pair hands on to them.
        """
        if not self._active:
            return None
        outer = OuterHooks()

        def pack(tensor: torch.Tensor) -> Any:
            recipe = self._recipe(tensor)
            return outer.hand_on(tensor) if recipe is None else recipe

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def made(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a weight copy made by :meth:`cast` in the current step."""
        return self._recipe(tensor) is not None

    def _recipe(self, tensor: torch.Tensor) -> _Recipe | None:
        base = tensor_base(tensor)
        entry = self._copies.get(id(base))
        if entry is None or entry[0]() is not base:
            return None
        _, name, param = entry
        return _Recipe(name, param, tensor.dtype, tensor_version(param), tensor.size(), tuple(tensor.stride()),
                       int(tensor.storage_offset()))


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Recipe):
        return saved.rebuild()
    return take_back(saved)
