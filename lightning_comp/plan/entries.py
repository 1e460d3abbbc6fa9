"""The entries users write: ``{selector: value}``, where a value is a compute precision or a mapping that sets several
dimensions (``{"compute": "bf16", "saved": "fp8", "state": "8bit", "master": "bf16"}``), split into one
``{selector: value}`` mapping per :class:`~lightning_comp.plan.dimensions.Dimension`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_comp.errors import PlanError
from lightning_comp.plan.dimensions import Dimension

__all__ = ["split_defaults", "split_entries"]


def _dimension_choices() -> str:
    return ", ".join(f"{d.value!r} ({'/'.join(v.value for v in d.values)})" for d in Dimension)


def _split_value(where: str, value: Any) -> dict[Dimension, Any]:
    """One entry's value (or a plan's default) as ``{dimension: value}``; a bare value is a compute precision."""
    if not isinstance(value, Mapping):
        return {Dimension.COMPUTE: value}
    unknown = [str(k) for k in value if not isinstance(k, Dimension) and Dimension._missing_(k) is None]
    if unknown or not value:
        raise PlanError(
            f"{where}: {dict(value)!r} is not a precision; a value that sets several dimensions is a mapping with"
            f" the keys {_dimension_choices()}" + (f", not {sorted(unknown)}." if unknown else ".")
        )
    return {Dimension.parse(k): v for k, v in value.items()}


def split_entries(mapping: Mapping[str, Any]) -> dict[Dimension, dict[str, Any]]:
    """Split ``{selector: precision | {dimension: value, ...}}`` into one ``{selector: value}`` per dimension.

    Raises:
        PlanError: if ``mapping`` is not a mapping, or an entry's mapping names no dimension or an unknown one.
    """
    if not isinstance(mapping, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {type(mapping).__name__}.")
    split: dict[Dimension, dict[str, Any]] = {dimension: {} for dimension in Dimension}
    for selector, value in mapping.items():
        for dimension, one in _split_value(f"Plan entry {selector!r}", value).items():
            split[dimension][selector] = one
    return split


def split_defaults(default: Any) -> dict[Dimension, Any]:
    """A plan's default, a compute precision or ``{dimension: value, ...}``, as ``{dimension: value}``."""
    return _split_value("Plan default", default)
