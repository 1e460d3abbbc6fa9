"""Parsing a plan's entries: selectors to compute precisions, selectors to saved precisions, and the combined form
``{selector: {"compute": ..., "saved": ...}}`` users may write."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_comp.errors import PlanError
from lightning_comp.numerics.precision import Precision, SavedPrecision, parse_precision, parse_saved_precision
from lightning_comp.plan.selectors import check_selector

__all__ = ["as_mapping", "parse_entries", "parse_saved", "split_entries"]

_ENTRY_KEYS = ("compute", "saved")


def parse_entries(mapping: Mapping[str, Any]) -> tuple[tuple[str, Precision], ...]:
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


def split_entries(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``{selector: precision | {"compute": ..., "saved": ...}}`` into compute and saved entries."""
    if not isinstance(mapping, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {type(mapping).__name__}.")
    compute: dict[str, Any] = {}
    saved: dict[str, Any] = {}
    for selector, value in mapping.items():
        if not isinstance(value, Mapping):
            compute[selector] = value
            continue
        unknown = set(value) - set(_ENTRY_KEYS)
        if unknown or not value:
            raise PlanError(
                f"Plan entry {selector!r}: {dict(value)!r} is not a precision; an entry that sets both dimensions is"
                " a mapping with the keys 'compute' (fp32/bf16/fp16) and/or 'saved' (fp32/bf16/fp8)"
                + (f", not {sorted(unknown)}." if unknown else ".")
            )
        if "compute" in value:
            compute[selector] = value["compute"]
        if "saved" in value:
            saved[selector] = value["saved"]
    return compute, saved


def as_mapping(entries: Any) -> Mapping[str, Any]:
    """Entries given as a mapping or as ``(selector, value)`` pairs, as a mapping."""
    if isinstance(entries, Mapping):
        return entries
    try:
        return dict(entries)
    except (TypeError, ValueError):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {entries!r}.") from None
