"""What the epoch stage trials: an operator's compute precision (the searched 16-bit one, or fp8 on top of it), the
precision of what it saves for backward (or its recomputation), or the precision of its parameters' optimizer state or
master copy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_comp.errors import SearchConfigError
from lightning_comp.plan.dimensions import Dimension

__all__ = ["FP8_LEVER", "LEVERS", "Candidate", "candidates_from_plain", "candidates_to_plain"]

#: How an fp8 candidate is spelled where a dimension would be (checkpoints, messages).
FP8_LEVER = "fp8"
#: The levers a candidate may pull, in the order group testing splits a failing group by them: the compute lowering,
#: fp8 on top of it, then the memory dimensions.
LEVERS = (Dimension.COMPUTE.value, FP8_LEVER, Dimension.SAVED.value, Dimension.STATE.value, Dimension.MASTER.value)


@dataclass(frozen=True)
class Candidate:
    """One lowering the epoch stage may trial: an operator and the dimension of its plan entry.

    Attributes:
        operator: the operator's name in the plan.
        dimension: which of its precisions is lowered.
        fp8: (compute) the operator computes in fp8 rather than in the searched 16-bit precision: a lever of its own,
            so an fp8 lowering that breaks convergence is dropped without the operator's 16-bit one (it is demoted
            to bf16, not to FP32).
    """

    operator: str
    dimension: Dimension = Dimension.COMPUTE
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.fp8 and self.dimension is not Dimension.COMPUTE:
            raise SearchConfigError(f"An fp8 candidate lowers compute, not {self.dimension.value!r} ({self.operator}).")

    @classmethod
    def in_fp8(cls, operator: str) -> Candidate:
        """The candidate that computes ``operator`` in fp8 (on top of its 16-bit compute candidate)."""
        return cls(operator, Dimension.COMPUTE, fp8=True)

    @property
    def lever(self) -> str:
        """What it lowers: the dimension's name, or ``"fp8"`` for an fp8 compute candidate (see :data:`LEVERS`)."""
        return FP8_LEVER if self.fp8 else self.dimension.value

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
        """``[operator, lever]`` (a dimension, or ``"fp8"``), as checkpoints hold it."""
        return [self.operator, self.lever]

    @classmethod
    def from_plain(cls, data: Any) -> Candidate:
        """Read :meth:`to_plain`'s form.

        Raises:
            SearchConfigError: on anything else (the checkpoint is inconsistent).
        """
        if isinstance(data, (list, tuple)) and len(data) == 2 and isinstance(data[0], str):
            if data[1] == FP8_LEVER:
                return cls.in_fp8(data[0])
            try:
                return cls(data[0], Dimension(data[1]))
            except ValueError:
                pass
        raise SearchConfigError(f"Malformed CoMPSearch candidate {data!r}: expected [operator, lever] with a lever"
                                f" of {list(LEVERS)}.")

    def __str__(self) -> str:
        return self.operator if self.lever == Dimension.COMPUTE.value else f"{self.operator} ({self.lever})"


def candidates_to_plain(candidates: Iterable[Candidate]) -> list[list[str]]:
    """Candidates as checkpoints hold them."""
    return [candidate.to_plain() for candidate in candidates]


def candidates_from_plain(data: Sequence[Any]) -> tuple[Candidate, ...]:
    """Read :func:`candidates_to_plain`'s form."""
    return tuple(Candidate.from_plain(item) for item in data)
