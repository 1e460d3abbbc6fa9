"""Saving an FP32 copy of a lowered operator's output as the output itself: :class:`UpcastSaver`.

Where a lowered operator's consumer computes in FP32, its post-hook hands the consumer an FP32 copy of its BF16 (or
FP16) output. A consumer that saves its input for backward (a GELU, a BatchNorm, an FP32 Linear) then keeps that
copy: twice the bytes of the output it was made from, holding nothing more (every value is the 16-bit one). During a
training step's forward, :meth:`UpcastSaver.recording` puts a pair of saved-tensor hooks in force, outside the
executor's own, that store such a copy (or a view of it) as the 16-bit output it was cast from, and cast it again in
backward: the same conversion of the same values, so the tensor backward gets is bit-identical, for half the bytes.
A recompute operator's recipe holds such an input the same way (:meth:`UpcastSaver.source`).

The copies are found by the tensor the post-hook returned (:meth:`UpcastSaver.note`), weakly: an output nobody saves
keeps nothing alive. A copy modified in place after the cast is saved as it is. The hooks hand everything else, and
the 16-bit output they store, on to the hooks in force around the step (a user's ``save_on_cpu``, a profiler's).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_comp.adapters.torch_internals import storage_key, tensor_version
from lightning_comp.common.nested import tensors
from lightning_comp.execution.saved_hooks import OuterHooks, hooks_installable, take_back

__all__ = ["UpcastSaver"]


@dataclass(frozen=True)
class _Source:
    """The 16-bit output an FP32 copy was cast from, and the copy's version then."""

    low: torch.Tensor
    version: int


@dataclass(frozen=True)
class _Stored:
    """A saved FP32 copy, stored as (a view of) its 16-bit source (handed on to the outer hooks)."""

    data: Any
    dtype: torch.dtype


class UpcastSaver:
    """Stores saved FP32 copies of lowered outputs as the outputs (see the module docstring)."""

    def __init__(self) -> None:
        self._sources: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._by_storage: dict[int, weakref.ref[torch.Tensor]] = {}
        self._active = False

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin: the step's tensors belong to this process, nothing travels
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def note(self, low_output: Any, output: Any) -> None:
        """A post-hook cast ``low_output`` (an operator's outputs) into ``output``: remember each FP32 copy's source
        (only while :meth:`recording` is in force)."""
        if not self._active:
            return
        for low, copy in zip(tensors(low_output), tensors(output)):
            if (copy is not low and copy.dtype == torch.float32 and low.dtype != torch.float32
                    and low.size() == copy.size() and low.stride() == copy.stride()
                    and low.storage_offset() == copy.storage_offset()):
                self._sources[copy] = _Source(low, tensor_version(copy))
                self._by_storage[storage_key(copy)] = weakref.ref(copy)

    def source(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The 16-bit tensor ``tensor`` (an FP32 copy a post-hook made, or a view of one, unchanged since) holds the
        values of, laid out as ``tensor``; ``None`` where it is none of these."""
        if not self._active or tensor.dtype != torch.float32:
            return None
        ref = self._by_storage.get(storage_key(tensor))
        copy = None if ref is None else ref()
        if copy is None:
            return None
        found: _Source | None = self._sources.get(copy)
        if found is None or tensor_version(copy) != found.version:
            return None
        if tensor is copy:
            return found.low
        return found.low.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The hooks of a training step's forward (a no-op where autograd records nothing, and inside another)."""
        if self._active or not hooks_installable():
            yield
            return
        outer = OuterHooks()

        def pack(tensor: torch.Tensor) -> Any:
            low = self.source(tensor)
            if low is None:
                return outer.hand_on(tensor)
            return _Stored(outer.hand_on(low), tensor.dtype)

        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            self._active = False
            self._sources = WeakTensorKeyDictionary()
            self._by_storage = {}


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Stored):
        return take_back(saved.data).to(saved.dtype)  # type: ignore[no-any-return]
    return take_back(saved)  # type: ignore[no-any-return]
