"""The recipe of one recorded call of a recompute operator, and its recomputation in backward: :class:`Recipe`.

A recipe holds the operator, the inputs its forward received (after the pre-hook's casts) and what reproduces that
forward (:mod:`lightning_comp.execution.recompute.forward_state`), plus what each output looked like then
(:class:`OutputMeta`). An input is held by reference (:class:`Held`: the operator itself typically saves it too, so
they share its storage), or, where it is itself (a view or cast of) another recipe's output, as that recipe
(:class:`Derived`): in a chain such as BatchNorm -> ReLU -> Conv with both recomputed, only BatchNorm's input stays
stored.

Each output is known at two stages: as the forward returned it (:data:`RAW`) and as the post-hook handed it on
(:data:`FINAL`, cast back to FP32 where the output does not stay low). What a saved tensor is of an output is the
output itself, a view of it, or a cast of it a consumer made (:class:`OutputCast`), or a view of that cast:
recomputing the output and casting it again is the same conversion kernel on the same values, so bit-identical to
the cast made in forward.

:meth:`Recipe.form` recomputes the outputs by calling the operator again under ``torch.no_grad()``, through its
hooks (so it computes in the precision it did in the step). What it keeps is only what backward will ask for again:
each reference saved for backward wants one *form* (an output at a stage, or a cast of it: :data:`FormKey`,
:meth:`Recipe.want`); at the recomputation every wanted form is made at once, the outputs themselves are dropped,
and each form is freed when the last reference wanting it dies (:meth:`Recipe.release`). A LayerNorm output read by
three projections is computed once per backward and freed after the last of them; a GELU whose output only a BF16
projection saves keeps that projection's BF16 cast through backward, not the FP32 output it was cast from as well
(that copy had been held until the projection's backward ended, at the peak of a transformer's step). A recipe
needed only as another recipe's input is computed and dropped (if that input is not itself a wanted form, a recipe
that is also wanted recomputes once more for it: time, not memory). Where the recomputation would be wrong it
raises :class:`~lightning_comp.errors.UsageError`: an input modified in place after
the forward, hooks taken off before backward, an output of another shape, layout or dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_comp.adapters.torch_internals import tensor_version
from lightning_comp.common.nested import tensors
from lightning_comp.errors import PlanError, UsageError
from lightning_comp.execution.recompute.forward_state import AutocastState, RngState, reproduced

__all__ = [
    "FINAL",
    "KEEP_AS_COMPUTED",
    "FormKey",
    "RAW",
    "Derived",
    "Held",
    "OutputCast",
    "OutputMeta",
    "Outputs",
    "Recipe",
    "RecomputedOperator",
    "View",
    "describe",
    "outputs_of",
    "view_of",
]

RAW, FINAL = 0, 1  # an output as the forward returned it / as the post-hook handed it on (cast back to FP32)
View = tuple[torch.Size, tuple[int, ...], int]  # a view of an output: size, stride, storage offset
Outputs = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]  # a call's outputs, by stage then position
KEEP_AS_COMPUTED = "Keep its saved precision as computed ('fp32') in the plan"
_keep_as_computed = KEEP_AS_COMPUTED[0].lower() + KEEP_AS_COMPUTED[1:]


class RecomputedOperator(Protocol):
    """What the recomputer reads of a hooked operator."""

    @property
    def name(self) -> str: ...

    @property
    def module(self) -> nn.Module: ...


def describe(op: RecomputedOperator) -> str:
    """The operator as error messages name it: its name and class."""
    return f"{op.name or '<root>'!r} ({type(op.module).__name__})"


def view_of(tensor: torch.Tensor) -> View:
    """The view ``tensor`` is of its storage: size, stride, storage offset."""
    return tensor.size(), tuple(tensor.stride()), int(tensor.storage_offset())


def outputs_of(op: RecomputedOperator, output: Any) -> list[torch.Tensor | None]:
    """The tensors of a recompute operator's output, by position (``None`` where an item holds no tensor: a Python
    number, ``None``, a string; x-transformers' ``RotaryEmbedding`` returns ``(freqs, 1.0)``).

    Raises:
        PlanError: if the output is not a tensor or a tuple/list of items each a tensor or free of tensors (a tensor
            nested deeper, or in a dict, could not be recomputed).
    """
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)) and all(isinstance(o, torch.Tensor) or not tensors(o) for o in output):
        return [o if isinstance(o, torch.Tensor) else None for o in output]
    raise PlanError(
        f"Operator {describe(op)} saves 'recompute', but its forward returns {type(output).__name__}: only an"
        f" operator returning a tensor, or a tuple or list of tensors (beside values that hold none), can be"
        f" recomputed. {KEEP_AS_COMPUTED}."
    )


@dataclass(frozen=True)
class OutputMeta:
    """What an output looked like, to check its recomputation against and to find tensors saved of it."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    version: int

    @staticmethod
    def of(tensor: torch.Tensor) -> OutputMeta:
        """What ``tensor`` looks like now."""
        return OutputMeta(tensor.size(), tuple(tensor.stride()), int(tensor.storage_offset()), tensor.dtype,
                          tensor_version(tensor))

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has this size, stride, storage offset and dtype."""
        return (tensor.size() == self.size and tuple(tensor.stride()) == self.stride
                and int(tensor.storage_offset()) == self.offset and tensor.dtype == self.dtype)


@dataclass(frozen=True)
class OutputCast:
    """A cast of an output (or of a reshape of it) made outside its operator: by a consumer's autocast region or
    input cast, or by ``.to(dtype)`` in the model's code. Its recomputation casts the recomputed output the same way
    (the same conversion kernel, so bit-identical), into a tensor of the cast's layout."""

    dtype: torch.dtype
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    reshaped: bool  # the cast is of a reshape of the output (to ``size``)

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        """The cast of (recomputed) output ``out``."""
        source = out.reshape(self.size) if self.reshaped else out
        with torch.no_grad():
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device).copy_(source)


