"""What autograd keeps for a tensor the recompute hooks pack, and how backward gets the tensor back: :func:`unpack`.

- :class:`Saved`: a reference to a recipe's output (or a view or cast of it, or a view of that cast). While alive it
  wants its form of the outputs (the output or its cast), so that form stays cached from the recomputation until
  autograd dropped the last reference wanting it.
- :class:`Pending`: a placeholder for a non-leaf tensor saved inside a recompute operator's forward, before its
  output exists. The operator's post-hook resolves it: into a :class:`Saved` if the tensor is (a view of) one of the
  outputs, dropping the tensor, else into what the outer saved-tensor hooks packed of it.
- Anything else was handed on to the outer hooks (:mod:`lightning_comp.execution.saved_hooks`).

:func:`timed_unpack` is :func:`unpack` with a timer around each recipe read: the search's measurement of what a
recomputation adds, timed directly rather than as the difference of two whole operators' times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_comp.adapters.torch_internals import tensor_version
from lightning_comp.execution.recompute.recipe import OutputCast, Recipe, View
from lightning_comp.execution.saved_hooks import HookTimer, OuterHooks, take_back

__all__ = ["Pending", "Saved", "timed_unpack", "unpack"]


class Saved:
    """What autograd keeps for a saved tensor that is (a view of) a recipe's output."""

    __slots__ = ("recipe", "stage", "index", "view", "cast")

    def __init__(self, recipe: Recipe, stage: int, index: int, view: View | None,
                 cast: OutputCast | None = None) -> None:
        self.recipe, self.stage, self.index, self.view, self.cast = recipe, stage, index, view, cast
        recipe.want((stage, index, cast))

    def __del__(self) -> None:
        self.recipe.release((self.stage, self.index, self.cast))

    def unpack(self) -> torch.Tensor:
        """The saved tensor, recomputed."""
        made = self.recipe.form((self.stage, self.index, self.cast))
        return made if self.view is None else made.as_strided(*self.view)


class Pending:
    """A tensor saved inside a recompute operator's forward, before its output exists: its post-hook makes it a
    reference to the recipe (if it is one of the outputs) or hands it on to the outer hooks."""

    __slots__ = ("tensor", "version", "outer", "saved")

    def __init__(self, tensor: torch.Tensor, outer: OuterHooks) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor_version(tensor)
        self.outer = outer
        self.saved: Any = None

    def resolve(self, saved: Saved | None) -> None:
        """Keep ``saved`` instead of the tensor (``None``: hand the tensor on to the outer hooks)."""
        tensor, self.tensor = self.tensor, None
        assert tensor is not None
        self.saved = saved if saved is not None else self.outer.hand_on(tensor)

    def unpack(self) -> torch.Tensor:
        """The saved tensor (recomputed, if it was resolved into a recipe's output)."""
        if self.tensor is not None:  # never resolved: the forward raised
            return self.tensor
        if isinstance(self.saved, Saved):
            return self.saved.unpack()
        return take_back(self.saved)  # type: ignore[no-any-return]


def unpack(saved: Any) -> torch.Tensor:
    """The unpack hook of the recompute hooks: the tensor ``saved`` stands for."""
    if isinstance(saved, (Saved, Pending)):
        return saved.unpack()
    return take_back(saved)  # type: ignore[no-any-return]


def timed_unpack(timer: HookTimer) -> Callable[[Any], torch.Tensor]:
    """:func:`unpack`, with ``timer(name)`` entered around each unpack of a recipe's output (the re-run of operator
    ``name``'s forward, or the read of a form already re-run): what a measurement charges to recomputing it."""

    def unpack_timed(saved: Any) -> torch.Tensor:
        recipe = _recipe_of(saved)
        if recipe is None:
            return unpack(saved)
        with timer(recipe.op.name):
            return unpack(saved)

    return unpack_timed


def _recipe_of(saved: Any) -> Recipe | None:
    if isinstance(saved, Pending):
        saved = saved.saved
    return saved.recipe if isinstance(saved, Saved) else None
