"""Saved-tensor hooks that store each operator's activations for backward at its planned saved precision.

While an operator whose plan entry saves ``bf16`` or ``fp8`` runs (between its forward pre- and post-hook), a pair of
:func:`torch.autograd.graph.saved_tensors_hooks` is in force. Its pack hook compresses every floating tensor the
operator saves (:mod:`lightning_comp.numerics.saved_precision`), except:

- parameters, views of parameters and casts of them (a lowered layer's 16-bit weight copy): those keep their own
  recipes (:mod:`lightning_comp.execution.weight_casts`), and a weight is never stored lossy;
- tensors smaller than the size threshold (their pack/unpack costs more than their bytes are worth);
- tensors no smaller at the saved precision (a BF16 activation saved ``bf16``), integer and bool tensors;
- outputs of operators that save ``recompute`` (:mod:`lightning_comp.execution.recompute`), views of them and casts
  a consumer made of them: the recompute hooks, outside these, store a recipe instead, so the recipe wins over
  compression.

The hooks chain to the hooks that were in force around the operator (``torch.autograd.graph.save_on_cpu``, the
weight re-cast recipes, a memory probe, a user's own): a compressed tensor is handed on to them, so it is, e.g.,
moved to the CPU in its compressed form; everything not compressed is handed on as it is.

A tensor saved by several operators of the same saved precision in one step (a LayerNorm's output read by three
projections) is compressed once and shared, so sharing never costs more than keeping the original.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_comp.adapters.torch_internals import (
    is_gradient_accumulator,
    is_view_or_cast_node,
    node_inputs,
    storage_key,
    tensor_version,
)
from lightning_comp.errors import ConfigError
from lightning_comp.execution.saved_hooks import HookTimer, OuterHooks, hooks_installable, take_back
from lightning_comp.numerics.codecs import CompressedTensor, compress, decompress, shrinks
from lightning_comp.numerics.precision import SavedPrecision

__all__ = ["DEFAULT_MIN_SAVED_BYTES", "SavedTensorCompressor", "is_compressor_pack"]

DEFAULT_MIN_SAVED_BYTES = 16 * 1024
_MARK = "_lightning_comp_compressor"  # set on the pack hooks this module makes


def is_compressor_pack(pack: object) -> bool:
    """Whether ``pack`` is the pack hook of an operator's compression (which hands what it keeps on outward)."""
    return getattr(pack, _MARK, False) is True


