"""``CoMPSearch``'s settings: one validated, immutable :class:`SearchConfig`, every choice an enum.

Each setting is written once, here: its name, default, valid values and meaning. ``CoMPSearch`` takes a
``SearchConfig`` (``config=``), the common settings as keyword arguments, or any setting by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.errors import CoMPError, PlanError, SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision, MasterPrecision, SavedPrecision, StatePrecision
from lightning_comp.plan.selectors import Selectors

__all__ = ["LowPrecision", "MasterPrecisions", "Mode", "Objective", "SavedPrecisions", "SearchConfig",
           "StatePrecisions", "Timing", "ToleranceMode"]


class _Setting(SpelledEnum):
    """A choice of ``CoMPSearch``: a bad spelling is a :class:`SearchConfigError`."""

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        return SearchConfigError


class Mode(_Setting):
    """Which way the monitored metric is better."""

    MIN = "min"  # lower is better (a loss)
    MAX = "max"  # higher is better (an accuracy)


class ToleranceMode(_Setting):
    """How ``tolerance`` is counted."""

    RELATIVE = "relative"  # a fraction of the reference trial's |metric|
    ABSOLUTE = "absolute"  # in the metric's own units


class Objective(_Setting):
    """What the batch stage optimises."""

    THROUGHPUT = "throughput"  # lower an operator when it gets faster
    MEMORY = "memory"  # lower an operator when it saves memory for backward (and is not much slower)
    BALANCED = "balanced"  # lower an operator when the geometric mean of its time and memory ratios improves
    # memory and balanced also choose the precision each operator saves its tensors for backward in


class Timing(_Setting):
    """What the batch stage's clock counts on a CPU (on CUDA it always uses CUDA events)."""

    AUTO = "auto"  # wall time while the machine is quiet; this process's CPU time once other processes compete
    WALL = "wall"  # real time with the user's intra-op threads
    CPU = "cpu"  # CPU time of the measuring thread, with one intra-op thread


class LowPrecision(_Setting):
    """The 16-bit precision the search tries."""

    AUTO = "auto"  # what the device runs natively: BF16, else FP16, else no search
    BF16 = "bf16"
    FP16 = "fp16"


class SavedPrecisions(_Setting):
    """The precisions the memory and balanced objectives may store an operator's saved tensors in."""

    AUTO = "auto"  # recompute for cheap operators, fp8 or bf16 (the smaller that pays) for the others
    BF16 = "bf16"
    FP8 = "fp8"
    RECOMPUTE = "recompute"  # recompute cheap operators, store the others as computed
    OFF = "off"  # saved as computed

    @property
    def options(self) -> tuple[SavedPrecision, ...]:
        """The stored saved precisions tried, smallest first (recomputation aside: :attr:`recomputes`)."""
        return {SavedPrecisions.AUTO: (SavedPrecision.FP8, SavedPrecision.BF16), SavedPrecisions.BF16:
                (SavedPrecision.BF16,), SavedPrecisions.FP8: (SavedPrecision.FP8,), SavedPrecisions.RECOMPUTE: (),
                SavedPrecisions.OFF: ()}[self]

    @property
    def recomputes(self) -> bool:
        """Whether cheap operators are offered ``recompute``."""
        return self in (SavedPrecisions.AUTO, SavedPrecisions.RECOMPUTE)


class StatePrecisions(_Setting):
    """The precisions the memory and balanced objectives may keep a parameter group's optimizer state in."""

    AUTO = "auto"  # 8bit or bf16, the smaller that pays per operator
    INT8 = "8bit"
    BF16 = "bf16"
    OFF = "off"  # the optimizer's own fp32 state

    @property
    def options(self) -> tuple[StatePrecision, ...]:
        """The optimizer-state precisions tried, smallest first."""
        return {StatePrecisions.AUTO: (StatePrecision.INT8, StatePrecision.BF16),
                StatePrecisions.INT8: (StatePrecision.INT8,), StatePrecisions.BF16: (StatePrecision.BF16,),
                StatePrecisions.OFF: ()}[self]


class MasterPrecisions(_Setting):
    """Whether the memory and balanced objectives may hold a parameter group's master weights in bf16."""

    AUTO = "auto"  # bf16 where the operator computes in bf16 and it pays
    OFF = "off"  # fp32 master weights

    @property
    def options(self) -> tuple[MasterPrecision, ...]:
        """The master-weight precisions tried."""
        return (MasterPrecision.BF16,) if self is MasterPrecisions.AUTO else ()


