"""How the search measures and judges what it measures: :class:`MeasurementConfig` and its named presets.

These settings tune the instrument, not what the user wants: how many steps are timed, how noise is guarded
against. Most runs keep :data:`MEASUREMENT_PRESETS` ``"default"``; ``CoMPSearch(measurement="quick")`` measures less
(smoke tests, tiny models), ``"thorough"`` more (a noisy machine, close calls). A preset is spelled by its name, a
:class:`MeasurementConfig`, or a mapping of its fields (over ``"default"``, or over the preset its ``preset`` key
names): ``{"preset": "thorough", "timing": "cpu"}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_comp.common.spelled_enum import quoted
from lightning_comp.errors import SearchConfigError
from lightning_comp.search.config.choices import Timing

__all__ = ["MEASUREMENT_PRESETS", "MeasurementConfig"]


@dataclass(frozen=True)
class MeasurementConfig:
    """How the batch stage measures and the epoch stage judges, validated on construction.

    Attributes:
        profile_steps: measured training steps per configuration in the batch stage. Every comparison is made
            from paired rounds: the median per-round ratio and its confidence interval (see ``timing``).
        profile_warmup: unmeasured steps per configuration before those.
        extra_profile_time: when the first ``profile_steps`` rounds cannot tell FP32 and low precision apart (the
            interval of the per-round ratios straddles the margin), the batch stage measures more rounds, for at
            most this fraction of the time the first rounds took (per-operator and whole-step measurements each).
            An operator still undecided then stays FP32, with the measured ratio and its spread in the record; of
            whole-step plans still too close to tell, the fastest by the median is taken. What the whole-step
            budget leaves pays for the refinement (one group flipped at a time, see ``switch_margin``). ``0``
            disables the extra rounds and the refinement.
        timing: what the batch stage's clock counts on a CPU. ``"auto"``: wall time with the user's threads while
            the machine is quiet; once other processes take half a CPU or more (measured from ``/proc/stat`` on
            Linux, before and during the measurements), the CPU time of the measuring thread with one intra-op
            thread, which does not count time other processes take. ``"wall"`` or ``"cpu"`` force one. On CUDA,
            CUDA events are used whatever this says.
        speed_margin: fraction by which lowering must beat FP32 before it is preferred (noise guard).
        switch_margin: how much faster a refinement must make the whole step to be kept (throughput objective). The
            batch stage trials the fastest plan it measured (by the median of paired rounds), then flips one group
            of operators at a time from it and keeps a flip only when the step with it is faster than without by
            this fraction beyond doubt (the whole interval of the per-round ratios at or below
            ``1 - switch_margin``; 0: faster beyond doubt).
        min_gain_ms: smallest per-step gain (ms) for an operator to be lowered (throughput objective).
        max_skipped_fraction: an FP16 trial whose loss scaler skips more than this fraction of its steps is rejected.

    Raises:
        SearchConfigError: on an invalid setting, naming it (``measurement.<name>``) and what is valid.
    """

    profile_steps: int = 4
    profile_warmup: int = 1
    extra_profile_time: float = 0.5
    timing: Timing = Timing.AUTO
    speed_margin: float = 0.05
    switch_margin: float = 0.0
    min_gain_ms: float = 0.005
    max_skipped_fraction: float = 0.05

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "timing", Timing.parse(self.timing))
        except SearchConfigError:
            self._fail("timing", f"use {Timing.alternatives()}")
        for name, low in (("profile_steps", 1), ("profile_warmup", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                self._fail(name, f"it must be an integer >= {low}")
        if not _number(self.extra_profile_time) or not 0 <= self.extra_profile_time <= 100:
            self._fail("extra_profile_time", "it must be a number in [0, 100]: the extra measuring time allowed when"
                       " the first rounds cannot decide, as a fraction of the time they took")
        if not _number(self.switch_margin) or not 0 <= self.switch_margin < 1:
            self._fail("switch_margin", "it must be a number in [0, 1): how much faster a refinement flip must make"
                       " the whole step to be kept")
        for name in ("speed_margin", "min_gain_ms", "max_skipped_fraction"):
            if not _number(getattr(self, name)) or not 0 <= getattr(self, name) < 1e6:
                self._fail(name, "it must be a number >= 0")

    def _fail(self, name: str, valid: str) -> None:
        raise SearchConfigError(f"CoMPSearch(measurement.{name}={getattr(self, name)!r}) is invalid: {valid}.")

    def replace(self, **changes: Any) -> MeasurementConfig:
        """A copy with ``changes`` (field name -> value), validated."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> MeasurementConfig:
        """The preset called ``name``.

        Raises:
            SearchConfigError: naming ``name`` and the presets.
        """
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in MEASUREMENT_PRESETS:
            raise SearchConfigError(f"CoMPSearch(measurement={name!r}) is invalid: use a preset,"
                                    f" {quoted(MEASUREMENT_PRESETS)}, a MeasurementConfig or a mapping of its fields.")
        return MEASUREMENT_PRESETS[key]

    @classmethod
    def parse(cls, value: object) -> MeasurementConfig:
        """The measurement ``value`` spells: a preset's name, a :class:`MeasurementConfig`, or a mapping of fields
        (over ``"default"``, or over the preset named by its ``preset`` key).

        Raises:
            SearchConfigError: naming the bad value, or the unknown field and the valid ones.
        """
        if isinstance(value, MeasurementConfig):
            return value
        if isinstance(value, str):
            return cls.preset(value)
        if isinstance(value, Mapping):
            changes = dict(value)
            base = cls.preset(changes.pop("preset", "default"))
            names = [f.name for f in fields(cls)]
            unknown = sorted(set(changes) - set(names), key=str)
            if unknown:
                raise SearchConfigError(f"CoMPSearch(measurement=...) has no setting {quoted(unknown, 'and')}; its"
                                        f" settings are 'preset', {quoted(names, 'and')}.")
            return base.replace(**changes)
        raise SearchConfigError(f"CoMPSearch(measurement={value!r}) is invalid: use a preset,"
                                f" {quoted(MEASUREMENT_PRESETS)}, a MeasurementConfig or a mapping of its fields.")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The named measurements, each a documented instance.
MEASUREMENT_PRESETS: dict[str, MeasurementConfig] = {
    # 2 timed steps and no extra rounds: tests, smoke runs and tiny models, where the search's cost dominates
    "quick": MeasurementConfig(profile_steps=2, profile_warmup=1, extra_profile_time=0.0),
    # what every setting defaults to: 4 timed steps, up to half again as long when a call is close or to refine
    "default": MeasurementConfig(),
    # 8 timed steps after 2 unmeasured, up to as long again: a noisy machine, or gains near the margins
    "thorough": MeasurementConfig(profile_steps=8, profile_warmup=2, extra_profile_time=1.0),
}
