"""Selectors: how plans, ``CoMPSearch(include=..., exclude=...)`` and users name operators.

A selector is one of:

- an exact operator name, as in ``named_modules()`` (``"encoder.layers.0.linear1"``);
- a glob pattern over operator names (any selector containing ``*``, ``?`` or ``[``: ``"encoder.*.linear?"``);
- a type selector ``"type:ClassName"`` matching operators whose class, or any base class, has that name
  (``"type:Linear"``, ``"type:_ConvNd"``).

Precedence when several match one operator: an exact name beats a glob, a glob beats a type selector. Among
several matching globs the longest pattern wins; among type selectors, the class nearest in the MRO wins.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lightning_comp.errors import PlanError, PlanMismatchError
from lightning_comp.operators.discovery import iter_operators, iter_untraced_containers

__all__ = ["Selectors", "check_selector", "selector_kind"]

TYPE_PREFIX = "type:"
_GLOB_CHARS = frozenset("*?[")


def selector_kind(selector: str) -> str:
    """``"exact"``, ``"glob"`` or ``"type"``."""
    if selector.startswith(TYPE_PREFIX):
        return "type"
    if _GLOB_CHARS.intersection(selector):
        return "glob"
    return "exact"


def check_selector(selector: object) -> str:
    """Return ``selector`` if it is well formed.

    Raises:
        PlanError: naming the selector and the forms that are valid.
    """
    if not isinstance(selector, str):
        raise PlanError(f"Plan selector {selector!r} must be a string: an operator name, a glob or 'type:ClassName'.")
    if selector.startswith(TYPE_PREFIX) and not selector[len(TYPE_PREFIX) :].isidentifier():
        raise PlanError(f"Type selector {selector!r} must name a class, e.g. 'type:Linear' or 'type:_ConvNd'.")
    return selector


@dataclass(frozen=True)
class Selectors:
    """An immutable set of selectors (see the module docstring), matched against operators by precedence.

    Attributes:
        selectors: the selectors, sorted.
    """

    selectors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "selectors", tuple(sorted({check_selector(s) for s in self.selectors})))

    @classmethod
    def of(cls, selectors: Iterable[str] | None) -> Selectors:
        """Build from any iterable of selectors (a single string is refused: it would iterate over characters).

        Raises:
            PlanError: on a string instead of a list, or a malformed selector.
        """
        if selectors is None:
            return cls()
        if isinstance(selectors, str):
            raise PlanError(f"Selectors must be a list of selectors, not the single string {selectors!r}.")
        return cls(tuple(selectors))

    def __bool__(self) -> bool:
        return bool(self.selectors)

    def __iter__(self) -> Iterable[str]:  # type: ignore[override]
        return iter(self.selectors)

    def match(self, name: str, module_type: type | None = None) -> str | None:
        """The selector that decides operator ``name`` (of class ``module_type``), or ``None`` if none matches."""
        if name in self.selectors and selector_kind(name) == "exact":
            return name
        globs = [s for s in self.selectors if selector_kind(s) == "glob" and fnmatch.fnmatchcase(name, s)]
        if globs:
            return max(globs, key=lambda s: (len(s), s))
        if module_type is not None:
            for klass in module_type.__mro__:
                selector = TYPE_PREFIX + klass.__name__
                if selector in self.selectors:
                    return selector
        return None

    def matches(self, name: str, module: nn.Module | type | None = None) -> bool:
        """Whether any selector matches operator ``name`` (``module``: the operator or its class)."""
        module_type = module if isinstance(module, type) or module is None else type(module)
        return self.match(name, module_type) is not None

    def unmatched(self, model: nn.Module) -> list[str]:
        """The selectors that match no operator of ``model``.

        A selector that matches only containers not traced yet (which may turn out to compute between their
        children, see :mod:`lightning_comp.operators.owned_work`) is not reported until the trace has run.
        """
        operators = list(iter_operators(model))
        untraced = list(iter_untraced_containers(model))
        return [s for s in self.selectors if not _hits(s, operators) and not _hits(s, untraced)]

    def validate(self, model: nn.Module, what: str = "plan entr") -> None:
        """Check every selector matches an operator of ``model``.

        Args:
            model: the model.
            what: how the message names the selectors (``"plan entr"`` gives "plan entry"/"plan entries").

        Raises:
            PlanMismatchError: naming each unmatched selector, close operator names, and the model's operators.
        """
        unmatched = self.unmatched(model)
        if not unmatched:
            return
        names = [name for name, _ in iter_operators(model)]
        details = []
        for selector in unmatched:
            close = difflib.get_close_matches(selector, names, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            details.append(f"{selector!r}{hint}")
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise PlanMismatchError(
            f"{len(unmatched)} {what}{'y matches' if len(unmatched) == 1 else 'ies match'} no operator of"
            f" {type(model).__name__}: {'; '.join(details)}. The model's operators are: {shown or '(none)'}."
        )


def _hits(selector: str, modules: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``selector`` matches any of ``modules`` (``(name, module)`` pairs)."""
    kind = selector_kind(selector)
    if kind == "exact":
        return any(name == selector for name, _ in modules)
    if kind == "glob":
        return any(fnmatch.fnmatchcase(name, selector) for name, _ in modules)
    wanted = selector[len(TYPE_PREFIX) :]
    return any(wanted in {k.__name__ for k in type(m).__mro__} for _, m in modules)