#: What a reference saved for backward is of a recipe's outputs, before its view: (stage, position, cast or None).
FormKey = tuple[int, int, "OutputCast | None"]


def _make(outs: Outputs, key: FormKey) -> torch.Tensor:
    """Form ``key`` of a recomputation's outputs ``outs``."""
    stage, index, cast = key
    out = outs[stage][index]
    assert out is not None
    return out if cast is None else cast.apply(out)


@dataclass(frozen=True)
class Held:
    """An input kept by reference (it shares storage with whoever else keeps it), and its version then; with
    ``dtype``, the input is an FP32 copy of ``tensor`` (a lowered output a post-hook cast up), which keeping
    ``tensor`` and casting it again reproduces exactly (:mod:`~lightning_comp.execution.upcast_saving`)."""

    tensor: torch.Tensor
    version: int
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Derived:
    """An input that is (a view of, or a cast of) another recipe's output: recomputed from that recipe instead of
    kept."""

    recipe: Recipe
    stage: int
    index: int
    view: View | None
    cast: OutputCast | None = None

    def value(self) -> torch.Tensor:
        """The input, recomputed."""
        view = self.view
        made = self.recipe.form((self.stage, self.index, self.cast))
        return made if view is None else made.as_strided(*view)


class Recipe:
    """How to recompute the outputs of one call of a recompute operator (see the module docstring).

    Args:
        recomputing: the context in which the recipe's forward is re-run: the step's state as it was in that
            forward, and no bookkeeping (the recomputer's).
        op: the operator.
        args: its positional inputs (:class:`Held` or :class:`Derived` in place of tensors).
        kwargs: its keyword inputs, likewise.
        chained: the low operators whose outputs stayed low in the step.
        regions: how many ``FUNCTIONAL`` operators' autocast regions were open around the call.
        autocast: the autocast state around the call.
        rng: the RNG states the forward started from.
        buffers: copies of the operator's buffers as the forward found them.
        metas: what each output looked like, by stage then position (``None``: not recomputed, e.g. an output
            sharing an input's memory).
    """

    __slots__ = ("recomputing", "op", "args", "kwargs", "chained", "regions", "autocast", "rng", "buffers", "metas",
                 "wanted", "forms", "captured")

    def __init__(self, recomputing: Callable[[Recipe], AbstractContextManager[None]], op: RecomputedOperator,
                 args: Any, kwargs: Any, chained: frozenset[str], regions: int, autocast: AutocastState,
                 rng: RngState | None, buffers: dict[str, torch.Tensor],
                 metas: tuple[list[OutputMeta | None], list[OutputMeta | None]]) -> None:
        self.recomputing = recomputing
        self.op = op
        self.args, self.kwargs = args, kwargs
        self.chained = chained
        self.regions = regions
        self.autocast = autocast
        self.rng = rng
        self.buffers = buffers
        self.metas = metas
        self.wanted: dict[FormKey, int] = {}  # form -> references saved for backward alive now that want it
        self.forms: dict[FormKey, torch.Tensor] = {}  # the wanted forms, once recomputed
        self.captured: Outputs | None = None  # set by the operator's post-hook while it is re-run

    def version(self, stage: int, index: int) -> int:
        """The version output ``index`` had at ``stage`` (``-1``: it is not recomputed)."""
        meta = self.metas[stage][index]
        return -1 if meta is None else meta.version

    def dtype(self, stage: int, index: int) -> torch.dtype | None:
        """The dtype of output ``index`` at ``stage`` (``None``: it is not recomputed)."""
        meta = self.metas[stage][index]
        return None if meta is None else meta.dtype

    def want(self, key: FormKey) -> None:
        """A reference saved for backward wants form ``key``: it is kept from the recomputation until released."""
        self.wanted[key] = self.wanted.get(key, 0) + 1

    def release(self, key: FormKey) -> None:
        """A reference saved for backward that wanted form ``key`` died: free the form once none wants it."""
        left = self.wanted.get(key, 0) - 1
        if left > 0:
            self.wanted[key] = left
        else:
            self.wanted.pop(key, None)
            self.forms.pop(key, None)

    def form(self, key: FormKey) -> torch.Tensor:
        """Form ``key`` of the outputs (recomputed once while references wanting forms are alive; see the module
        docstring)."""
        made = self.forms.get(key)
        if made is not None:
            return made
        stage, index, cast = key
        base = self.forms.get((stage, index, None))
        if base is not None and cast is not None:  # a cast of a form kept anyway: no recomputation
            return cast.apply(base)
        outs = self._recompute()
        for wanted in self.wanted:
            if wanted not in self.forms:
                self.forms[wanted] = _make(outs, wanted)
        made = self.forms.get(key)
        return made if made is not None else _make(outs, key)

    def _inputs(self) -> tuple[Any, Any]:
        def get(item: Held | Derived) -> torch.Tensor:
            if isinstance(item, Derived):
                return item.value()
            now = tensor_version(item.tensor)
            if now != item.version:
                raise UsageError(
                    f"Operator {describe(self.op)} saves 'recompute', but an input it keeps to recompute its output"
                    f" in backward was modified in place after its forward (version {item.version} -> {now}), so"
                    f" its output can no longer be recomputed. {KEEP_AS_COMPUTED}, or do not modify that tensor in"
                    " place before backward."
                )
            return item.tensor if item.dtype is None else item.tensor.to(item.dtype)

        return (apply_to_collection(self.args, (Held, Derived), get),
                apply_to_collection(self.kwargs, (Held, Derived), get))

    def _recompute(self) -> Outputs:
        args, kwargs = self._inputs()
        module = self.op.module
        with reproduced(module, self.rng, self.autocast, self.buffers), self.recomputing(self):
            module(*args, **kwargs)
        captured, self.captured = self.captured, None
        if captured is None:
            raise UsageError(
                f"Operator {describe(self.op)} saves 'recompute', but its plan's hooks were taken off between its"
                " forward and backward, so its output cannot be recomputed in the precision it was computed in."
                f" Run backward before removing or changing the plan, or {_keep_as_computed}."
            )
        for stage in (RAW, FINAL):
            for meta, out in zip(self.metas[stage], captured[stage]):
                if meta is not None and (out is None or not meta.matches(out)):
                    raise UsageError(
                        f"Operator {describe(self.op)} saves 'recompute', but recomputing it in backward gave an"
                        f" output of another shape, layout or dtype than its forward ({meta.dtype}"
                        f" {tuple(meta.size)} expected). Its forward depends on more than its inputs, RNG and"
                        f" buffers: {_keep_as_computed}."
                    )
        return captured
