"""Operators that play the same part in repeated blocks, decided as one: :class:`OperatorGroup`.

A transformer's blocks, a ResNet's stages and an encoder's layers repeat one block many times. The operators at the
same place of each repeat (``blocks.0.attn.qkv``, ``blocks.1.attn.qkv``, ...) do the same work on the same shapes,
so they deserve the same decision: measured alone, each would draw its own noise, and a plan deciding them apart
would tell its reader chance, not structure. :func:`group_operators` puts them in one group when they have

- the same path once every numeric part is abstracted (``blocks.*.attn.qkv``),
- the same class, and
- the same configuration (the module's ``extra_repr``: features, kernel sizes, ``p`` of a dropout) and parameter
  shapes.

A group is measured with its members' rounds pooled (the per-round sum of their times), decided once, trialled once
and written in the plan as one selector: the glob of its path where that glob names exactly its members among the
model's operators, else its members' names. A group of one is the operator as before.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["OperatorGroup", "abstract_path", "group_operators", "pooled_series"]


def abstract_path(name: str) -> str:
    """``name`` with every numeric part replaced by ``*`` (``blocks.3.attn.qkv`` -> ``blocks.*.attn.qkv``)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _signature(name: str, module: nn.Module) -> tuple[object, ...]:
    """What two operators must share to play the same part: abstracted path, class, configuration, parameters."""
    kind = type(module)
    shapes = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
    try:
        config = module.extra_repr()
    except Exception:  # a user module whose extra_repr fails: its class and parameters still tell
        config = ""
    return abstract_path(name), f"{kind.__module__}.{kind.__qualname__}", config, shapes


@dataclass(frozen=True)
class OperatorGroup:
    """Operators that play the same part in repeated blocks.

    Attributes:
        members: the operators, in execution order.
        pattern: their path with the numeric parts abstracted (the member's name for a group of one).
        exact_glob: whether ``pattern`` names exactly the members among the model's operators (then the plan writes
            it as one selector).
    """

    members: tuple[str, ...]
    pattern: str
    exact_glob: bool = False

    @property
    def size(self) -> int:
        """How many operators it holds."""
        return len(self.members)

    @property
    def selectors(self) -> tuple[str, ...]:
        """How a plan names the group: its glob where that is exact, else its members."""
        return (self.pattern,) if self.exact_glob else self.members

    @property
    def label(self) -> str:
        """How the record names it: its pattern, with the member count for a group of several."""
        return self.pattern if self.size == 1 else f"{self.pattern} (x{self.size})"


def group_operators(names: Sequence[str], modules: Mapping[str, nn.Module],
                    all_names: Iterable[str] | None = None) -> list[OperatorGroup]:
    """The groups of ``names`` (each operator in exactly one), in the order of their first member.

    Args:
        names: the operators to group, in execution order.
        modules: the model's operators by name (at least ``names``).
        all_names: every operator name of the model (default: ``modules``' keys): a group's glob is used as its
            selector only where it matches no operator outside the group.
    """
    everyone = list(modules if all_names is None else all_names)
    by_signature: dict[tuple[object, ...], list[str]] = {}
    for name in names:
        by_signature.setdefault(_signature(name, modules[name]), []).append(name)
    groups: list[OperatorGroup] = []
    for members in by_signature.values():
        pattern = abstract_path(members[0]) if len(members) > 1 else members[0]
        exact = len(members) > 1 and sorted(n for n in everyone if fnmatch.fnmatchcase(n, pattern)) == sorted(members)
        groups.append(OperatorGroup(tuple(members), pattern, exact))
    return groups


def pooled_series(series: Iterable[Sequence[float]]) -> list[float]:
    """The per-round sum of several operators' per-round times (rounds paired across them)."""
    rows = list(series)
    if not rows:
        return []
    return [float(sum(values)) for values in zip(*rows, strict=True)]
