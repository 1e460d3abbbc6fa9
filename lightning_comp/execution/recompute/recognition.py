"""Which recipe output a tensor autograd saves is: :class:`RecordedOutputs` and :func:`match_in_forward`.

A tensor saved in a training step is recognised as a recorded output of a recompute operator X (unchanged since: its
version is the one the output had) when it is:

- the output itself (by identity), or a view of it (sharing its base, of its dtype);
- a *cast* of it: a new tensor a consumer made of X's output with ``.to(dtype)``, an autocast region or its
  pre-hook's input cast, whose autograd node is a cast (:func:`~lightning_comp.adapters.torch_internals.is_cast_node`)
  with a single input, the node of one of X's recorded outputs or of a reshape of one (views that only reshape,
  from ``Flatten``/``view``/``reshape``, followed up to :data:`MAX_RESHAPES` deep), of the same shape (element count
  through reshapes) and device, neither it nor the output modified in place since; or a view of such a cast.

Casts are what consumers save in the first (calibrating) step of a plan, where every lowered operator's output is
handed on in FP32 and the next 16-bit operator casts it down again, and in any step where an FP32 recompute operator
feeds a 16-bit consumer; recognising them, a compressing consumer never stores a recompute output lossy in one step
and recomputes it exactly in another (a resumed run's calibrating step is bit-identical to the uninterrupted run's
calibrated one). The output is found from the cast's node through a weak reference: a cast saved after the output
itself died (``act(h).to(torch.bfloat16)`` kept in a variable and saved later) is stored as it is, and so is a cast
of any other view of it (a transpose, a slice) and a cast of an output that needs no gradient (it has no autograd
node).

Inside X's forward its output does not exist yet: :func:`match_in_forward` tells, at X's post-hook, which of the
outputs a tensor saved inside it turned out to be.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_comp.adapters.torch_internals import (
    autograd_output,
    is_cast_node,
    is_reshape_node,
    node_inputs,
    node_key,
    tensor_base,
    tensor_version,
)
from lightning_comp.execution.recompute.recipe import FINAL, OutputCast, OutputMeta, Recipe, View, view_of

__all__ = ["MAX_RESHAPES", "Found", "RecordedOutputs", "match_in_forward"]

MAX_RESHAPES = 4  # reshape nodes followed from a cast towards an output
#: A recognised tensor: the recipe, the stage and index of its output, the view of it (or of the cast), the cast.
Found = tuple[Recipe, int, int, View | None, OutputCast | None]


@dataclass(frozen=True)
class _NodeOutput:
    """An output of a recipe, as found from the autograd node of a cast of it (the output is weakly held: it may
    die before a cast of it is saved, and is then no longer recognised)."""

    output_nr: int
    output: weakref.ref[torch.Tensor]
    recipe: Recipe
    index: int


class RecordedOutputs:
    """The outputs of the recipes recorded in one step's forward, as their post-hooks handed them on (held weakly)."""

    def __init__(self) -> None:
        self._outputs: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # output -> (recipe, index)
        self._view_bases: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # base of a view output -> [...]
        self._nodes: dict[int, list[_NodeOutput]] = {}  # an output's autograd node's key -> [...]

    def add(self, recipe: Recipe, index: int, out: torch.Tensor) -> None:
        """Record ``out``, the final output ``index`` of ``recipe``."""
        self._outputs[out] = (recipe, index)
        node, output_nr = autograd_output(out)
        if node is not None:  # (casts of it are found from their autograd node)
            self._nodes.setdefault(node_key(node), []).append(
                _NodeOutput(output_nr, weakref.ref(out), recipe, index))
        base = tensor_base(out)
        if base is not out:
            entries = self._view_bases.get(base)
            if entries is None:
                self._view_bases[base] = entries = []
            entries.append((recipe, index))

    def find(self, tensor: torch.Tensor) -> Found | None:
        """The recipe output ``tensor`` is (or is a view of, or a cast of, or a view of a cast of), unchanged
        since; ``None`` if none."""
        entry = self._outputs.get(tensor)
        if entry is not None:
            recipe, index = entry
            if tensor_version(tensor) == recipe.version(FINAL, index):
                return recipe, FINAL, index, None, None
            return None
        base = tensor_base(tensor)
        if base is not tensor:
            entry = self._outputs.get(base)
            candidates = [entry] if entry is not None else self._view_bases.get(base, [])
            version = tensor_version(tensor)
            for recipe, index in candidates:
                if recipe.dtype(FINAL, index) == tensor.dtype and recipe.version(FINAL, index) == version:
                    return recipe, FINAL, index, view_of(tensor), None
            if candidates:
                return None
        return self._find_cast(tensor, base) if self._nodes else None

    def _find_cast(self, tensor: torch.Tensor, cast: torch.Tensor) -> Found | None:
        """The recipe output ``cast`` (``tensor``'s base) is a cast of, possibly through reshapes, made while both
        were unchanged (neither modified in place since); ``None`` if none."""
        fn, _ = autograd_output(cast)
        if fn is None or not is_cast_node(fn) or tensor_version(cast) != 0 or cast.layout is not torch.strided \
                or int(cast.storage_offset()) != 0:
            return None
        edges = node_inputs(fn)
        reshaped = False
        for _ in range(MAX_RESHAPES + 1):
            node, output_nr = edges[0] if len(edges) == 1 else (None, 0)
            if node is None:
                return None
            for entry in self._nodes.get(node_key(node), ()):
                out = entry.output()
                if out is None or entry.output_nr != output_nr or autograd_output(out)[0] is not node \
                        or tensor_version(out) != entry.recipe.version(FINAL, entry.index) \
                        or out.device != cast.device \
                        or (out.numel() != cast.numel() if reshaped else out.size() != cast.size()):
                    continue
                made = OutputCast(cast.dtype, cast.device, cast.size(), tuple(cast.stride()), reshaped)
                return entry.recipe, FINAL, entry.index, None if tensor is cast else view_of(tensor), made
            if not is_reshape_node(node):
                return None
            edges, reshaped = node_inputs(node), True
        return None


def match_in_forward(tensor: torch.Tensor, version: int, stages: tuple[tuple[int, list[torch.Tensor | None]], ...],
                     metas: tuple[list[OutputMeta | None], list[OutputMeta | None]],
                     ) -> tuple[int, int, View | None] | None:
    """Which output (stage, index, view) ``tensor``, saved inside the forward at ``version``, is, unchanged since;
    ``None``: none."""
    for stage, outs in stages:
        for index, out in enumerate(outs):
            meta = metas[stage][index]
            if out is tensor and meta is not None and meta.version == version:
                return stage, index, None
    base = tensor_base(tensor)
    for stage, outs in stages:
        for index, out in enumerate(outs):
            meta = metas[stage][index]
            if out is None or meta is None or meta.dtype != tensor.dtype or meta.version != version:
                continue
            if base is out or (base is not tensor and tensor_base(out) is base):
                return stage, index, view_of(tensor)
    return None