# setting -> its enum, and what the message of a bad value says
_CHOICES: dict[str, tuple[type[_Setting], str]] = {
    "mode": (Mode, "use 'min' (lower is better, e.g. a loss) or 'max' (e.g. accuracy)"),
    "tolerance_mode": (ToleranceMode, "use 'relative' (a fraction of the reference metric) or 'absolute'"),
    "objective": (Objective, "use 'throughput', 'memory' or 'balanced'"),
    "timing": (Timing, "use 'auto' (wall time on a quiet machine, CPU time on a busy one), 'wall' or 'cpu'"),
    "low_precision": (LowPrecision, "use 'auto' (what pays on the device), 'bf16' or 'fp16'"),
    "saved_precision": (SavedPrecisions, "use 'auto' (recompute for cheap operators, bf16 or fp8 for the others,"
                        " whichever pays), 'bf16', 'fp8', 'recompute' or 'off' (the memory and balanced objectives then"
                        " leave saved tensors as computed)"),
    "state_precision": (StatePrecisions, "use 'auto' (8bit or bf16 Adam moments, whichever pays per operator),"
                        " '8bit', 'bf16' or 'off' (the optimizer's own fp32 state)"),
    "master_precision": (MasterPrecisions, "use 'auto' (bf16 master weights where an operator computes in bf16 and"
                         " it pays) or 'off'"),
}


