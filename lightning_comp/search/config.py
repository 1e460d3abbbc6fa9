"""``CoMPSearch``'s settings: one validated, immutable :class:`SearchConfig`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum

import torch

from lightning_comp.devices.device_class import DeviceClass
from lightning_comp.errors import PlanError, SearchConfigError
from lightning_comp.numerics.precision import Precision, parse_precision
from lightning_comp.numerics.saved_precision import SavedPrecision
from lightning_comp.plan.selectors import Selectors

__all__ = ["Objective", "SearchConfig", "Timing"]

_SAVED_OPTIONS = {"auto": (SavedPrecision.FP8, SavedPrecision.BF16), "bf16": (SavedPrecision.BF16,),
                  "fp8": (SavedPrecision.FP8,), "off": ()}


class Objective(str, Enum):
    """What the batch stage optimises."""

    THROUGHPUT = "throughput"  # lower an operator when it gets faster
    MEMORY = "memory"  # lower an operator when it saves memory for backward (and is not much slower)
    BALANCED = "balanced"  # lower an operator when the geometric mean of its time and memory ratios improves
    # memory and balanced also choose the precision each operator saves its tensors for backward in


class Timing(str, Enum):
    """What the batch stage's clock counts on a CPU (on CUDA it always uses CUDA events)."""

    AUTO = "auto"  # wall time while the machine is quiet; this process's CPU time once other processes compete
    WALL = "wall"  # real time with the user's intra-op threads
    CPU = "cpu"  # CPU time of the measuring thread, with one intra-op thread


@dataclass(frozen=True)
class SearchConfig:
    """Validated settings of :class:`CoMPSearch` (see its docstring for the meaning of each field)."""

    monitor: str = "val_loss"
    mode: str = "min"
    tolerance: float = 0.02
    tolerance_mode: str = "relative"
    warmup_epochs: int = 1
    trial_epochs: int = 1
    trial_batches: int | float | None = None
    profile_steps: int = 4
    profile_warmup: int = 1
    extra_profile_time: float = 0.5
    timing: Timing = Timing.AUTO
    low_precision: str = "auto"
    objective: Objective = Objective.THROUGHPUT
    speed_margin: float = 0.05
    min_gain_ms: float = 0.005
    max_trials: int = 12
    max_skipped_fraction: float = 0.05
    max_memory_slowdown: float = 1.5
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    record_dir: str | None = None
    verbose: bool = True
    snapshot_device: str | None = None
    saved_precision: str = "auto"
    include_saved: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", str(self.record_dir))  # a Path is welcome, a str is stored

        def fail(name: str, valid: str) -> None:
            raise SearchConfigError(f"CoMPSearch({name}={getattr(self, name)!r}) is invalid: {valid}.")

        if not isinstance(self.monitor, str) or not self.monitor:
            fail("monitor", "it must be the name of a metric logged during validation, e.g. 'val_loss'")
        if self.mode not in ("min", "max"):
            fail("mode", "use 'min' (lower is better, e.g. a loss) or 'max' (e.g. accuracy)")
        if not isinstance(self.tolerance, (int, float)) or not math.isfinite(self.tolerance) or self.tolerance < 0:
            fail("tolerance", "it must be a finite number >= 0")
        if self.tolerance_mode not in ("relative", "absolute"):
            fail("tolerance_mode", "use 'relative' (a fraction of the reference metric) or 'absolute'")
        for name, low in (("warmup_epochs", 0), ("trial_epochs", 1), ("profile_steps", 1), ("profile_warmup", 0),
                          ("max_trials", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fail(name, f"it must be an integer >= {low}")
        value = self.extra_profile_time
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
            fail("extra_profile_time", "it must be a number in [0, 100]: the extra measuring time allowed when the"
                 " first rounds cannot decide, as a fraction of the time they took")
        try:
            object.__setattr__(self, "timing", Timing(self.timing))
        except ValueError:
            fail("timing", "use 'auto' (wall time on a quiet machine, CPU time on a busy one), 'wall' or 'cpu'")
        if self.trial_batches is not None:
            value = self.trial_batches
            count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            fraction = isinstance(value, float) and 0.0 < value <= 1.0
            if not (count or fraction):
                fail("trial_batches", "it must be None (whole epochs), a number of batches >= 1, or a fraction of the"
                     " epoch in (0, 1]")
            if self.trial_epochs != 1:
                fail("trial_batches", f"trials of a number of batches need trial_epochs=1, not {self.trial_epochs}")
        if self.snapshot_device is not None:
            try:
                torch.device(self.snapshot_device)
            except (RuntimeError, TypeError):
                fail("snapshot_device", "use None (keep snapshots where the tensors are) or a device such as 'cpu'")
        if self.low_precision not in ("auto", "bf16", "fp16"):
            fail("low_precision", "use 'auto' (what pays on the device), 'bf16' or 'fp16'")
        try:
            object.__setattr__(self, "objective", Objective(self.objective))
        except ValueError:
            fail("objective", "use 'throughput', 'memory' or 'balanced'")
        for name in ("speed_margin", "min_gain_ms", "max_skipped_fraction"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 1e6:
                fail(name, "it must be a number >= 0")
        if not self.max_memory_slowdown >= 1:
            fail("max_memory_slowdown", "it must be >= 1 (the slowdown accepted for memory)")
        if self.saved_precision not in _SAVED_OPTIONS:
            fail("saved_precision", "use 'auto' (bf16 or fp8, whichever pays per operator), 'bf16', 'fp8' or 'off'"
                 " (the memory and balanced objectives then leave saved tensors as computed)")
        if self.include_saved and self.saved_precision == "off":
            fail("include_saved", "it needs saved_precision other than 'off'")
        for name in ("include", "exclude", "include_saved"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                fail(name, "it must be a list of plan selectors (operator names, globs or 'type:ClassName')")
            object.__setattr__(self, name, tuple(value))
            try:
                Selectors.of(value)
            except PlanError as err:
                raise SearchConfigError(f"CoMPSearch({name}=...): {err}") from None

    @functools.cached_property
    def included(self) -> Selectors:
        """Operators to trial in low precision whatever the batch stage measures."""
        return Selectors.of(self.include)

    @functools.cached_property
    def included_saved(self) -> Selectors:
        """Operators whose saved-precision lowering is trialled whatever the batch stage measures."""
        return Selectors.of(self.include_saved)

    def saved_options(self) -> tuple[SavedPrecision, ...]:
        """The saved precisions the memory and balanced objectives try, smallest first (empty: none)."""
        if self.objective is Objective.THROUGHPUT:
            return ()
        return _SAVED_OPTIONS[self.saved_precision]

    @functools.cached_property
    def excluded(self) -> Selectors:
        """Operators never lowered."""
        return Selectors.of(self.exclude)

    def resolve_low_precision(self, device: DeviceClass) -> Precision | None:
        """The 16-bit precision to search with on ``device`` (``None`` when none is native there).

        ``"auto"`` prefers BF16 (no loss scaling), then FP16; an explicit ``"bf16"``/``"fp16"`` is taken as is.
        """
        if self.low_precision != "auto":
            return parse_precision(self.low_precision)
        for precision in (Precision.BF16, Precision.FP16):
            if device.is_native(precision):
                return precision
        return None
