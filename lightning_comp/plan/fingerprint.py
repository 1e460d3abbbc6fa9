"""What a plan was made for: the names and types of a model's operators, in order."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from torch import nn

from lightning_comp.operators.discovery import iter_operators, operator_type

__all__ = ["OperatorFingerprint"]


@dataclass(frozen=True)
class OperatorFingerprint:
    """The names and types of a model's operators, in order: what a plan was made for.

    Only the operators the module tree alone makes (``iter_operators(model, traced=False)``): modules a trace found
    computing between their children depend on the first step, and a plan must fit before it (on resume).

    Attributes:
        operators: ``(name, class name)`` pairs, one per operator.
    """

    operators: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, model: nn.Module) -> OperatorFingerprint:
        """Fingerprint ``model``'s operators."""
        return cls(tuple((name, operator_type(module).__name__)
                         for name, module in iter_operators(model, traced=False)))

    @property
    def digest(self) -> str:
        """A short stable hash of the operator list (16 hex digits)."""
        text = "\n".join(f"{name}:{type_name}" for name, type_name in self.operators)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def difference(self, other: OperatorFingerprint, limit: int = 8) -> str:
        """Describe how ``other`` differs from this fingerprint (missing, extra and re-typed operators)."""
        mine, theirs = dict(self.operators), dict(other.operators)
        missing = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        retyped = [f"{n} ({mine[n]} -> {theirs[n]})" for n in mine if n in theirs and mine[n] != theirs[n]]
        parts = []
        for label, names in (("missing from the model", missing), ("new in the model", extra), ("retyped", retyped)):
            if names:
                shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts) if parts else "same operators"
