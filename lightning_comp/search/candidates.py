"""What the epoch stage trials: an operator's compute precision, the precision of what it saves for backward (or its
recomputation), or the precision of its parameters' optimizer state or master copy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_comp.errors import SearchConfigError
from lightning_comp.plan.dimensions import Dimension

__all__ = ["Candidate", "candidates_from_plain", "candidates_to_plain"]


@dataclass(frozen=True)
class Candidate:
    """One lowering the epoch stage may trial: an operator and the dimension of its plan entry.

    Attributes:
        operator: the operator's name in the plan.
        dimension: which of its precisions is lowered.
    """

    operator: str
    dimension: Dimension = Dimension.COMPUTE

    @classmethod
    def saved(cls, operator: str) -> Candidate:
        """The candidate that lowers what ``operator`` saves for backward."""
        return cls(operator, Dimension.SAVED)

    @classmethod
    def state(cls, operator: str) -> Candidate:
        """The candidate that lowers the optimizer state of ``operator``'s parameters."""
        return cls(operator, Dimension.STATE)

    @classmethod
    def master(cls, operator: str) -> Candidate:
        """The candidate that holds ``operator``'s parameters in bf16 (it lowers the operator's compute with it)."""
        return cls(operator, Dimension.MASTER)

    @property
    def is_saved(self) -> bool:
        """Whether this lowers what the operator saves (rather than what it computes in)."""
        return self.dimension is Dimension.SAVED

    def to_plain(self) -> list[str]:
        """``[operator, dimension]``, as checkpoints hold it."""
        return [self.operator, self.dimension.value]

    @classmethod
    def from_plain(cls, data: Any) -> Candidate:
        """Read :meth:`to_plain`'s form.

        Raises:
            SearchConfigError: on anything else (the checkpoint is inconsistent).
        """
        if isinstance(data, (list, tuple)) and len(data) == 2 and isinstance(data[0], str):
            try:
                return cls(data[0], Dimension(data[1]))
            except ValueError:
                pass
        raise SearchConfigError(f"Malformed CoMPSearch candidate {data!r}: expected [operator, dimension] with a"
                                f" dimension of {[d.value for d in Dimension]}.")

    def __str__(self) -> str:
        return self.operator if self.dimension is Dimension.COMPUTE else f"{self.operator} ({self.dimension.value})"


def candidates_to_plain(candidates: Iterable[Candidate]) -> list[list[str]]:
    """Candidates as checkpoints hold them."""
    return [candidate.to_plain() for candidate in candidates]


def candidates_from_plain(data: Sequence[Any]) -> tuple[Candidate, ...]:
    """Read :func:`candidates_to_plain`'s form."""
    return tuple(Candidate.from_plain(item) for item in data)
