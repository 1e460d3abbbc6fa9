"""Parsing a plan's entries: selectors to compute precisions, to saved precisions, to optimizer-state precisions and
to master-weight precisions, and the combined form ``{selector: {"compute": ..., "saved": ..., "state": ...,
"master": ...}}`` users may write."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_comp.errors import PlanError
from lightning_comp.numerics.precision import (
    ComputePrecision,
    MasterPrecision,
    SavedPrecision,
    StatePrecision,
    parse_precision,
    parse_saved_precision,
)
from lightning_comp.plan.selectors import check_selector

__all__ = ["DIMENSIONS", "as_mapping", "parse_entries", "parse_master", "parse_saved", "parse_state", "split_entries"]

DIMENSIONS = ("compute", "saved", "state", "master")  # the keys of an entry that sets several dimensions


def parse_entries(mapping: Mapping[str, Any]) -> tuple[tuple[str, ComputePrecision], ...]:
    """``{selector: compute precision}`` as sorted, validated pairs.

    Raises:
        PlanError: naming a malformed selector or the entry with an unknown precision.
    """
    return _parse(mapping, parse_precision, "precision")


def parse_saved(mapping: Mapping[str, Any]) -> tuple[tuple[str, SavedPrecision], ...]:
    """``{selector: saved precision}`` as sorted, validated pairs.

    Raises:
        PlanError: naming a malformed selector or the entry with an unknown saved precision.
    """
    return _parse(mapping, parse_saved_precision, "saved precision")


def parse_state(mapping: Mapping[str, Any]) -> tuple[tuple[str, StatePrecision], ...]:
    """``{selector: optimizer-state precision}`` as sorted, validated pairs.

    Raises:
        PlanError: naming a malformed selector or the entry with an unknown optimizer-state precision.
    """
    return _parse(mapping, StatePrecision.parse, "optimizer-state precision")


def parse_master(mapping: Mapping[str, Any]) -> tuple[tuple[str, MasterPrecision], ...]:
    """``{selector: master-weight precision}`` as sorted, validated pairs.

    Raises:
        PlanError: naming a malformed selector or the entry with an unknown master-weight precision.
    """
    return _parse(mapping, MasterPrecision.parse, "master-weight precision")


def _parse(mapping: Mapping[str, Any], parse: Callable[[object], Any], what: str) -> tuple[tuple[str, Any], ...]:
    if not isinstance(mapping, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> {what}, got {type(mapping).__name__}.")
    entries = []
    for selector, value in mapping.items():
        check_selector(selector)
        try:
            entries.append((selector, parse(value)))
        except PlanError as err:
            raise PlanError(f"Plan entry {selector!r}: {err}") from None
    return tuple(sorted(entries))


def split_entries(mapping: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Split ``{selector: precision | {"compute": ..., "saved": ..., "state": ..., "master": ...}}`` into one
    ``{selector: value}`` mapping per dimension (keys of :data:`DIMENSIONS`)."""
    if not isinstance(mapping, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {type(mapping).__name__}.")
    split: dict[str, dict[str, Any]] = {dimension: {} for dimension in DIMENSIONS}
    for selector, value in mapping.items():
        if not isinstance(value, Mapping):
            split["compute"][selector] = value
            continue
        unknown = set(value) - set(DIMENSIONS)
        if unknown or not value:
            raise PlanError(
                f"Plan entry {selector!r}: {dict(value)!r} is not a precision; an entry that sets several dimensions"
                " is a mapping with the keys 'compute' (fp32/bf16/fp16), 'saved' (fp32/bf16/fp8/recompute), 'state'"
                " (fp32/bf16/8bit: optimizer state) and/or 'master' (fp32/bf16: master weights)"
                + (f", not {sorted(unknown)}." if unknown else ".")
            )
        for dimension in DIMENSIONS:
            if dimension in value:
                split[dimension][selector] = value[dimension]
    return split


def as_mapping(entries: Any) -> Mapping[str, Any]:
    """Entries given as a mapping or as ``(selector, value)`` pairs, as a mapping."""
    if isinstance(entries, Mapping):
        return entries
    try:
        return dict(entries)
    except (TypeError, ValueError):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {entries!r}.") from None
