"""Exceptions raised by lightning-comp.

Every error names the offending value and what would have been valid, so that a misconfigured run fails at
once with an actionable message instead of training silently with a plan that is not the one the user asked for.
"""

from __future__ import annotations

__all__ = ["CoMPError", "PlanError", "PlanMismatchError", "PlanFileError", "SearchConfigError", "SnapshotMismatchError",
           "UnsupportedSetupError"]


class CoMPError(Exception):
    """Base class of every exception raised by lightning-comp."""


class PlanError(CoMPError, ValueError):
    """A precision plan is malformed: unknown precision, bad selector, wrong shape."""


class PlanMismatchError(PlanError):
    """A plan does not fit the model it is applied to (unmatched entries or a different operator fingerprint)."""


class PlanFileError(PlanError):
    """A saved plan could not be read: missing, unreadable, not JSON, or JSON of the wrong shape."""


class SearchConfigError(CoMPError, ValueError):
    """`CoMPSearch` was configured with an invalid argument or used in an unsupported setup."""


class UnsupportedSetupError(CoMPError, RuntimeError):
    """The Trainer setup cannot be served (e.g. an FSDP/DeepSpeed strategy, or a missing `CoMPPrecision`)."""


class SnapshotMismatchError(CoMPError, RuntimeError):
    """A training snapshot cannot be restored: the Trainer's optimizers, schedulers or callbacks changed since."""
