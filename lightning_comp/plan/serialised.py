"""Plans as JSON documents: the serialised form, its versions, and reading and writing plan files.

Format versions:

- 1: before the device class was recorded;
- 2: with the device class;
- 3: with the saved-for-backward dimension (``saved``, ``saved_default``).

A plan is written at the lowest version that holds it: a plan that saves every tensor as computed is written as
version 2, so earlier lightning-comp releases keep reading it. Every earlier version loads unchanged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_comp.devices.device_class import DeviceClass
from lightning_comp.errors import PlanError, PlanFileError
from lightning_comp.plan.fingerprint import OperatorFingerprint

if TYPE_CHECKING:
    from lightning_comp.plan.plan import PrecisionPlan

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "READABLE_VERSIONS", "load_plan", "plain", "plan_from_serialised",
           "plan_to_dict", "save_plan"]

PLAN_FORMAT = "lightning-comp/plan"
PLAN_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_KEYS = {1: {"format", "version", "default", "entries", "fingerprint", "torch_version", "device_type", "provenance"}}
_KEYS[2] = _KEYS[1] | {"device"}
_KEYS[3] = _KEYS[2] | {"saved", "saved_default"}


def plan_to_dict(plan: PrecisionPlan) -> dict[str, Any]:
    """The JSON-able form of ``plan`` (plain Python types only), at the lowest version that holds it."""
    data: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION if plan.compresses_saved else 2,
        "default": plan.default.value,
        "entries": {selector: precision.value for selector, precision in plan.entries},
    }
    if plan.compresses_saved:
        data["saved_default"] = plan.saved_default.value
        data["saved"] = {selector: saved.value for selector, saved in plan.saved}
    data.update({
        "fingerprint": None
        if plan.fingerprint is None
        else {"digest": plan.fingerprint.digest, "operators": [list(op) for op in plan.fingerprint.operators]},
        "torch_version": plan.torch_version,
        "device_type": plan.device_type,
        "device": None if plan.device is None else plan.device.to_dict(),
        "provenance": plain(dict(plan.provenance)),
    })
    return data


def plan_from_serialised(cls: type[PrecisionPlan], data: Mapping[str, Any]) -> PrecisionPlan:
    """Rebuild a plan from :func:`plan_to_dict`'s form (any readable version).

    Raises:
        PlanError: on an unsupported version, unknown keys or a malformed field.
    """
    version = data.get("version")
    if version not in READABLE_VERSIONS:
        raise PlanError(f"Unsupported plan version {version!r}: this lightning-comp reads versions"
                        f" {', '.join(map(str, READABLE_VERSIONS))}.")
    unknown = set(data) - _KEYS[version]
    if unknown:
        raise PlanError(f"Unknown keys {sorted(unknown)} in a serialised plan of version {version}.")
    fingerprint = None
    raw = data.get("fingerprint")
    if raw is not None:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("operators"), list):
            raise PlanError(f"Malformed plan fingerprint {raw!r}: expected {{'operators': [[name, type], ...]}}.")
        try:
            fingerprint = OperatorFingerprint(tuple((str(n), str(t)) for n, t in raw["operators"]))
        except (TypeError, ValueError):
            raise PlanError(f"Malformed plan fingerprint operators {raw['operators']!r}.") from None
        if "digest" in raw and raw["digest"] != fingerprint.digest:
            raise PlanError(
                f"Plan fingerprint digest {raw['digest']!r} does not match its operator list"
                f" ({fingerprint.digest}): the file was edited or corrupted."
            )
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise PlanError(f"Plan provenance must be a mapping, got {provenance!r}.")
    for key in ("torch_version", "device_type"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise PlanError(f"Plan {key} must be a string or null, got {data[key]!r}.")
    entries = data.get("entries") or {}
    if not isinstance(entries, Mapping):
        raise PlanError(f"Plan entries must be a mapping of selector -> precision, got {entries!r}.")
    saved = data.get("saved") or {}
    if not isinstance(saved, Mapping):
        raise PlanError(f"Plan 'saved' entries must be a mapping of selector -> saved precision, got {saved!r}.")
    return cls(
        entries=tuple(entries.items()),
        default=data.get("default", "fp32"),
        fingerprint=fingerprint,
        torch_version=data.get("torch_version"),
        device_type=data.get("device_type"),
        provenance=dict(provenance),
        device=None if data.get("device") is None else DeviceClass.from_dict(data["device"]),
        saved=tuple(saved.items()),
        saved_default=data.get("saved_default", "fp32"),
    )


def save_plan(plan: PrecisionPlan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` as indented JSON to ``path`` atomically (parent folders are created); return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(plan_to_dict(plan), indent=2) + "\n")
    tmp.replace(target)
    return target


def load_plan(cls: type[PrecisionPlan], path: str | os.PathLike[str]) -> PrecisionPlan:
    """Read a plan file (a saved plan, or a plain ``{selector: precision}`` JSON object).

    Raises:
        PlanFileError: if the file is missing, unreadable, not JSON, or JSON of the wrong shape.
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
    try:
        return cls.from_dict(data)
    except PlanError as err:
        raise PlanFileError(f"Plan file {str(target)!r}: {err}") from None


def plain(value: Any) -> Any:
    """Convert ``value`` to plain JSON types (dicts with str keys, lists, str, int, float, bool, None)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)
