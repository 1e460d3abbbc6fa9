"""Exceptions raised by lightning-comp: every one is a :class:`CoMPError`.

Every error names the offending value and what would have been valid, so that a misconfigured run fails at once with
an actionable message instead of training silently with a plan that is not the one the user asked for. Each class
also derives from the built-in exception a caller would catch without knowing lightning-comp (``ValueError`` for a bad
value, ``RuntimeError`` for a setup that cannot be served, ``ImportError`` for a missing extra).

=============================  =======================================================================================
class                          raised when
=============================  =======================================================================================
:class:`ConfigError`           an argument or setting has an invalid value or type (a ``ValueError``)
:class:`PlanError`             a precision plan is malformed, or cannot run on the device (a :class:`ConfigError`)
:class:`PlanMismatchError`     a plan does not fit the model it is applied to
:class:`PlanFileError`         a saved plan cannot be read
:class:`SearchConfigError`     ``CoMPSearch`` is configured wrongly, or its checkpoint state is (a :class:`ConfigError`)
:class:`UnsupportedSetupError` the Trainer, strategy, optimizer or backend cannot be served (a ``RuntimeError``)
:class:`NativeBuildError`      a C source of the package cannot be built or loaded here (an ``UnsupportedSetupError``)
:class:`SnapshotMismatchError` a training snapshot cannot be restored into the Trainer as it is now
:class:`UsageError`            a call comes in an order or a state its object does not support (a ``RuntimeError``)
:class:`MissingExtraError`     an optional dependency is not installed (an ``ImportError``)
=============================  =======================================================================================
"""

from __future__ import annotations

__all__ = [
    "CoMPError",
    "ConfigError",
    "MissingExtraError",
    "NativeBuildError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "SearchConfigError",
    "SnapshotMismatchError",
    "UnsupportedSetupError",
    "UsageError",
]


class CoMPError(Exception):
    """Base class of every exception raised by lightning-comp."""


class ConfigError(CoMPError, ValueError):
    """An argument or setting has an invalid value or type; the message names it and what is valid."""


class PlanError(ConfigError):
    """A precision plan is malformed (unknown precision, bad selector, wrong shape) or cannot run on the device."""


class PlanMismatchError(PlanError):
    """A plan does not fit the model it is applied to (unmatched entries or a different operator fingerprint)."""


class PlanFileError(PlanError):
    """A saved plan could not be read: missing, unreadable, not JSON, or JSON of the wrong shape."""


class SearchConfigError(ConfigError):
    """`CoMPSearch` was configured with an invalid argument, used in an unsupported setup, or resumed from a state
    it cannot read."""


class UnsupportedSetupError(CoMPError, RuntimeError):
    """The setup cannot be served: a strategy, optimizer, backend or device lightning-comp cannot drive."""


class NativeBuildError(UnsupportedSetupError):
    """A C source of the package could not be built or loaded here: no C compiler, or every attempt failed (the
    message names the compiler's error)."""


class SnapshotMismatchError(CoMPError, RuntimeError):
    """A training snapshot cannot be restored: the Trainer's optimizers, schedulers or callbacks changed since."""


class UsageError(CoMPError, RuntimeError):
    """A call came in an order or state its object does not support (e.g. a meter stopped before it started, a
    parameter modified in place between forward and backward)."""


class MissingExtraError(CoMPError, ImportError):
    """An optional dependency (an extra such as ``[hf]`` or ``[vision]``) is not installed; the message says which."""
