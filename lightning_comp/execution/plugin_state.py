"""What a plugin of the package keeps in a checkpoint: the plan in force, the loss scaler's state, step counters and
the stochastic-rounding generators of BF16 master weights.

Plain Python types only, so that checkpoints load with ``torch.load(weights_only=True)``. One format version, with
every key; a state of another version, or with keys missing or unknown, is refused naming them.

Lightning files a precision plugin's state under the plugin's class name; ours goes under :data:`CHECKPOINT_KEY`
instead, whatever the class (``CoMPPrecision``, its FSDP form, a user's subclass), so that a plan saved under one
strategy resumes under another. Fabric's plugin keeps the same state wherever the user puts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_comp.errors import PlanError

__all__ = ["CHECKPOINT_KEY", "PLUGIN_STATE_VERSION", "PluginState"]

PLUGIN_STATE_VERSION = 1
#: The checkpoint key of the plugin's state, the same for every plugin class of the package.
CHECKPOINT_KEY = "lightning_comp"
_KEYS = frozenset({"version", "plan", "scaler", "skipped_steps", "optimizer_steps", "rounding"})


@dataclass(frozen=True)
class PluginState:
    """A ``CoMPPrecision``'s checkpoint state.

    Attributes:
        plan: the plan in force (:meth:`PrecisionPlan.to_dict`).
        scaler: the FP16 loss scaler's ``state_dict()``, or ``None`` without one.
        skipped_steps: optimizer steps the scaler skipped so far.
        optimizer_steps: optimizer steps taken so far.
        rounding: the stochastic-rounding generators' states of BF16 master weights (device -> state), if any.
    """

    plan: dict[str, Any]
    scaler: dict[str, Any] | None = None
    skipped_steps: int = 0
    optimizer_steps: int = 0
    rounding: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint form (with its version)."""
        return {"version": PLUGIN_STATE_VERSION, "plan": self.plan, "scaler": self.scaler,
                "skipped_steps": self.skipped_steps, "optimizer_steps": self.optimizer_steps, "rounding": self.rounding}

    @classmethod
    def from_dict(cls, data: object) -> PluginState:
        """Read :meth:`to_dict`'s form.

        Raises:
            PlanError: naming what is wrong (not a mapping, another version, missing or unknown keys).
        """
        if not isinstance(data, Mapping) or "plan" not in data:
            raise PlanError(f"Malformed CoMPPrecision state {data!r}: expected a mapping with a 'plan' key.")
        version = data.get("version")
        if version != PLUGIN_STATE_VERSION:
            raise PlanError(f"Cannot load a CoMPPrecision state of version {version!r}: this version reads"
                            f" {PLUGIN_STATE_VERSION}. Load it with the lightning-comp that wrote it.")
        unknown, missing = sorted(set(data) - _KEYS), sorted(_KEYS - set(data))
        if unknown:
            raise PlanError(f"Unknown keys {unknown} in a CoMPPrecision state: it was written by another version of"
                            " lightning-comp.")
        if missing:
            raise PlanError(f"Malformed CoMPPrecision state: missing keys {missing}; a state of version"
                            f" {PLUGIN_STATE_VERSION} has exactly {sorted(_KEYS)}.")
        if not isinstance(data["plan"], Mapping):
            raise PlanError(f"Malformed CoMPPrecision state: its plan {data['plan']!r} is not a mapping.")
        scaler = data["scaler"]
        return cls(plan=dict(data["plan"]), scaler=None if scaler is None else dict(scaler),
                   skipped_steps=int(data["skipped_steps"]), optimizer_steps=int(data["optimizer_steps"]),
                   rounding=None if data["rounding"] is None else dict(data["rounding"]))