@dataclass(frozen=True)
class SearchConfig:
    """Validated settings of :class:`~lightning_comp.CoMPSearch`.

    Attributes:
        monitor: validation metric that judges convergence (logged in ``validation_step``; under DDP log it with
            ``sync_dist=True``).
        mode: ``"min"`` if lower is better (losses), ``"max"`` if higher is better (accuracy).
        tolerance: how much worse than the FP32 reference trial a candidate may end. Relative by default: ``0.02``
            accepts ``val_loss <= 1.02 * reference`` (mode min) or ``acc >= 0.98 * reference`` (mode max).
        tolerance_mode: ``"relative"`` (fraction of ``|reference|``) or ``"absolute"`` (metric units).
        warmup_epochs: FP32 epochs before the search starts (kept as training; at least 1 recommended so every trial
            sees the same batch order).
        trial_epochs: epochs each convergence trial trains.
        trial_batches: if set (a number of batches, or a fraction of the epoch such as ``0.25``, as with
            ``Trainer(limit_train_batches)``), each trial trains only the first that many batches of an epoch and is
            judged by a validation run right there. A rejected trial ends its epoch early and is rewound (its epoch is
            given back through ``max_epochs``, as for whole-epoch trials); the trial that is kept goes on to the end
            of its epoch with its plan, so the kept progress still equals a plain run's. Cuts the cost of the FP32
            reference trial to that many batches. Needs ``trial_epochs=1`` and validation at every epoch end.
        profile_steps: measured training steps per configuration in the batch stage. Every comparison is made
            from paired rounds: the median per-round ratio and its confidence interval (see ``timing``).
        profile_warmup: unmeasured steps per configuration before those.
        extra_profile_time: when the first ``profile_steps`` rounds cannot tell FP32 and low precision apart (the
            interval of the per-round ratios straddles the margin), the batch stage measures more rounds, for at
            most this fraction of the time the first rounds took (per-operator and whole-step measurements each).
            An operator or plan still undecided then stays FP32, with the measured ratio and its spread in the
            record. ``0`` disables the extra rounds.
        timing: what the batch stage's clock counts on a CPU. ``"auto"``: wall time with the user's threads while
            the machine is quiet; once other processes take half a CPU or more (measured from ``/proc/stat`` on
            Linux, before and during the measurements), the CPU time of the measuring thread with one intra-op
            thread, which does not count time other processes take. ``"wall"`` or ``"cpu"`` force one. On CUDA,
            CUDA events are used whatever this says.
        low_precision: ``"auto"`` (BF16 on CPUs with AVX512-BF16/AMX and on CUDA >= sm80, FP16 on CUDA sm70-sm75,
            FP32 without a search where no 16-bit precision is native, e.g. AVX2-only CPUs), ``"bf16"`` or ``"fp16"``.
            Decided from the device the model trains on, once Lightning has placed it, and kept by a resumed search.
        objective: ``"throughput"``, ``"memory"`` (saved-for-backward bytes) or ``"balanced"``. Per operator first;
            then the candidate plan is compared as a whole step with AMP's plan, the all-low and the compute-only
            plans: by time (``"throughput"``), by bytes saved for backward within ``max_memory_slowdown`` of FP32
            (``"memory"``), or by the geometric mean of both ratios to FP32 (``"balanced"``). ``"memory"`` and
            ``"balanced"`` also
            choose, per operator, the precision its tensors saved for backward are stored in (``saved_precision``),
            and trial those choices like compute precision.
        speed_margin: fraction by which lowering must beat FP32 before it is preferred (noise guard).
        switch_margin: the tie rule of the whole-step comparison: a fixed policy (AMP's plan) or another
            whole-step alternative is trialled instead of the per-operator candidates only when its step is faster
            than theirs by this fraction beyond doubt (the whole interval of the per-round ratios below
            ``1 - switch_margin``). Within it the candidates are kept, so near ties do not flip from run to run,
            and the chosen plan is never slower than the best alternative by more than this, within measured noise.
        min_gain_ms: smallest per-step gain (ms) for an operator to be lowered (throughput objective).
        max_trials: most candidate trials (the FP32 reference not counted); then the best passing group is taken.
        max_skipped_fraction: an FP16 trial whose loss scaler skips more than this fraction of its steps is rejected.
        max_memory_slowdown: the largest slowdown against FP32 the memory objective accepts (per operator, as a
            whole step).
        include: plan selectors of operators to trial in low precision whatever the batch stage measures.
        exclude: plan selectors of operators never to lower (kept FP32 without trials), e.g. a sensitive head.
        record_dir: where to write ``comp_search.json`` and ``comp_plan.json`` (default: the Trainer's log dir).
        verbose: print the decision table on rank 0.
        snapshot_device: where the search keeps its snapshots of the run (model, optimizer state, buffers):
            ``None`` keeps them where the tensors are, ``"cpu"`` spares accelerator memory (slower rewinds).
        saved_precision: with ``objective="memory"``/``"balanced"``, how an operator's saved tensors may be kept:
            ``"auto"`` (cheap operators, as a group, recompute their outputs in backward where that pays; the others
            store ``fp8`` or ``bf16``, the smaller that pays per operator), ``"bf16"``, ``"fp8"``, ``"recompute"``
            (recomputation only), or ``"off"`` (saved as computed). Ignored with ``objective="throughput"``.
        include_saved: plan selectors of operators whose saved lowering is trialled whatever the batch stage
            measures (at ``fp8`` with ``"auto"``); convergence still decides.
        state_precision: with ``objective="memory"``/``"balanced"`` and an ``Adam``/``AdamW`` optimizer, the
            precisions the optimizer state of each operator's parameters may be kept in: ``"auto"`` (``8bit`` or
            ``bf16``, the smaller that pays per operator), ``"8bit"``, ``"bf16"``, or ``"off"`` (the optimizer's own
            FP32 state). Ignored with ``objective="throughput"``.
        master_precision: with ``objective="memory"``/``"balanced"``, ``"auto"`` lets the search hold the parameters
            of operators it lowers to bf16 in bf16, with no FP32 copy (stochastically rounded updates), where that
            pays; ``"off"`` keeps FP32 master weights. Ignored with ``objective="throughput"``.
        include_state: plan selectors of operators whose parameters' optimizer state is trialled at the smallest
            ``state_precision`` (``8bit`` with ``"auto"``) whatever the batch stage measures; convergence still
            decides.

    Raises:
        SearchConfigError: on an invalid setting, naming it and the valid values.
    """

    monitor: str = "val_loss"
    mode: Mode = Mode.MIN
    tolerance: float = 0.02
    tolerance_mode: ToleranceMode = ToleranceMode.RELATIVE
    warmup_epochs: int = 1
    trial_epochs: int = 1
    trial_batches: int | float | None = None
    profile_steps: int = 4
    profile_warmup: int = 1
    extra_profile_time: float = 0.5
    timing: Timing = Timing.AUTO
    low_precision: LowPrecision = LowPrecision.AUTO
    objective: Objective = Objective.THROUGHPUT
    speed_margin: float = 0.05
    switch_margin: float = 0.02
    min_gain_ms: float = 0.005
    max_trials: int = 12
    max_skipped_fraction: float = 0.05
    max_memory_slowdown: float = 1.5
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    record_dir: str | None = None
    verbose: bool = True
    snapshot_device: str | None = None
    saved_precision: SavedPrecisions = SavedPrecisions.AUTO
    include_saved: tuple[str, ...] = ()
    state_precision: StatePrecisions = StatePrecisions.AUTO
    master_precision: MasterPrecisions = MasterPrecisions.AUTO
    include_state: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", str(self.record_dir))  # a Path is welcome, a str is stored
        for name, (choice, valid) in _CHOICES.items():
            try:
                object.__setattr__(self, name, choice.parse(getattr(self, name)))
            except SearchConfigError:
                self._fail(name, valid)
        self._check_numbers()
        self._check_trial_length()
        if self.snapshot_device is not None:
            try:
                torch.device(self.snapshot_device)
            except (RuntimeError, TypeError):
                self._fail("snapshot_device", "use None (keep snapshots where the tensors are) or a device such as"
                           " 'cpu'")
        if self.include_saved and not self.saved_precision.options:
            self._fail("include_saved", "it needs saved_precision 'auto', 'bf16' or 'fp8' (it forces a stored"
                       " lowering)")
        if self.include_state and self.state_precision is StatePrecisions.OFF:
            self._fail("include_state", "it needs state_precision other than 'off'")
        for name in ("include", "exclude", "include_saved", "include_state"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                self._fail(name, "it must be a list of plan selectors (operator names, globs or 'type:ClassName')")
            object.__setattr__(self, name, tuple(value))
            try:
                Selectors.of(value)
            except PlanError as err:
                raise SearchConfigError(f"CoMPSearch({name}=...): {err}") from None

    def _fail(self, name: str, valid: str) -> None:
        raise SearchConfigError(f"CoMPSearch({name}={getattr(self, name)!r}) is invalid: {valid}.")

    def _check_numbers(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            self._fail("monitor", "it must be the name of a metric logged during validation, e.g. 'val_loss'")
        if not _number(self.tolerance) or not math.isfinite(self.tolerance) or self.tolerance < 0:
            self._fail("tolerance", "it must be a finite number >= 0")
        for name, low in (("warmup_epochs", 0), ("trial_epochs", 1), ("profile_steps", 1), ("profile_warmup", 0),
                          ("max_trials", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                self._fail(name, f"it must be an integer >= {low}")
        if not _number(self.extra_profile_time) or not 0 <= self.extra_profile_time <= 100:
            self._fail("extra_profile_time", "it must be a number in [0, 100]: the extra measuring time allowed when"
                       " the first rounds cannot decide, as a fraction of the time they took")
        if not _number(self.switch_margin) or not 0 <= self.switch_margin < 1:
            self._fail("switch_margin", "it must be a number in [0, 1): how much faster than the candidates an"
                       " alternative plan's step must be to replace them")
        for name in ("speed_margin", "min_gain_ms", "max_skipped_fraction"):
            if not _number(getattr(self, name)) or not 0 <= getattr(self, name) < 1e6:
                self._fail(name, "it must be a number >= 0")
        if not _number(self.max_memory_slowdown) or not self.max_memory_slowdown >= 1:
            self._fail("max_memory_slowdown", "it must be >= 1 (the slowdown accepted for memory)")

    def _check_trial_length(self) -> None:
        if self.trial_batches is None:
            return
        value = self.trial_batches
        count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        fraction = isinstance(value, float) and 0.0 < value <= 1.0
        if not (count or fraction):
            self._fail("trial_batches", "it must be None (whole epochs), a number of batches >= 1, or a fraction of"
                       " the epoch in (0, 1]")
        if self.trial_epochs != 1:
            self._fail("trial_batches", f"trials of a number of batches need trial_epochs=1, not {self.trial_epochs}")

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The names of every setting, in order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, config: SearchConfig | None, settings: Mapping[str, Any]) -> SearchConfig:
        """``config`` (or the defaults) with ``settings`` (setting name -> value) in place of its own values.

        Raises:
            SearchConfigError: naming a setting that does not exist, and the ones that do; or an invalid value.
        """
        unknown = sorted(set(settings) - set(cls.setting_names()))
        if unknown:
            raise SearchConfigError(f"CoMPSearch has no setting {', '.join(map(repr, unknown))}; its settings are"
                                    f" {', '.join(cls.setting_names())}.")
        base = cls() if config is None else config
        if not isinstance(base, SearchConfig):
            raise SearchConfigError(f"CoMPSearch(config={config!r}) is invalid: pass a SearchConfig, or None.")
        values = {name: getattr(base, name) for name in cls.setting_names()}
        values.update(settings)
        return cls(**values)

    @functools.cached_property
    def included(self) -> Selectors:
        """Operators to trial in low precision whatever the batch stage measures."""
        return Selectors.of(self.include)

    @functools.cached_property
    def included_saved(self) -> Selectors:
        """Operators whose saved-precision lowering is trialled whatever the batch stage measures."""
        return Selectors.of(self.include_saved)

    @functools.cached_property
    def included_state(self) -> Selectors:
        """Operators whose optimizer-state lowering is trialled whatever the batch stage measures."""
        return Selectors.of(self.include_state)

    @functools.cached_property
    def excluded(self) -> Selectors:
        """Operators never lowered."""
        return Selectors.of(self.exclude)

    def resolve_low_precision(self, device: DeviceClass) -> ComputePrecision | None:
        """The 16-bit precision to search with on ``device`` (``None`` when none is native there).

        ``"auto"`` prefers BF16 (no loss scaling), then FP16; an explicit ``"bf16"``/``"fp16"`` is taken as is.
        """
        if self.low_precision is not LowPrecision.AUTO:
            return ComputePrecision.parse(self.low_precision.value)
        for precision in (ComputePrecision.BF16, ComputePrecision.FP16):
            if device.is_native(precision):
                return precision
        return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
