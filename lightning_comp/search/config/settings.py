"""``CoMPSearch``'s settings: one validated, immutable :class:`SearchConfig`, the one source of their defaults.

Each setting is written once, here: its name, default, valid values and meaning. ``CoMPSearch(...)`` takes exactly
these settings by name (so LightningCLI spells each one ``init_args.<name>``, the measurement's
``init_args.measurement.<name>``), and the Hydra app's ``comp_search`` node is this dataclass as a structured config
(registered in :mod:`lightning_comp.conf`), so ``conf/precision/comp.yaml`` names only its overrides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lightning_comp.common.spelled_enum import SpelledEnum, quoted
from lightning_comp.devices.device_classes import DeviceClass
from lightning_comp.errors import CoMPError, PlanError, SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision, SavedPrecision
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.plan.selectors import Selectors
from lightning_comp.search.config.choices import (
    AUTO_VALUES,
    DimensionChoice,
    Fp8Choice,
    LowPrecision,
    Mode,
    Objective,
    ToleranceMode,
    parse_dimension_choice,
    tried_values,
)
from lightning_comp.search.config.measurement import MeasurementConfig

__all__ = ["DEFAULT_SLOWDOWN_VS_FASTEST", "SearchConfig"]

# The step-time slowdown against the fastest fixed policy each memory-weighing objective accepts by default: memory
# keeps at least 0.87x the pace's throughput, balanced 0.95x
DEFAULT_SLOWDOWN_VS_FASTEST: dict[Objective, float] = {Objective.MEMORY: 1.15, Objective.BALANCED: 1.05}

# settings that no longer exist -> what replaced them (named in the error a user who passes one gets)
RENAMED_SETTINGS: dict[str, str] = {
    "max_memory_slowdown": "it was replaced by max_slowdown_vs_fastest, which bounds the step-time slowdown against"
                           " the fastest fixed policy measured (AMP's plan, the compute-only plan, bf16-mixed, FP32),"
                           " not against FP32; the defaults are 1.15 (memory) and 1.05 (balanced)."}

# setting -> its enum (the advice of a bad value is generated from it)
_CHOICES: dict[str, type[SpelledEnum]] = {"mode": Mode, "tolerance_mode": ToleranceMode, "objective": Objective,
                                          "low_precision": LowPrecision, "fp8": Fp8Choice}
_SELECTORS = "it must be a list of plan selectors (operator names, globs or 'type:ClassName')"


def _every_dimension_auto() -> dict[str, str]:
    return {dimension.value: DimensionChoice.AUTO.value for dimension in AUTO_VALUES}


@dataclass(frozen=True)
class SearchConfig:
    """Validated settings of :class:`~lightning_comp.CoMPSearch`: what the user wants, and how to measure it.

    Attributes:
        monitor: validation metric that judges convergence (logged in ``validation_step``; under DDP log it with
            ``sync_dist=True``).
        mode: ``"min"`` if lower is better (losses), ``"max"`` if higher is better (accuracy).
        tolerance: how much worse than the FP32 reference trial a candidate may end. Relative by default: ``0.02``
            accepts ``val_loss <= 1.02 * reference`` (mode min) or ``acc >= 0.98 * reference`` (mode max).
        tolerance_mode: ``"relative"`` (fraction of ``|reference|``) or ``"absolute"`` (metric units).
        objective: ``"throughput"``, ``"memory"`` (saved-for-backward bytes) or ``"balanced"``. Per operator first;
            then the candidate plan is compared as a whole step with AMP's plan, the all-low and the compute-only
            plans: by time (``"throughput"``), by bytes saved for backward within ``max_slowdown_vs_fastest`` of the
            fastest fixed policy measured (``"memory"``), or by the geometric mean of both ratios within that bound
            (``"balanced"``). ``"memory"`` and
            ``"balanced"`` also search the ``saved``, ``state`` and ``master`` dimensions (``precisions``) and trial
            those choices like compute precision.
        low_precision: the compute dimension's choice: ``"auto"`` (BF16 on CPUs with AVX512-BF16/AMX and on CUDA
            >= sm80, FP16 on CUDA sm70-sm75; where no 16-bit precision is native, e.g. AVX2-only CPUs, compute
            stays FP32: ``"memory"`` and ``"balanced"`` then search the saved and state dimensions alone, as with
            ``"off"``, and ``"throughput"`` trains in FP32 without a search), ``"bf16"`` or ``"fp16"``. Decided
            from the device the model trains on, once Lightning has placed it, and kept by a resumed search.
            ``"off"``: no operator's compute is lowered (every plan the search times or trials computes in FP32,
            which is then the pace) and only the saved and state dimensions are searched (``objective="memory"`` or
            ``"balanced"``): memory without touching the model's numerics of compute, on any device, emulated 16-bit
            ones included (8-bit state, fp8/bf16 storage and recompute need no 16-bit arithmetic).
        fp8: fp8 compute on top of the 16-bit one, for the ``nn.Linear`` operators fp8 kernels take (in and out
            features multiples of 16): ``"auto"`` (``"fp8"`` where the device has native fp8 matmuls, CUDA from sm89;
            none elsewhere), ``"off"``, ``"fp8"`` (per-tensor scales, torchao's ``tensorwise``) or ``"fp8-rowwise"``
            (per-row scales), these two measured even where fp8 is emulated (a CPU). Once the compute candidates are
            decided, each lowered Linear (pooled with the same Linear of the other repeated blocks) is timed in fp8
            against its 16-bit lowering at the plan's cast boundaries (scaling and casts charged) and becomes an fp8
            candidate where it is faster by the speed margin; the plan with them is timed as a whole step too. In the
            epoch stage an fp8 candidate is a lever of its own: where it fails the convergence check the operator is
            demoted to its 16-bit precision, not to FP32. Needs ``low_precision`` bf16 (or ``"auto"`` resolving to
            it): fp8 operators hand on bf16 activations.
        include_fp8: plan selectors of Linear operators to trial in fp8 whatever the batch stage measures (they must
            be ones fp8 kernels take); convergence still decides. Needs ``fp8`` other than ``"off"``.
        precisions: the other dimensions' choices, ``{dimension: choice}`` for ``saved``, ``state`` and ``master``
            (a dimension left out is ``"auto"``); used by ``objective="memory"``/``"balanced"`` only. Every choice
            is ``"auto"``, ``"off"`` (as FP32 training does it) or one value of that dimension:
            ``saved`` (how an operator's tensors saved for backward are kept): ``"auto"`` (cheap operators, as a
            group, recompute their outputs in backward where that pays; the others store ``fp8`` or ``bf16``, the
            smaller that pays per operator), ``"fp8"``, ``"bf16"`` or ``"recompute"`` (recomputation only).
            ``state`` (an ``Adam``/``AdamW`` optimizer's state of each operator's parameters): ``"auto"``
            (``8bit`` or ``bf16``, the smaller that pays per operator), ``"8bit"`` or ``"bf16"``.
            ``master`` (the master weights of each operator the search lowers to bf16): ``"auto"`` or ``"bf16"``
            (held in bf16 with no FP32 copy, stochastically rounded updates, where that pays).
        include: plan selectors of operators to trial in low precision (the compute dimension) whatever the batch
            stage measures.
        include_dimensions: per other dimension, plan selectors of operators whose lowering in that dimension is
            trialled whatever the batch stage measures (at its smallest stored value: ``fp8``, ``8bit``, ``bf16``
            with ``"auto"``), e.g. ``{"saved": ["l2"], "state": ["l3"]}``; convergence still decides.
        exclude: plan selectors of operators never to lower (kept FP32 without trials), e.g. a sensitive head.
        warmup_epochs: FP32 epochs before the search starts (kept as training; at least 1 recommended so every trial
            sees the same batch order).
        trial_epochs: epochs each convergence trial trains.
        trial_batches: if set (a number of batches, or a fraction of the epoch such as ``0.25``, as with
            ``Trainer(limit_train_batches)``), each trial trains only the first that many batches of an epoch and is
            judged by a validation run right there. A rejected trial ends its epoch early and is rewound (its epoch is
            given back through ``max_epochs``, as for whole-epoch trials); the trial that is kept goes on to the end
            of its epoch with its plan, so the kept progress still equals a plain run's. Cuts the cost of the FP32
            reference trial to that many batches. Needs ``trial_epochs=1`` and validation at every epoch end
            (``Trainer(check_val_every_n_epoch=1)``), which is why ``None`` (whole epochs) is the default.
        max_trials: most candidate trials (the FP32 reference not counted); then the best passing group is taken.
        max_slowdown_vs_fastest: the largest step-time slowdown the memory and balanced objectives accept, against
            the *pace*: the fastest of the fixed policies the batch stage times as whole steps (FP32, AMP's plan, the
            compute-only plan and one global autocast region, what ``bf16-mixed`` trains). ``None``: the objective's
            default (:data:`DEFAULT_SLOWDOWN_VS_FASTEST`: ``1.15`` for memory, i.e. at least 0.87x the pace's
            throughput, ``1.05`` for balanced). Each operator's lowering is held to it against its own faster
            precision; the plan with its saved, state and master lowerings (taken cheapest bytes first) is held to
            it as a whole step.
        memory_budget: (``objective="memory"``) the step peak to reach: a float is a fraction of AMP's step peak
            (``0.5``: half of it; with ``low_precision="off"``, which times no AMP, of the FP32 step's), judged by
            the step's measured tensor peak against AMP's plan's (CUDA's allocated peak; on a CPU what the step
            starts with plus the live heap's rise over it); an int is the bytes the job must fit in, judged by the
            peak the process needs for a step of the plan (the CUDA allocator's reserved peak, or a CPU's live heap,
            everything in the process included). The levers are ranked and taken by the search's accounting of the
            step (weights, gradients, optimizer state, saved for backward); where the measured peak misses the
            budget, they are taken further by the difference. The search ranks every memory lever it
            measured (saved precision and recompute per operator or unit, optimizer state and master weights per
            operator) by bytes freed per millisecond added and takes the cheapest until the budget is met, then
            stops. Where the levers within ``max_slowdown_vs_fastest`` do not meet it, it goes on past that bound,
            still cheapest first, unless ``max_slowdown_vs_fastest`` is set explicitly (then the bound holds and the
            record says the budget is not met). ``None``: every lever that fits within ``max_slowdown_vs_fastest`` is
            taken, cheapest first. The frontier it saw (step bytes against step time) is in the record.
        measurement: how the batch stage measures and trials are judged (:class:`MeasurementConfig`): a preset's
            name (``"quick"``, ``"default"``, ``"thorough"``), a ``MeasurementConfig``, or a mapping of its fields.
        record_dir: where to write ``search_record.json`` and ``plan.json`` (default: the Trainer's log dir).
        snapshot_device: where the search keeps its snapshots of the run (model, optimizer state, buffers):
            ``None`` keeps them where the tensors are, ``"cpu"`` spares accelerator memory (slower rewinds).
        verbose: print the decision table on rank 0.

    Raises:
        SearchConfigError: on an invalid setting, naming it and the valid values.
    """

    monitor: str = "val_loss"
    mode: Mode = Mode.MIN
    tolerance: float = 0.02
    tolerance_mode: ToleranceMode = ToleranceMode.RELATIVE
    objective: Objective = Objective.THROUGHPUT
    low_precision: LowPrecision = LowPrecision.AUTO
    fp8: Fp8Choice = Fp8Choice.AUTO
    include_fp8: tuple[str, ...] = ()
    precisions: dict[str, str] = field(default_factory=_every_dimension_auto)
    include: tuple[str, ...] = ()
    include_dimensions: dict[str, list[str]] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    warmup_epochs: int = 1
    trial_epochs: int = 1
    trial_batches: int | float | None = None
    max_trials: int = 12
    max_slowdown_vs_fastest: float | None = None
    memory_budget: float | int | None = None
    measurement: MeasurementConfig = field(default_factory=MeasurementConfig)
    record_dir: str | None = None
    snapshot_device: str | None = None
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", str(self.record_dir))  # a Path is welcome, a str is stored
        for name, choice in _CHOICES.items():
            try:
                object.__setattr__(self, name, choice.parse(getattr(self, name)))
            except SearchConfigError:
                self._fail(name, f"use {choice.alternatives()}")
        object.__setattr__(self, "measurement", MeasurementConfig.parse(self.measurement))
        self._check_numbers()
        self._check_trial_length()
        if self.snapshot_device is not None:
            try:
                torch.device(self.snapshot_device)
            except (RuntimeError, TypeError):
                self._fail("snapshot_device", "use None (keep snapshots where the tensors are) or a device such as"
                           " 'cpu'")
        object.__setattr__(self, "precisions", self._parse_precisions())
        included = {dimension: Selectors(()) for dimension in Dimension}
        included[Dimension.COMPUTE] = self._selectors("include", self.include)
        self._selectors("exclude", self.exclude)
        self._selectors("include_fp8", self.include_fp8)
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        object.__setattr__(self, "include_fp8", tuple(self.include_fp8))
        for dimension, selectors in self._parse_includes().items():
            stored = [value for value in self.tried(dimension) if value is not SavedPrecision.RECOMPUTE]
            if selectors and not stored:
                valid = [DimensionChoice.AUTO, *(v for v in AUTO_VALUES[dimension] if v != SavedPrecision.RECOMPUTE)]
                self._fail("include_dimensions", f"{dimension.value!r} forces a stored lowering, which"
                           f" precisions[{dimension.value!r}]={str(self.precisions[dimension])!r} does not try;"
                           f" it needs {quoted(valid)} there")
            included[dimension] = selectors
        object.__setattr__(self, "include_dimensions",
                           {d: list(s.selectors) for d, s in included.items() if d in AUTO_VALUES and s})
        object.__setattr__(self, "_included", included)
        self._check_compute_off()
        self._check_fp8()

    def _check_fp8(self) -> None:
        """fp8 is searched on top of a bf16 compute search; ``include_fp8`` needs fp8 searched."""
        if self.include_fp8 and self.fp8 is Fp8Choice.OFF:
            raise SearchConfigError(f"CoMPSearch(include_fp8={list(self.include_fp8)!r}) names fp8 candidates, which"
                                    " fp8='off' never tries; use fp8='auto', 'fp8' or 'fp8-rowwise'.")
        if self.fp8 in (Fp8Choice.FP8, Fp8Choice.FP8_ROWWISE) and self.low_precision in (LowPrecision.FP16,
                                                                                           LowPrecision.OFF):
            raise SearchConfigError(f"CoMPSearch(fp8={self.fp8.value!r}) needs low_precision 'auto' or 'bf16' (fp8"
                                    " operators hand on bf16 activations, and are demoted to bf16 where fp8 fails),"
                                    f" not {self.low_precision.value!r}.")

    def _check_compute_off(self) -> None:
        """``low_precision="off"`` searches the memory dimensions alone: it needs an objective that weighs memory and
        a saved or state dimension to search, and no compute candidates."""
        if self.low_precision is not LowPrecision.OFF:
            return
        what = ("CoMPSearch(low_precision='off') lowers no operator's compute precision and searches only what"
                " operators save for backward and their optimizer state, so it needs")
        if self.objective is Objective.THROUGHPUT:
            raise SearchConfigError(f"{what} objective='memory' or 'balanced', not {self.objective.value!r}.")
        if not (self.tried(Dimension.SAVED) or self.tried(Dimension.STATE)):
            raise SearchConfigError(f"{what} precisions['saved'] or precisions['state'] other than 'off' (given:"
                                    f" {self.precisions[Dimension.SAVED]!s}, {self.precisions[Dimension.STATE]!s}).")
        if self.include:
            raise SearchConfigError(f"CoMPSearch(include={list(self.include)!r}) names compute candidates, which"
                                    " low_precision='off' never lowers; use include_dimensions for the saved and"
                                    " state dimensions.")

    def _fail(self, name: str, valid: str) -> None:
        raise SearchConfigError(f"CoMPSearch({name}={getattr(self, name)!r}) is invalid: {valid}.")

    def _parse_precisions(self) -> dict[str, str]:
        given = self.precisions
        if not isinstance(given, Mapping):
            self._fail("precisions", f"it must be a mapping {{dimension: choice}} of the dimensions"
                       f" {quoted((d.value for d in AUTO_VALUES), 'and')}")
        parsed: dict[str, str] = {dimension: DimensionChoice.AUTO for dimension in AUTO_VALUES}
        for key, value in given.items():
            dimension = self._dimension("precisions", key)
            parsed[dimension] = parse_dimension_choice(dimension, value)
        return parsed

    def _parse_includes(self) -> dict[Dimension, Selectors]:
        given = self.include_dimensions
        if not isinstance(given, Mapping):
            self._fail("include_dimensions", f"it must be a mapping {{dimension: [selectors]}} of the dimensions"
                       f" {quoted((d.value for d in AUTO_VALUES), 'and')}")
        return {self._dimension("include_dimensions", key): self._selectors(f"include_dimensions[{key!r}]", value)
                for key, value in given.items()}

    def _dimension(self, name: str, key: object) -> Dimension:
        try:
            dimension = Dimension.parse(key)
        except CoMPError:
            dimension = None
        if dimension not in AUTO_VALUES:
            compute = "; the compute dimension's are low_precision and include" if dimension else ""
            raise SearchConfigError(f"CoMPSearch({name}={{{key!r}: ...}}) is invalid: its keys are the dimensions"
                                    f" {quoted(d.value for d in AUTO_VALUES)}{compute}.")
        return dimension  # type: ignore[return-value]

    def _selectors(self, name: str, value: object) -> Selectors:
        # any sequence of strings: a list, a tuple, or the ListConfig of a Hydra node instantiated without _convert_
        if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
            raise SearchConfigError(f"CoMPSearch({name}={value!r}) is invalid: {_SELECTORS}.")
        try:
            return Selectors.of(tuple(value))
        except PlanError as err:
            raise SearchConfigError(f"CoMPSearch({name}=...): {err}") from None

    def _check_numbers(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            self._fail("monitor", "it must be the name of a metric logged during validation, e.g. 'val_loss'")
        if not _number(self.tolerance) or not math.isfinite(self.tolerance) or self.tolerance < 0:
            self._fail("tolerance", "it must be a finite number >= 0")
        for name, low in (("warmup_epochs", 0), ("trial_epochs", 1), ("max_trials", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                self._fail(name, f"it must be an integer >= {low}")
        bound = self.max_slowdown_vs_fastest
        if bound is not None and (not _number(bound) or not bound >= 1):
            self._fail("max_slowdown_vs_fastest", "it must be None (the objective's default) or a number >= 1 (the"
                       " step-time slowdown against the fastest fixed policy accepted for memory)")
        budget = self.memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) \
                    or budget <= 0:
                self._fail("memory_budget", "it must be None, a fraction of AMP's step peak (a float > 0, e.g. 0.5)"
                           " or a number of bytes (an int > 0)")
            if self.objective is not Objective.MEMORY:
                self._fail("memory_budget", f"it needs objective='memory', not {self.objective.value!r}")
        if not isinstance(self.verbose, bool):
            self._fail("verbose", "use True or False")

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
        """The names of every setting, in order (``CoMPSearch``'s keyword arguments)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> SearchConfig:
        """The defaults with ``settings`` (setting name -> value) in place of theirs.

        Raises:
            SearchConfigError: naming a setting that does not exist, and the ones that do; or an invalid value.
        """
        for old, why in RENAMED_SETTINGS.items():
            if old in settings:
                raise SearchConfigError(f"CoMPSearch({old}={settings[old]!r}): {why}")
        unknown = sorted(set(settings) - set(cls.setting_names()))
        if unknown:
            measured = [name for name in unknown if name in {f.name for f in fields(MeasurementConfig)}]
            hint = (f" ({quoted(measured, 'and')} tune the measurement: measurement={{{measured[0]!r}: ...}})"
                    if measured else "")
            raise SearchConfigError(f"CoMPSearch has no setting {quoted(unknown, 'and')}; its settings are"
                                    f" {', '.join(cls.setting_names())}{hint}.")
        return cls(**settings)

    def included(self, dimension: Dimension) -> Selectors:
        """Operators whose lowering in ``dimension`` is trialled whatever the batch stage measures."""
        return self._included[dimension]  # type: ignore[attr-defined, no-any-return]

    @property
    def excluded(self) -> Selectors:
        """Operators never lowered."""
        return Selectors(self.exclude)

    def budget_bytes(self, amp_step_bytes: float) -> float | None:
        """The step bytes ``memory_budget`` asks for, given AMP's step bytes (``None``: no budget)."""
        budget = self.memory_budget
        if budget is None:
            return None
        return float(budget) if isinstance(budget, int) else float(budget) * amp_step_bytes

    @property
    def slowdown_vs_fastest(self) -> float:
        """The step-time slowdown against the fastest fixed policy the objective accepts (``max_slowdown_vs_fastest``
        or the objective's default; ``inf`` for throughput, which weighs no memory)."""
        if self.max_slowdown_vs_fastest is not None:
            return float(self.max_slowdown_vs_fastest)
        return DEFAULT_SLOWDOWN_VS_FASTEST.get(self.objective, math.inf)

    def tried(self, dimension: Dimension) -> tuple[Any, ...]:
        """The values of ``dimension`` (saved, state or master) the search may try, smallest first; empty when
        ``precisions`` switches it off (``recompute``, storing nothing, comes after the stored values). Each is a
        member of ``dimension.values``."""
        return tried_values(dimension, self.precisions[dimension])

    def resolve_fp8(self, device: DeviceClass, low: ComputePrecision | None) -> ComputePrecision | None:
        """The fp8 precision to search with on ``device`` on top of ``low`` (``None``: no fp8 search).

        ``"auto"`` is ``fp8`` where ``device`` has native fp8 matmuls; an explicit recipe is searched wherever fp8
        runs at all (its measurements decide; ``include_fp8`` forces candidates). Only on top of bf16.
        """
        if self.fp8 is Fp8Choice.OFF or low is not ComputePrecision.BF16:
            return None
        if self.fp8 is Fp8Choice.AUTO:
            return ComputePrecision.FP8 if device.is_native(ComputePrecision.FP8) else None
        precision = ComputePrecision.parse(self.fp8.value)
        return precision if device.runs(precision) else None

    def resolve_low_precision(self, device: DeviceClass) -> ComputePrecision | None:
        """The 16-bit precision to search with on ``device``: FP32 where compute is not searched but the memory
        dimensions are (``"off"``), ``None`` where nothing is searched.

        ``"auto"`` prefers BF16 (no loss scaling), then FP16; where neither is native (an AVX2-only CPU, a GPU before
        sm70), an objective that weighs memory still searches the saved and state dimensions, which need no 16-bit
        arithmetic (FP32), and ``"throughput"`` nothing (``None``). An explicit ``"bf16"``/``"fp16"`` is taken as
        is.
        """
        if self.low_precision is LowPrecision.OFF:
            return ComputePrecision.FP32
        if self.low_precision is not LowPrecision.AUTO:
            return ComputePrecision.parse(self.low_precision.value)
        for precision in (ComputePrecision.BF16, ComputePrecision.FP16):
            if device.is_native(precision):
                return precision
        if self.objective is not Objective.THROUGHPUT and (self.tried(Dimension.SAVED) or self.tried(Dimension.STATE)):
            return ComputePrecision.FP32  # the memory dimensions alone: storage, 8-bit state and recompute
        return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
