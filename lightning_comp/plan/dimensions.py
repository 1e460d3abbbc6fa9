"""The dimensions of a plan, and the assignment of one dimension's values to a model's operators.

A plan decides, per operator, one value in each :class:`Dimension`:

=============  ===========================================  ===================================================
dimension      its values                                   what it decides
=============  ===========================================  ===================================================
``compute``    :class:`ComputePrecision` (fp32/bf16/fp16)   the precision the operator computes in
``saved``      :class:`SavedPrecision` (fp32/bf16/fp8/...)  how the tensors it saves for backward are stored
``state``      :class:`StatePrecision` (fp32/bf16/8bit)     the optimizer state of the parameters it owns
``master``     :class:`MasterPrecision` (fp32/bf16)         the master copy of the parameters it owns
=============  ===========================================  ===================================================

Every dimension's ``fp32`` value means "as FP32 training does it"; an :class:`Assignment` holds one dimension's
``selector -> value`` entries and default. A new dimension is a new member here plus its value enum: plans, their
file format, the search's configuration, state and record are keyed by :class:`Dimension` and follow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

from torch import nn

from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.errors import CoMPError, PlanError
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.plan.selectors import Selectors, check_selector

__all__ = ["DEFAULT_DECIDER", "Assignment", "Dimension", "DimensionValue"]

DimensionValue = Union[ComputePrecision, SavedPrecision, StatePrecision, MasterPrecision]  # noqa: UP007 (runtime alias)
DEFAULT_DECIDER = "<default>"  # what :meth:`Assignment.decider` names when no entry matches


class Dimension(SpelledEnum):
    """One dimension of a plan: a question the plan answers for every operator."""

    COMPUTE = "compute"
    SAVED = "saved"
    STATE = "state"
    MASTER = "master"

    @classmethod
    def noun(cls) -> str:
        return "plan dimension"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return PlanError

    @property
    def values(self) -> type[SpelledEnum]:
        """The enum of this dimension's values."""
        return _VALUES[self]

    @property
    def fp32(self) -> DimensionValue:
        """The value that changes nothing from FP32 training (every value enum's ``FP32``)."""
        return self.values("fp32")  # type: ignore[return-value]

    @property
    def what(self) -> str:
        """What a value of this dimension is, for messages (``"saved precision"``)."""
        return _WHAT[self]

    def parse_value(self, value: object) -> DimensionValue:
        """The value of this dimension ``value`` spells.

        Raises:
            PlanError: naming ``value`` and this dimension's valid values (the value enum's own error).
        """
        return self.values.parse(value)  # type: ignore[return-value]


_VALUES: dict[Dimension, type[SpelledEnum]] = {
    Dimension.COMPUTE: ComputePrecision,
    Dimension.SAVED: SavedPrecision,
    Dimension.STATE: StatePrecision,
    Dimension.MASTER: MasterPrecision,
}
_WHAT = {
    Dimension.COMPUTE: "compute precision",
    Dimension.SAVED: "saved precision",
    Dimension.STATE: "optimizer-state precision",
    Dimension.MASTER: "master-weight precision",
}


@dataclass(frozen=True)
class Assignment:
    """One dimension's values for a model's operators: ``selector -> value`` entries and a default.

    Selectors and their precedence are those of :mod:`lightning_comp.plan.selectors`; any entry beats the default.

    Attributes:
        dimension: the dimension assigned.
        entries: ``(selector, value)`` pairs, sorted by selector, each value parsed into the dimension's enum.
        default: the value of every operator no entry matches (``None``: the dimension's ``fp32``).
    """

    dimension: Dimension
    entries: tuple[tuple[str, Any], ...] = ()
    default: Any = None

    def __post_init__(self) -> None:
        dimension = Dimension.parse(self.dimension)
        object.__setattr__(self, "dimension", dimension)
        raw: Any = self.entries
        if not isinstance(raw, Mapping):
            try:
                raw = dict(raw)
            except (TypeError, ValueError):
                raise PlanError(
                    f"Plan {dimension.value} entries must be a mapping of selector -> {dimension.what},"
                    f" got {self.entries!r}."
                ) from None
        entries = []
        for selector, value in raw.items():
            check_selector(selector)
            try:
                entries.append((selector, dimension.parse_value(value)))
            except PlanError as err:
                raise PlanError(f"Plan entry {selector!r}: {err}") from None
        object.__setattr__(self, "entries", tuple(sorted(entries)))
        try:
            default = dimension.fp32 if self.default is None else dimension.parse_value(self.default)
        except PlanError as err:
            raise PlanError(f"Plan {dimension.value} default: {err}") from None
        object.__setattr__(self, "default", default)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.dimension, self.entries, self.default))

    @functools.cached_property
    def _lookup(self) -> dict[str, Any]:
        return dict(self.entries)

    @functools.cached_property
    def selectors(self) -> Selectors:
        """The selectors of the entries."""
        return Selectors(tuple(selector for selector, _ in self.entries))

    def of(self, name: str, module_type: type | None = None) -> Any:
        """The value of the operator called ``name`` (of class ``module_type``, for type selectors)."""
        selector = self.selectors.match(name, module_type)
        return self.default if selector is None else self._lookup[selector]

    def decider(self, name: str, module_type: type | None = None) -> str:
        """The selector that decides the operator's value (:data:`DEFAULT_DECIDER` if none)."""
        selector = self.selectors.match(name, module_type)
        return DEFAULT_DECIDER if selector is None else selector

    def explain(self, model: nn.Module) -> dict[str, str]:
        """For every operator of ``model``, the selector that decided its value."""
        return {name: self.decider(name, type(module)) for name, module in iter_operators(model)}

    def values(self) -> Iterator[Any]:
        """Every value the assignment uses: the default, then each entry's."""
        yield self.default
        for _, value in self.entries:
            yield value

    @functools.cached_property
    def changes(self) -> bool:
        """Whether any operator gets a value other than the dimension's ``fp32``."""
        fp32 = self.dimension.fp32
        return any(value is not fp32 for value in self.values())

    def updated(self, updates: Mapping[str, Any], default: object | None = None) -> Assignment:
        """A copy with ``updates`` added or overriding entries of the same selector, and ``default`` if given."""
        merged = dict(self.entries)
        merged.update(Assignment(self.dimension, tuple(updates.items())).entries)
        return Assignment(self.dimension, tuple(merged.items()), self.default if default is None else default)

    def to_dict(self) -> dict[str, str]:
        """The entries as plain ``{selector: value}``."""
        return {selector: value.value for selector, value in self.entries}