def _from_parameter(tensor: torch.Tensor, depth: int = 4) -> bool:
    """Whether ``tensor``'s autograd history is only views and casts of a parameter (a leaf that needs a gradient):
    a saved tensor reached from a parameter through these is a form of it (a transposed weight, its 16-bit copy),
    not an activation."""
    fn = tensor.grad_fn
    for _ in range(depth):
        if fn is None or not is_view_or_cast_node(fn):
            return False
        parents = [node for node, _ in node_inputs(fn) if node is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
        if is_gradient_accumulator(fn):
            return True
    return False


@dataclass(frozen=True)
class _Stored:
    """A compressed saved tensor: its stored data (handed on to the outer hooks), dtype and scale; and, where a
    measurement times the codec, its timer and the operator that saved it."""

    data: Any
    dtype: torch.dtype
    inverse_scale: torch.Tensor | None
    timed: tuple[HookTimer, str] | None = None


class SavedTensorCompressor:
    """Makes the saved-tensor hooks of operators that save at a lower precision (see the module docstring).

    Args:
        min_bytes: tensors smaller than this many bytes are saved as they are.
        is_weight_copy: tells the weight copies a
            :class:`~lightning_comp.execution.weight_casts.WeightCastRecorder` made (a frozen parameter's copy has no
            autograd history that shows where it came from).
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_SAVED_BYTES,
                 is_weight_copy: Callable[[torch.Tensor], bool] | None = None) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ConfigError(f"min_saved_bytes={min_bytes!r} is invalid: it must be an integer >= 0 (bytes).")
        self.min_bytes = min_bytes
        self._is_weight_copy = is_weight_copy
        self._defers: Callable[[torch.Tensor], bool] | None = None
        self._parameters: set[int] = set()
        self._shared: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.compressed_bytes = 0  # bytes of the tensors compressed so far (for inspection and tests)
        self.stored_bytes = 0  # what they take compressed
        #: Set by a measurement for the steps it times: entered around each compression in the forward and each
        #: decompression in backward, with the saving operator's name; read when an operator's hooks are entered.
        self.codec_timer: HookTimer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin: shared copies and storage addresses belong to this process
        return {**self.__dict__, "_shared": None, "_parameters": set(), "codec_timer": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._shared = WeakTensorKeyDictionary()

    def watch(self, model: nn.Module) -> None:
        """Remember ``model``'s parameter storages (frozen ones too): they are never compressed. Called at every step,
        since parameters may be replaced between steps (``load_state_dict(assign=True)``)."""
        self._parameters = {storage_key(p) for p in model.parameters()}

    def defer_to(self, claims: Callable[[torch.Tensor], bool] | None) -> None:
        """Save as they are the tensors ``claims`` says another pair of hooks outside stores otherwise (the
        recompute hooks' recipes); ``None``: nothing is deferred (a plan without ``recompute`` entries)."""
        self._defers = claims

    def clear(self) -> None:
        """Forget shared compressed tensors (at the end of a step: the graph holds what it needs)."""
        self._shared = WeakTensorKeyDictionary()

    def context(self, saved: SavedPrecision, name: str = "") -> AbstractContextManager[Any] | None:
        """The hooks of operator ``name`` that saves at ``saved``, to enter for its forward (``None``: nothing to
        do)."""
        if not saved.compresses or not hooks_installable():
            return None
        timed = None if self.codec_timer is None else (self.codec_timer, name)
        return _EnteredHooks(lambda: torch.autograd.graph.saved_tensors_hooks(
            self._pack_hook(saved, OuterHooks(), timed), _unpack))

    def keeps(self, tensor: torch.Tensor, saved: SavedPrecision) -> bool:
        """Whether ``tensor`` is saved as it is (a parameter or a form of one, too small, or no smaller)."""
        if not shrinks(tensor, saved) or tensor.nbytes < self.min_bytes:
            return True
        if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            return True
        if storage_key(tensor) in self._parameters:
            return True
        if self._is_weight_copy is not None and self._is_weight_copy(tensor):
            return True
        if _from_parameter(tensor):
            return True
        return self._defers is not None and self._defers(tensor)

    def _pack_hook(self, saved: SavedPrecision, outer: OuterHooks,
                   timed: tuple[HookTimer, str] | None = None) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            if self.keeps(tensor, saved):
                return outer.hand_on(tensor)
            if timed is None:
                compressed = self._shared_copy(tensor, saved)
            else:
                with timed[0](timed[1]):
                    compressed = self._shared_copy(tensor, saved)
            return _Stored(outer.hand_on(compressed.data), compressed.dtype, compressed.inverse_scale, timed)

        setattr(pack, _MARK, True)
        return pack

    def _shared_copy(self, tensor: torch.Tensor, saved: SavedPrecision) -> CompressedTensor:
        key = (saved, tensor_version(tensor))
        entry = self._shared.get(tensor)
        if entry is not None and key in entry:
            return entry[key]
        compressed = compress(tensor, saved)
        self.compressed_bytes += tensor.nbytes
        self.stored_bytes += compressed.nbytes
        if entry is None:
            entry = {}
            self._shared[tensor] = entry
        entry[key] = compressed
        return compressed


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _Stored):
        stored = CompressedTensor(take_back(saved.data), saved.dtype, saved.inverse_scale)
        if saved.timed is None:
            return decompress(stored)
        with saved.timed[0](saved.timed[1]):
            return decompress(stored)
    return take_back(saved)


class _EnteredHooks:
    """Saved-tensor hooks made when entered, so that they hand on to the hooks in force there (an operator's weight
    recipes, entered just before them), not to those in force when the pre-hook listed its contexts."""

    def __init__(self, make: Callable[[], AbstractContextManager[Any]]) -> None:
        self._make = make
        self._entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        hooks = self._make()
        hooks.__enter__()
        self._entered.append(hooks)

    def __exit__(self, *exc: Any) -> None:
        self._entered.pop().__exit__(*exc)
