"""Plans as JSON documents: the one serialised form, and reading and writing plan files.

A document holds every field of a plan (``format``, ``version``, ``default``, ``entries``, ``saved_default``,
``saved``, ``state_default``, ``state``, ``master_default``, ``master``, ``fingerprint``, ``torch_version``,
``device_type``, ``device``, ``provenance``), in plain JSON types, so that a checkpoint holding one loads with
``torch.load(weights_only=True)`` and plan files diff well. There is one format version; a document of another
version is refused, naming both. Documents written before the ``state`` and ``master`` dimensions existed read as
FP32 in both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_comp.common.plain import plain
from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.errors import PlanError, PlanFileError
from lightning_comp.plan.dimensions import Assignment, Dimension
from lightning_comp.plan.fingerprint import OperatorFingerprint

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "document_fields", "fingerprint_document", "is_document", "plan_document",
           "read_document", "write_document"]

PLAN_FORMAT = "lightning-comp/plan"
PLAN_VERSION = 1


def _keys(dimension: Dimension) -> tuple[str, str]:
    """The document's keys of one dimension: ``(entries key, default key)``."""
    if dimension is Dimension.COMPUTE:
        return "entries", "default"
    return dimension.value, f"{dimension.value}_default"


_KEYS = frozenset({"format", "version", "fingerprint", "torch_version", "device_type", "device", "provenance",
                   *(key for dimension in Dimension for key in _keys(dimension))})


def is_document(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` is a serialised plan (rather than a plain ``{selector: precision}`` mapping)."""
    return data.get("format") == PLAN_FORMAT


def fingerprint_document(fingerprint: OperatorFingerprint | None) -> dict[str, Any] | None:
    """The serialised form of a fingerprint (its digest beside the operators, so an edit is detected)."""
    if fingerprint is None:
        return None
    return {"digest": fingerprint.digest, "operators": [list(op) for op in fingerprint.operators]}


def plan_document(assignments: tuple[Assignment, ...], fingerprint: OperatorFingerprint | None,
                  torch_version: str | None, device_type: str | None, device: DeviceClass | None,
                  provenance: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's fields as its document (plain JSON types only)."""
    document: dict[str, Any] = {"format": PLAN_FORMAT, "version": PLAN_VERSION}
    for assignment in assignments:
        entries_key, default_key = _keys(assignment.dimension)
        document[default_key] = assignment.default.value
        document[entries_key] = assignment.to_dict()
    document.update({
        "fingerprint": fingerprint_document(fingerprint),
        "torch_version": torch_version,
        "device_type": device_type,
        "device": None if device is None else device.to_dict(),
        "provenance": plain(dict(provenance)),
    })
    return document


def document_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The plan fields a document holds, checked for shape (precisions are parsed by the plan itself).

    Raises:
        PlanError: on another version, unknown keys or a malformed field, naming them.
    """
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanError(f"Unsupported plan version {version!r}: this lightning-comp reads version {PLAN_VERSION}.")
    unknown = set(data) - _KEYS
    if unknown:
        raise PlanError(f"Unknown keys {sorted(unknown)} in a serialised plan; the keys are {sorted(_KEYS)}.")
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise PlanError(f"Plan provenance must be a mapping, got {provenance!r}.")
    for key in ("torch_version", "device_type"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise PlanError(f"Plan {key} must be a string or null, got {data[key]!r}.")
    assignments = []
    for dimension in Dimension:
        entries_key, default_key = _keys(dimension)
        mapping = data.get(entries_key) or {}
        if not isinstance(mapping, Mapping):
            raise PlanError(
                f"Plan {entries_key} must be a mapping of selector -> {dimension.what}, got {mapping!r}.")
        assignments.append(Assignment(dimension, tuple(mapping.items()), data.get(default_key, "fp32")))
    return {
        "assignments": tuple(assignments),
        "fingerprint": _read_fingerprint(data.get("fingerprint")),
        "torch_version": data.get("torch_version"),
        "device_type": data.get("device_type"),
        "device": None if data.get("device") is None else DeviceClass.from_dict(data["device"]),
        "provenance": dict(provenance),
    }


def _read_fingerprint(raw: Any) -> OperatorFingerprint | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("operators"), list):
        raise PlanError(f"Malformed plan fingerprint {raw!r}: expected {{'operators': [[name, type], ...]}}.")
    try:
        fingerprint = OperatorFingerprint(tuple((str(n), str(t)) for n, t in raw["operators"]))
    except (TypeError, ValueError):
        raise PlanError(f"Malformed plan fingerprint operators {raw['operators']!r}.") from None
    if "digest" in raw and raw["digest"] != fingerprint.digest:
        raise PlanError(
            f"Plan fingerprint digest {raw['digest']!r} does not match its operator list ({fingerprint.digest}):"
            " the file was edited or corrupted."
        )
    return fingerprint


def write_document(document: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``document`` as indented JSON to ``path`` atomically (parent folders are created); return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(plain(document), indent=2) + "\n")
    tmp.replace(target)
    return target


def read_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object a plan file holds (a saved plan, or a plain ``{selector: precision}`` object).

    Raises:
        PlanFileError: if the file is missing, unreadable, not JSON, or holds no JSON object.
    """
    target = Path(path)
    try:
        text = target.read_text()
    except FileNotFoundError:
        raise PlanFileError(f"Plan file {str(target)!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PlanFileError(f"Plan file {str(target)!r} cannot be read: {err}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanFileError(f"Plan file {str(target)!r} is not valid JSON: {err}.") from None
    if not isinstance(data, dict):
        raise PlanFileError(
            f"Plan file {str(target)!r} holds a JSON {type(data).__name__}; expected an object, either a saved"
            " plan or {selector: precision}."
        )
    return data
