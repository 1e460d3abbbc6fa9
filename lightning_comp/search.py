"""``CoMPSearch``: the convergence-aware two-stage search for a model's precision plan.

The search runs inside the user's ``trainer.fit`` and never changes the model's code:

1. **Warm-up.** The first ``warmup_epochs`` train in FP32 as usual (early metrics are too noisy to judge by).
2. **Batch stage (performance).** At the first batch of the search, the training step is run repeatedly on that
   batch, in FP32 and with every operator lowered, to measure each operator's forward and backward time and the
   bytes it saves for backward. Operators whose low-precision cost (casts included) does not beat FP32 by the margin
   stay FP32 and are never trialled. Cheap operators (norms, activations) between two lowered operators are lowered
   too when that costs no time, so activations stay in low precision across the run. The candidate plan as a whole
   must beat FP32 in interleaved whole-step timing, or the search ends with FP32.
3. **Epoch stage (convergence).** From one snapshot (model, optimizers, schedulers, scaler, RNG), an FP32 reference
   trial and candidate trials are trained for ``trial_epochs`` each on the same batches and judged on the monitored
   validation metric against the reference (``tolerance``); NaN/Inf losses and too many FP16 skipped steps reject a
   trial. Unsafe operators are isolated by adaptive group testing (:mod:`lightning_comp.group_search`).
4. **Rewind and keep.** Rejected trials are rewound bit-exactly; the chosen trial's progress is kept, and
   ``max_epochs`` is extended by the epochs of rejected trials, so the user's training is not shortened.
   ``EarlyStopping`` is paused meanwhile (:mod:`lightning_comp.callback_pause`), so rewound trials never count.

The decision record (trials, per-operator measurements and reasons, cost) is kept in the callback state, written as
JSON next to the logs, logged to the Trainer's loggers and printed on rank 0.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_comp.callback_pause import CallbackPause
from lightning_comp.casting import StepKind
from lightning_comp.devices import DeviceClass, device_class, model_device
from lightning_comp.dtypes import Precision, parse_precision
from lightning_comp.errors import PlanError, PlanMismatchError, SearchConfigError, UnsupportedSetupError
from lightning_comp.group_search import GroupSearch
from lightning_comp.operators import Lowering, OperatorKind, classify, iter_operators, lowering_for
from lightning_comp.plan import PrecisionPlan
from lightning_comp.plugin import CoMPPrecision
from lightning_comp.profiling import OperatorProfiler, ProfileResult, StepTimer
from lightning_comp.report import format_record
from lightning_comp.snapshot import TrainingSnapshot, capture_rng, restore_rng

__all__ = ["CoMPSearch", "SearchConfig", "Objective"]

_STATE_VERSION = 1
_HEAVY_KINDS = (OperatorKind.COMPUTE, OperatorKind.EMBEDDING, OperatorKind.OTHER)
_TIMING_SKIP_BATCHES = 2


class Objective(str, Enum):
    """What the batch stage optimises."""

    THROUGHPUT = "throughput"  # lower an operator when it gets faster
    MEMORY = "memory"  # lower an operator when it saves memory for backward (and is not much slower)
    BALANCED = "balanced"  # lower an operator when the geometric mean of its time and memory ratios improves


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

    def __post_init__(self) -> None:
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
        if self.trial_batches is not None:
            value = self.trial_batches
            count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            fraction = isinstance(value, float) and 0.0 < value <= 1.0
            if not (count or fraction):
                fail("trial_batches", "it must be None (whole epochs), a number of batches >= 1, or a fraction of the"
                     " epoch in (0, 1]")
            if self.trial_epochs != 1:
                fail("trial_batches", f"trials of a number of batches need trial_epochs=1, not {self.trial_epochs}")
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
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                fail(name, "it must be a list of plan selectors (operator names, globs or 'type:ClassName')")
            object.__setattr__(self, name, tuple(value))
            try:
                PrecisionPlan.from_dict({selector: "bf16" for selector in value})
            except PlanError as err:
                raise SearchConfigError(f"CoMPSearch({name}=...): {err}") from None

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


class CoMPSearch(Callback):
    """Search a per-operator precision plan for the model being trained, then train with it.

    Use with the plugin: ``Trainer(plugins=[CoMPPrecision()], callbacks=[CoMPSearch()])``.

    Args:
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
        profile_steps: measured training steps per configuration in the batch stage (minima are used).
        profile_warmup: unmeasured steps per configuration before those.
        low_precision: ``"auto"`` (BF16 on CPUs with AVX512-BF16/AMX and on CUDA >= sm80, FP16 on CUDA sm70-sm75,
            FP32 without a search where no 16-bit precision is native, e.g. AVX2-only CPUs), ``"bf16"`` or ``"fp16"``.
            Decided from the device the model trains on, once Lightning has placed it.
        objective: ``"throughput"``, ``"memory"`` (saved-for-backward bytes) or ``"balanced"``. Per operator first;
            then the candidate plan is compared as a whole step with the all-low and the compute-only plans: by time
            (``"throughput"``), by bytes saved for backward within ``max_memory_slowdown`` of FP32 (``"memory"``), or
            by the geometric mean of both ratios to FP32 (``"balanced"``).
        speed_margin: fraction by which lowering must beat FP32 before it is preferred (noise guard).
        min_gain_ms: smallest per-step time gain (ms) an operator must show to be lowered.
        max_trials: budget of candidate trials (the reference trial not counted).
        max_skipped_fraction: FP16 trials whose loss scaler skips more than this fraction of steps are rejected.
        max_memory_slowdown: with ``objective="memory"``, the largest slowdown accepted for an operator, and for a
            whole-step plan against FP32.
        include: plan selectors (names, globs, ``"type:Linear"``) of operators to trial in low precision whatever
            the batch stage measures (convergence still decides).
        exclude: plan selectors of operators never to lower (kept FP32 without trials), e.g. a sensitive head.
        record_dir: where to write ``comp_search.json`` and ``comp_plan.json`` (default: the Trainer's log dir).
        verbose: print the decision table on rank 0.

    Note:
        ``EarlyStopping`` callbacks are paused from the search's first trial until the model holds its final state
        (the kept trial, or the rewound snapshot): they neither count the trials' validations against their patience
        nor stop the fit on a rejected trial's NaN. Their state travels in the search's checkpoint state meanwhile.
        ``ModelCheckpoint`` keeps saving during the search, so a run killed inside it resumes the search; a
        monitored "best" checkpoint can therefore be a trial that the search later rewound.

    Raises:
        SearchConfigError: on an invalid argument (the message names it and the valid values).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        tolerance: float = 0.02,
        tolerance_mode: str = "relative",
        warmup_epochs: int = 1,
        trial_epochs: int = 1,
        trial_batches: int | float | None = None,
        profile_steps: int = 4,
        profile_warmup: int = 1,
        low_precision: str = "auto",
        objective: str = "throughput",
        speed_margin: float = 0.05,
        min_gain_ms: float = 0.005,
        max_trials: int = 12,
        max_skipped_fraction: float = 0.05,
        max_memory_slowdown: float = 1.5,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        record_dir: str | None = None,
        verbose: bool = True,
    ) -> None:
        self.config = SearchConfig(
            monitor=monitor,
            mode=mode,
            tolerance=tolerance,
            tolerance_mode=tolerance_mode,
            warmup_epochs=warmup_epochs,
            trial_epochs=trial_epochs,
            trial_batches=trial_batches,
            profile_steps=profile_steps,
            profile_warmup=profile_warmup,
            low_precision=low_precision,
            objective=Objective(objective) if objective in Objective._value2member_map_ else objective,  # type: ignore[arg-type]
            speed_margin=speed_margin,
            min_gain_ms=min_gain_ms,
            max_trials=max_trials,
            max_skipped_fraction=max_skipped_fraction,
            max_memory_slowdown=max_memory_slowdown,
            include=tuple(include) if not isinstance(include, str) else include,  # type: ignore[arg-type]
            exclude=tuple(exclude) if not isinstance(exclude, str) else exclude,  # type: ignore[arg-type]
            record_dir=None if record_dir is None else str(record_dir),
            verbose=verbose,
        )
        self._plugin: CoMPPrecision | None = None
        self._low: Precision | None = None
        self._user_max_epochs: int | None = None
        self._user_max_steps: int | None = None
        self._batch_started: float | None = None
        self._fit_started: float | None = None
        self._monitor_checked = False
        self._val_check_batch: int | float | None = None  # the Trainer's, while a trial of batches changes it
        self._max_batches: int | float | None = None  # the Trainer's, while a rejected trial of batches cuts an epoch
        # EarlyStopping must not judge trials that are rewound (nor stop the fit on a rejected trial's NaN)
        self._early_stopping = CallbackPause(_is_early_stopping)
        self._paused_states: dict[str, dict[str, Any]] = {}  # their states, from a checkpoint written during a pause
        self._state = self._fresh_state()

    @staticmethod
    def _fresh_state() -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "phase": "pending",  # pending -> searching -> done
            "search_start_epoch": None,
            "snapshot": None,
            "reference_end": None,
            "pending_restore": None,  # None | "snapshot" | "reference_end"
            "profile": None,
            "runs": [],
            "group_search": None,
            "trials": [],
            "extension_epochs": 0,
            "extension_steps": 0,
            "chosen": None,
            "chosen_label": None,
            "low_precision": None,
            "profiling_seconds": 0.0,
            "fit_seconds": 0.0,
            "kept_trial": None,
            "finish_reason": None,
            "warmup_batches": 0,
        }

    # -------------------------------------------------------------------------------------------- public state
    @property
    def state_key(self) -> str:
        """Constant, so a checkpoint resumes the search whatever arguments the callback is built with."""
        return "CoMPSearch"

    @property
    def phase(self) -> str:
        """``"pending"`` (warm-up), ``"searching"`` or ``"done"``."""
        return str(self._state["phase"])

    @property
    def chosen_plan(self) -> PrecisionPlan | None:
        """The plan the search chose, once it is done."""
        chosen = self._state["chosen"]
        return None if chosen is None else PrecisionPlan.from_dict(chosen)

    @property
    def record(self) -> dict[str, Any] | None:
        """The decision record (JSON-able) once the search is done, else ``None``."""
        if self._state["phase"] != "done":
            return None
        return self._build_record()

    # --------------------------------------------------------------------------------------------- setup hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        if not isinstance(plugin, CoMPPrecision):
            raise UnsupportedSetupError(
                f"CoMPSearch needs the CoMPPrecision plugin, but the Trainer uses {type(plugin).__name__}"
                f" (precision={trainer.precision!r}). Use Trainer(plugins=[CoMPPrecision()], callbacks=[CoMPSearch()])"
                " and leave Trainer(precision=...) unset."
            )
        strategy = type(trainer.strategy).__name__
        if any(bad in strategy for bad in ("FSDP", "DeepSpeed", "XLA", "ModelParallel")):
            raise UnsupportedSetupError(
                f"CoMPSearch cannot run under {strategy}: it rewinds and re-hooks the whole model, which sharded"
                " strategies do not allow. Use strategy='auto', 'ddp' or 'ddp_spawn'."
            )
        if trainer.limit_val_batches == 0:
            raise SearchConfigError(
                f"CoMPSearch judges trials by a validation metric (monitor={self.config.monitor!r}), but"
                f" Trainer(limit_val_batches={trainer.limit_val_batches!r}) disables validation. Use"
                " limit_val_batches > 0 (a fraction or a number of batches)."
            )
        if self.config.trial_batches is not None and (
                trainer.check_val_every_n_epoch != 1 or getattr(trainer, "_val_check_time_interval", None) is not None):
            raise SearchConfigError(
                f"CoMPSearch(trial_batches={self.config.trial_batches}) validates inside the epoch and needs"
                f" Trainer(check_val_every_n_epoch=1) with a batch-count or fractional val_check_interval, not"
                f" check_val_every_n_epoch={trainer.check_val_every_n_epoch!r} /"
                f" val_check_interval={trainer.val_check_interval!r}. Or use whole-epoch trials (trial_batches=None)."
            )
        if trainer.check_val_every_n_epoch is not None and self.config.trial_epochs % trainer.check_val_every_n_epoch:
            raise SearchConfigError(
                f"CoMPSearch(trial_epochs={self.config.trial_epochs}) must be a multiple of"
                f" Trainer(check_val_every_n_epoch={trainer.check_val_every_n_epoch}), so each trial ends with a"
                " validation run."
            )
        self._plugin = plugin

    def _resolve_device(self, pl_module: pl.LightningModule) -> None:
        """Decide the search's 16-bit precision from the device the model trains on (placed by now)."""
        assert self._plugin is not None
        device = device_class(model_device(pl_module))
        self._low = self.config.resolve_low_precision(device)
        if self._low is Precision.FP16 and not (self._plugin.allow_slow_fp16 or device.is_native(Precision.FP16)):
            raise SearchConfigError(
                f"CoMPSearch(low_precision='fp16') on {device.describe()}, which has no fast fp16 (a CPU's fp16"
                " convolution backward is ~100x slower than fp32). Use low_precision='auto' or 'bf16', or pass"
                " CoMPPrecision(allow_slow_fp16=True) to insist."
            )
        if self._low is not None and not device.is_native(self._low) and self._state["phase"] == "pending":
            rank_zero_warn(
                f"CoMPSearch(low_precision={self.config.low_precision!r}) on {device.describe()}, where"
                f" {self._low} is emulated: its trials run slower than fp32 and the batch stage will most likely"
                " keep fp32. low_precision='auto' skips the search on such a device."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = time.perf_counter()
        self._resolve_device(pl_module)
        self._user_max_epochs = trainer.fit_loop.max_epochs
        self._user_max_steps = trainer.fit_loop.max_steps
        self._apply_extension(trainer)
        assert self._plugin is not None
        self._check_selectors(pl_module)
        if self._state["phase"] == "done" and self._state["chosen"] is not None:
            self._plugin._set_search_plan(PrecisionPlan.from_dict(self._state["chosen"]))
        elif self._low is None and self._state["phase"] == "pending":
            self._finish(trainer, PrecisionPlan(), "fp32", reason="no 16-bit precision pays on this device")
        elif self._state["phase"] == "pending":
            why = self._nothing_to_search(pl_module)
            if why is not None:  # finish at once: no profiling, no trials, no extra epochs
                rank_zero_warn(f"CoMPSearch: {why}. Training continues in fp32 without a search.")
                self._finish(trainer, PrecisionPlan(), "fp32", reason=why)
        if self._in_search():  # resumed inside the search
            self._early_stopping.pause(trainer, self._paused_states)

    def _check_selectors(self, pl_module: pl.LightningModule) -> None:
        """Fail on ``include``/``exclude`` selectors that match no operator (a typo must not lower a layer)."""
        for name in ("include", "exclude"):
            selectors = getattr(self.config, name)
            if not selectors:
                continue
            try:
                PrecisionPlan.from_dict({selector: "bf16" for selector in selectors}).validate(pl_module)
            except PlanMismatchError as err:
                raise SearchConfigError(f"CoMPSearch({name}={list(selectors)!r}): {err}") from None

    def _nothing_to_search(self, pl_module: pl.LightningModule) -> str | None:
        """Why no operator can ever be a candidate (``None`` if some can)."""
        assert self._low is not None
        device = model_device(pl_module)
        operators = list(iter_operators(pl_module))
        lowerable = [(n, m) for n, m in operators
                     if lowering_for(m, self._low, device) not in (None, Lowering.NONE)]
        if not lowerable:
            shown = ", ".join(f"{n or '<root>'} ({type(m).__name__})" for n, m in operators[:8])
            more = f", ... ({len(operators)} in all)" if len(operators) > 8 else ""
            return (f"{type(pl_module).__name__} has no operator that {self._low} can apply to on {device}"
                    f" (its operators: {shown + more if shown else 'none'})")
        exclude = PrecisionPlan.from_dict({selector: "bf16" for selector in self.config.exclude})
        if all(exclude._match(n, type(m)) is not None for n, m in lowerable):
            return (f"every operator that {self._low} can apply to is excluded by"
                    f" CoMPSearch(exclude={list(self.config.exclude)!r})")
        return None

    def _apply_extension(self, trainer: pl.Trainer) -> None:
        if self._user_max_epochs is not None and self._user_max_epochs >= 0:
            trainer.fit_loop.max_epochs = self._user_max_epochs + int(self._state["extension_epochs"])
        if self._user_max_steps is not None and self._user_max_steps > 0:
            # FitLoop.max_steps is a read-only view of the epoch loop's
            trainer.fit_loop.epoch_loop.max_steps = self._user_max_steps + int(self._state["extension_steps"])

    # -------------------------------------------------------------------------------------------- epoch hooks
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state
        if state["phase"] == "done":
            self._apply_pending_restore(trainer, pl_module)
            return
        if state["phase"] == "pending":
            if trainer.current_epoch < self.config.warmup_epochs:
                return
            state["phase"] = "searching"
            state["search_start_epoch"] = trainer.current_epoch
            state["warmup_batches"] = int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
            state["snapshot"] = TrainingSnapshot.capture(trainer, pl_module, self._scaler()).to_state()
            self._early_stopping.pause(trainer)
            self._start_trial(trainer, pl_module, label="fp32 reference", group=None, rewind=False)
            return
        current = self._current_trial()
        if current is not None and self._trial_due(current, trainer.current_epoch):
            self._close_trial(trainer, pl_module)  # resumed from a checkpoint written before the verdict
            if state["phase"] == "done":
                self._apply_pending_restore(trainer, pl_module)
                return
            current = None
        if current is None:
            self._start_next_trial(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._state["phase"] != "searching":
            return
        if self._state["profile"] is None:
            self._batch_stage(trainer, pl_module, batch, batch_idx)
            if self._state["phase"] != "searching":
                return
        current = self._current_trial()
        if current is not None and current.get("batches") and trainer.val_check_batch != current["batches"]:
            if self._val_check_batch is None:
                self._val_check_batch = trainer.val_check_batch
            trainer.val_check_batch = current["batches"]
        if self._on_cuda(pl_module):
            torch.cuda.synchronize()
        self._batch_started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        current = self._current_trial()
        if current is None or self._state["phase"] != "searching":
            return
        if self._batch_started is not None and batch_idx >= _TIMING_SKIP_BATCHES:
            if self._on_cuda(pl_module):
                torch.cuda.synchronize()
            current["batch_ms"].append((time.perf_counter() - self._batch_started) * 1e3)
        self._batch_started = None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            current["nonfinite_loss"] = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._monitor_checked:  # fail on the sanity check already, before any epoch is spent
            self._check_monitor(trainer)
        if trainer.sanity_checking or self._state["phase"] != "searching":
            return
        current = self._current_trial()
        if current is None:
            return
        batches = current.get("batches")
        if batches and trainer.fit_loop.epoch_loop.batch_progress.current.ready != batches:
            return  # a validation of the user's own schedule, not the one that ends this trial
        self._check_monitor(trainer)
        current["metrics"][str(trainer.current_epoch)] = float(trainer.callback_metrics[self.config.monitor])
        if batches:
            self._close_trial_of_batches(trainer, pl_module)

    def _close_trial_of_batches(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Judge a trial of ``trial_batches`` batches; end its epoch here unless it is the trial that is kept."""
        index = len(self._state["trials"]) - 1
        self._close_trial(trainer, pl_module)
        self._restore_val_check(trainer)
        state = self._state
        if state["phase"] == "done" and state.get("kept_trial") == index:
            return  # the chosen trial trains on to the end of its epoch: its progress is kept whole
        loop = trainer.fit_loop
        self._max_batches = loop.max_batches
        loop.max_batches = loop.epoch_loop.batch_progress.current.ready  # this epoch ends after this batch
        if state["phase"] == "done" and _no_epoch_follows(trainer):
            self._apply_pending_restore(trainer, pl_module)  # no epoch start follows to apply it

    def _restore_val_check(self, trainer: pl.Trainer) -> None:
        if self._val_check_batch is not None:
            trainer.val_check_batch = self._val_check_batch
            self._val_check_batch = None

    def _check_monitor(self, trainer: pl.Trainer) -> None:
        metrics = trainer.callback_metrics
        if self.config.monitor not in metrics:
            available = sorted(k for k in metrics)
            raise SearchConfigError(
                f"CoMPSearch(monitor={self.config.monitor!r}) was not logged during validation; logged metrics are"
                f" {available or '(none)'}. Log it in validation_step with self.log({self.config.monitor!r}, ...)"
                " or set monitor= to one of those."
            )
        self._monitor_checked = True

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._max_batches is not None:  # a rejected trial of batches cut this epoch short; the next is whole
            trainer.fit_loop.max_batches = self._max_batches
            self._max_batches = None
        current = self._current_trial()
        if self._state["phase"] != "searching" or current is None:
            return
        if self._trial_due(current, trainer.current_epoch + 1):
            self._close_trial(trainer, pl_module)  # may extend max_epochs/max_steps: ask what follows afterwards
            if _no_epoch_follows(trainer):
                # No epoch follows whose start would apply a pending rewind (the last trial was rejected and the
                # run ends here): apply it now, so the model the fit returns and the last checkpoint are not the
                # rejected trial's.
                self._apply_pending_restore(trainer, pl_module)
            return
        stopping = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        last_epoch = current["start_epoch"] + self.config.trial_epochs - 1
        if trainer.current_epoch >= last_epoch and str(last_epoch) not in current["metrics"] and not stopping:
            raise SearchConfigError(
                f"CoMPSearch judges each trial by the validation metric {self.config.monitor!r} at the end of the"
                f" trial's last epoch, but no validation ran at the end of epoch {last_epoch}. Pass val_dataloaders"
                " to trainer.fit, keep Trainer(limit_val_batches) > 0 and validate at the end of every trial"
                f" (check_val_every_n_epoch must divide trial_epochs={self.config.trial_epochs}). Metrics logged so"
                f" far: {sorted(trainer.callback_metrics) or '(none)'}."
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state["phase"] == "done":  # training stopped before the epoch start that would apply a rewind
            self._apply_pending_restore(trainer, pl_module)
        elif self._state["phase"] == "searching":
            last = self._state["trials"][-1]["label"] if self._state["trials"] else None
            rank_zero_warn(
                f"CoMPSearch: training stopped during the search (trainer.should_stop, max_time or max_steps), in or"
                f" after trial {last!r}. The model holds the state and plan of that trial, which the search may have"
                " rejected. Resume from a checkpoint written during the search (e.g. last.ckpt) to finish it."
            )
        self._early_stopping.resume(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._early_stopping.resume(trainer)  # hand the Trainer back with its callbacks

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit_started is not None:
            self._state["fit_seconds"] = float(self._state["fit_seconds"]) + time.perf_counter() - self._fit_started
            self._fit_started = None
        if self._state["phase"] == "done":
            self._publish(trainer, final=True)

    # ---------------------------------------------------------------------------------------------- trials
    def _scaler(self) -> Any:
        return None if self._plugin is None else self._plugin.scaler

    @staticmethod
    def _on_cuda(pl_module: pl.LightningModule) -> bool:
        return model_device(pl_module).type == "cuda"

    def _in_search(self) -> bool:
        """Whether trials are running or one's state is still to be rewound (EarlyStopping is paused then)."""
        state = self._state
        return state["phase"] == "searching" or (state["phase"] == "done" and state["pending_restore"] is not None)

    def _current_trial(self) -> dict[str, Any] | None:
        trials = self._state["trials"]
        if trials and trials[-1]["verdict"] is None:
            return trials[-1]
        return None

    def _trial_due(self, trial: dict[str, Any], epochs_finished: int) -> bool:
        last_epoch = trial["start_epoch"] + self.config.trial_epochs - 1
        return epochs_finished > last_epoch and str(last_epoch) in trial["metrics"]

    def _trial_batches(self, epoch_length: int | float, accumulate: int = 1) -> int | None:
        """How many batches a trial trains (``None``: the whole epoch).

        Rounded up to whole optimizer steps under gradient accumulation, so a cut epoch leaves no half-accumulated
        gradient behind.
        """
        wanted = self.config.trial_batches
        if wanted is None or not isinstance(epoch_length, int):  # inf (an iterable without length) is a float
            return None
        batches = max(1, int(wanted * epoch_length)) if isinstance(wanted, float) else wanted
        batches = math.ceil(batches / accumulate) * accumulate
        return batches if batches < epoch_length else None

    def _plan_for(self, group: tuple[str, ...] | None) -> PrecisionPlan:
        """The plan that lowers ``group`` (plus the cheap operators between lowered ones)."""
        if not group:
            return PrecisionPlan()
        assert self._low is not None
        low = set(group)
        entries = {name: self._low.value for name in group}
        for run in self._state["runs"]:
            if run["before"] in low and run["after"] in low:
                entries.update({name: self._low.value for name in run["operators"]})
        return PrecisionPlan.from_dict(entries)

    def _start_trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule, label: str,
                     group: tuple[str, ...] | None, rewind: bool) -> None:
        assert self._plugin is not None
        state = self._state
        if rewind:
            self._rewind(trainer, pl_module, state["snapshot"])
            self._set_sampler_epoch(trainer, int(state["search_start_epoch"]))
        plan = self._plan_for(group).with_provenance(role="trial", trial=label)
        self._plugin._set_search_plan(plan)
        batches = self._trial_batches(trainer.num_training_batches, trainer.accumulate_grad_batches)
        state["trials"].append({
            "batches": batches,
            "label": label,
            "group": None if group is None else list(group),
            "plan": self._plugin.plan.to_dict(),
            "start_epoch": trainer.current_epoch,
            "start_step": trainer.global_step,
            "metrics": {},
            "batch_ms": [],
            "nonfinite_loss": False,
            "skipped_steps_before": self._plugin.skipped_steps,
            "steps_before": self._plugin.optimizer_steps,
            "started": time.time(),
            "seconds": None,
            "verdict": None,
            "reason": None,
        })
        state["extension_epochs"] += self.config.trial_epochs  # provisional: given back if this trial is kept
        self._apply_extension(trainer)

    def _start_next_trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        search = GroupSearch.from_state(self._state["group_search"])
        group = search.next_group()
        if group is None:  # pragma: no cover - the search finishes when its result is reached
            raise RuntimeError("CoMPSearch has no trial to run although the search is not finished.")
        label = "confirm safe set" if search.confirming is not None else (
            "all candidates" if group == search.candidates else f"group of {len(group)}")
        self._start_trial(trainer, pl_module, label=label, group=group, rewind=True)

    def _close_trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._plugin is not None
        state = self._state
        trial = self._current_trial()
        assert trial is not None
        last_epoch = str(trial["start_epoch"] + self.config.trial_epochs - 1)
        trial["metric"] = trial["metrics"][last_epoch]
        # the batch stage runs inside the reference trial's first batch and is counted apart
        trial["seconds"] = time.time() - trial["started"] - float(trial.get("profiling_seconds", 0.0))
        trial["steps"] = trainer.global_step - trial["start_step"]
        steps = max(1, self._plugin.optimizer_steps - trial["steps_before"])
        trial["skipped_steps"] = self._plugin.skipped_steps - trial["skipped_steps_before"]
        state["extension_steps"] += trial["steps"]  # provisional, like the epochs: given back if this trial is kept
        self._apply_extension(trainer)  # before Lightning checks max_steps after this batch
        trial["median_step_ms"] = statistics.median(trial["batch_ms"]) if trial["batch_ms"] else None
        verdict, reason = self._judge(trial, steps)
        verdict, reason = trainer.strategy.broadcast((verdict, reason), src=0)
        trial["verdict"], trial["reason"] = verdict, reason
        if trial["group"] is None:  # the FP32 reference trial
            if not trial.get("batches"):  # a reference of batches is never continued: its epoch was cut short
                state["reference_end"] = TrainingSnapshot.capture(trainer, pl_module, self._scaler()).to_state()
            return
        search = GroupSearch.from_state(state["group_search"])
        search.report(tuple(trial["group"]), verdict == "pass")
        state["group_search"] = search.state_dict()
        if not search.done:
            return
        result = tuple(search.result or ())
        if not result:
            self._finish(trainer, PrecisionPlan(), "fp32 reference", reason="no candidate converged",
                         restore="snapshot" if state["trials"][0].get("batches") else "reference_end")
        elif verdict == "pass" and tuple(trial["group"]) == result:
            self._finish(trainer, self._plan_for(result), trial["label"], reason="converged", kept=True)
        else:
            label = next((t["label"] for t in state["trials"] if t["group"] and tuple(t["group"]) == result), "")
            self._finish(trainer, self._plan_for(result), label, reason="best passing group", restore="snapshot")

    def _judge(self, trial: dict[str, Any], steps: int) -> tuple[str, str]:
        metric = trial["metric"]
        if trial["nonfinite_loss"] or not math.isfinite(metric):
            return "fail", "NaN/Inf loss or metric"
        skipped = trial["skipped_steps"] / steps
        if skipped > self.config.max_skipped_fraction:
            return "fail", f"fp16 loss scaler skipped {skipped:.0%} of steps"
        if trial["group"] is None:
            return "pass", "reference"
        reference = self._reference_metric()
        bound = self._bound(reference)
        ok = metric <= bound if self.config.mode == "min" else metric >= bound
        relation = "<=" if self.config.mode == "min" else ">="
        if ok:
            return "pass", f"{metric:.6g} {relation} {bound:.6g}"
        return "fail", f"{metric:.6g} not {relation} {bound:.6g} (reference {reference:.6g})"

    def _reference_metric(self) -> float:
        return float(self._state["trials"][0]["metric"])

    def _bound(self, reference: float) -> float:
        slack = self.config.tolerance * (abs(reference) if self.config.tolerance_mode == "relative" else 1.0)
        return reference + slack if self.config.mode == "min" else reference - slack

    def _finish(self, trainer: pl.Trainer, plan: PrecisionPlan, label: str, reason: str, kept: bool = False,
                restore: str | None = None) -> None:
        """End the search with ``plan``.

        Args:
            kept: the trial now ending trained with ``plan``: keep its progress (its epochs are not extra).
            restore: ``"reference_end"`` to continue from the end of the FP32 reference trial (its epochs are kept),
                ``"snapshot"`` to rewind to the search's start; applied at the next epoch start.
        """
        assert self._plugin is not None
        state = self._state
        if kept or restore == "reference_end":
            state["extension_epochs"] -= self.config.trial_epochs
            state["extension_steps"] -= int(state["trials"][-1 if kept else 0].get("steps") or 0)
        state["kept_trial"] = (len(state["trials"]) - 1 if kept else 0 if restore == "reference_end" else None)
        state["pending_restore"] = restore
        if restore != "snapshot":
            state["snapshot"] = None
        if restore != "reference_end":
            state["reference_end"] = None
        chosen = plan.with_provenance(
            role="chosen", made_by="CoMPSearch", trial=label, reason=reason, monitor=self.config.monitor,
            tolerance=self.config.tolerance, tolerance_mode=self.config.tolerance_mode,
        )
        self._plugin._set_search_plan(chosen)
        state["chosen"] = self._plugin.plan.to_dict()
        state["chosen_label"] = label
        state["finish_reason"] = reason
        state["phase"] = "done"
        self._apply_extension(trainer)
        if restore is None:  # the model holds its final state now; otherwise once the rewind is applied
            self._early_stopping.resume(trainer)
        self._publish(trainer, final=False)

    def _apply_pending_restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state
        restore = state["pending_restore"]
        if restore is None:
            return
        snapshot = state[restore]
        if snapshot is not None:
            chosen = self._plugin.plan if self._plugin is not None else None
            self._rewind(trainer, pl_module, snapshot)
            if self._plugin is not None and chosen is not None:
                self._plugin._set_search_plan(chosen)  # a fresh loss scaler if the chosen plan has fp16
        state["pending_restore"] = None
        state["snapshot"] = None
        state["reference_end"] = None
        self._early_stopping.resume(trainer)  # the model holds its final state: EarlyStopping judges from here on

    def _rewind(self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: dict[str, Any]) -> None:
        """Restore ``snapshot`` bit for bit, the loss scaler included.

        A snapshot taken while no plan used fp16 holds no scaler state; a rejected fp16 trial leaves behind a scaler
        whose scale it has backed off. Dropping the plan first drops that scaler (a user-supplied one is kept and
        restored from the snapshot), so the next fp16 plan starts from a fresh scaler, as the first fp16 trial did.
        """
        if self._plugin is not None:
            self._plugin._set_search_plan(PrecisionPlan())
        TrainingSnapshot.from_state(snapshot).restore(trainer, pl_module, self._scaler())

    @staticmethod
    def _set_sampler_epoch(trainer: pl.Trainer, epoch: int) -> None:
        loader = getattr(trainer.fit_loop, "_combined_loader", None)
        for dataloader in getattr(loader, "flattened", []) or []:
            _set_sampler_epoch(dataloader, epoch)

    # ------------------------------------------------------------------------------------------- batch stage
    def _batch_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        assert self._plugin is not None and self._low is not None
        started = time.perf_counter()
        plugin, low, config = self._plugin, self._low, self.config
        device = model_device(pl_module)
        device_type = device.type
        modules = dict(iter_operators(pl_module))
        lowerable = [n for n, m in modules.items() if lowering_for(m, low, device) not in (None, Lowering.NONE)]
        all_low = PrecisionPlan.from_dict({n: low.value for n in lowerable})
        rng = capture_rng()
        step = _TrainingStepRunner(trainer, pl_module, batch, batch_idx)
        try:
            profiler = OperatorProfiler(pl_module, device_type, config.profile_steps, config.profile_warmup)
            results = profiler.profile(
                {"fp32": lambda: plugin._set_search_plan(PrecisionPlan()),
                 "low": lambda: plugin._set_search_plan(all_low)}, step
            )
            self._reduce_profile(trainer, results)
            decisions, runs = self._select(modules, lowerable, results)
            candidates = tuple(n for n in results["fp32"].order if decisions.get(n, {}).get("decision") == "candidate")
            self._state["runs"] = runs
            order = results["fp32"].order
            alternatives = self._alternatives(modules, lowerable, order, decisions, candidates)
            timer = StepTimer(device_type, config.profile_steps, config.profile_warmup)
            configs: dict[str, Any] = {"fp32": lambda: plugin._set_search_plan(PrecisionPlan())}
            plans = dict(alternatives)
            if candidates:
                plans = {"candidates": self._plan_for(candidates), **plans}
            for label, plan in plans.items():
                configs[label] = functools.partial(_activate, plugin, plan)
            times = timer.time(configs, step)
            step_ms = {k: _reduce_mean(trainer, min(v)) for k, v in times.items()}
            median_ms = {k: _reduce_mean(trainer, statistics.median(v)) for k, v in times.items()}
            step_saved: dict[str, float] = {}
            if config.objective is not Objective.THROUGHPUT:
                saved = timer.saved_bytes(pl_module, configs, step)
                step_saved = {k: _reduce_mean(trainer, float(v)) for k, v in saved.items()}
            if config.objective is Objective.MEMORY:
                winner = self._memory_winner(step_saved, step_ms, median_ms, list(alternatives), bool(candidates))
            elif config.objective is Objective.BALANCED:
                winner = self._balanced_winner(step_saved, step_ms, median_ms, list(alternatives), bool(candidates))
            else:
                winner = self._whole_step_winner(step_ms, median_ms, list(alternatives), bool(candidates))
            if winner is not None:
                candidates, runs = self._adopt(winner, alternatives[winner], order, decisions, step_ms, step_saved)
                self._state["runs"] = runs
            elif candidates and not self._plan_pays(step_ms, median_ms):
                for name in candidates:
                    if not decisions[name].get("forced"):
                        decisions[name]["decision"] = "fp32"
                        decisions[name]["reason"] = (
                            f"candidate plan as a whole not better than fp32 ({step_ms['candidates']:.3f} ms vs"
                            f" {step_ms['fp32']:.3f} ms per step)")
                candidates = tuple(n for n in candidates if decisions[n].get("forced"))
        finally:
            TrainingSnapshot.from_state(self._state["snapshot"]).restore(trainer, pl_module, self._scaler(), rng=False)
            restore_rng(rng)
            plugin._set_search_plan(PrecisionPlan().with_provenance(role="trial", trial="fp32 reference"))
        gains = {n: decisions[n]["gain_ms"] for n in candidates}
        memory = {label: {"saved_bytes": r.saved_bytes, "peak_bytes": r.peak_bytes} for label, r in results.items()}
        payload: dict[str, Any] = {"decisions": decisions, "candidates": list(candidates), "gains": gains,
                                   "step_ms": step_ms, "step_saved_bytes": step_saved, "runs": runs,
                                   "order": results["fp32"].order, "memory": memory}
        payload = trainer.strategy.broadcast(payload, src=0)
        self._state["runs"] = payload["runs"]
        self._state["profile"] = {"operators": payload["decisions"], "step_ms": payload["step_ms"],
                                  "step_saved_bytes": payload["step_saved_bytes"],
                                  "order": payload["order"], "memory": payload["memory"]}
        search = GroupSearch(tuple(payload["candidates"]), payload["gains"], self.config.max_trials)
        self._state["group_search"] = search.state_dict()
        self._state["low_precision"] = low.value
        self._state["profiling_seconds"] = time.perf_counter() - started
        reference = self._current_trial()
        if reference is not None:
            reference["profiling_seconds"] = self._state["profiling_seconds"]
        if search.done:  # nothing worth a trial: this epoch is plain FP32 training and is kept
            reference = self._current_trial()
            assert reference is not None
            reference.update(verdict="pass", reason="no candidate operators: trained in fp32", seconds=0.0)
            self._finish(trainer, PrecisionPlan(), "fp32 reference", reason="no operator pays in low precision",
                         kept=True)

    def _alternatives(self, modules: dict[str, torch.nn.Module], lowerable: list[str], order: list[str],
                      decisions: dict[str, dict[str, Any]], candidates: tuple[str, ...]) -> dict[str, PrecisionPlan]:
        """Whole-step alternatives to the per-operator candidate plan, timed side by side with it.

        Per-operator timings miss effects that only show in a whole step: casts vanish inside long low-precision
        runs (``all_low``), and cheap operators lowered between lowered ones can cost more than the casts they
        save, e.g. a bf16 LayerNorm on a CPU (``compute``: the compute operators alone). Only plans that differ
        from the candidate plan and from each other are timed.
        """
        assert self._low is not None
        low = self._low.value
        allowed = [n for n in order if n in lowerable and not decisions[n].get("excluded")]
        heavy = [n for n in allowed if classify(modules[n]) in _HEAVY_KINDS]
        options = {
            "all_low": PrecisionPlan.from_dict({n: low for n in allowed}),
            "compute": PrecisionPlan.from_dict({n: low for n in heavy}),
        }
        seen = {self._plan_for(candidates).entries} if candidates else set()
        seen.add(PrecisionPlan().entries)
        out: dict[str, PrecisionPlan] = {}
        for label, plan in options.items():
            if plan.entries not in seen:
                seen.add(plan.entries)
                out[label] = plan
        return out

    def _whole_step_winner(self, step_ms: dict[str, float], median_ms: dict[str, float], labels: list[str],
                           have_candidates: bool) -> str | None:
        """The alternative to adopt instead of the candidate plan, if one beats it (and FP32) as a whole step."""
        winners = [label for label in labels if self._faster(step_ms, median_ms, label, "fp32")
                   and (not have_candidates or self._faster(step_ms, median_ms, label, "candidates"))]
        return min(winners, key=lambda label: step_ms[label]) if winners else None

    def _memory_winner(self, saved: dict[str, float], step_ms: dict[str, float], median_ms: dict[str, float],
                       labels: list[str], have_candidates: bool) -> str | None:
        """With ``objective="memory"``: the alternative that saves the fewest bytes for backward in a whole step.

        It must save less than the candidate plan (or FP32) by ``speed_margin`` and be no slower than FP32 by more
        than ``max_memory_slowdown`` in both the fastest and the median round.
        """
        incumbent = "candidates" if have_candidates else "fp32"
        limit = self.config.max_memory_slowdown
        winners = [label for label in labels
                   if saved[label] <= saved[incumbent] * (1 - self.config.speed_margin)
                   and step_ms[label] <= step_ms["fp32"] * limit and median_ms[label] <= median_ms["fp32"] * limit]
        return min(winners, key=lambda label: saved[label]) if winners else None

    def _balanced_winner(self, saved: dict[str, float], step_ms: dict[str, float], median_ms: dict[str, float],
                         labels: list[str], have_candidates: bool) -> str | None:
        """With ``objective="balanced"``: the alternative with the best geometric mean of its time and saved-bytes
        ratios to FP32 (time from the fastest and the median round, whichever is worse), if it beats the candidate
        plan's (or FP32's) score by ``speed_margin``."""
        def score(label: str) -> float:
            time_ratio = max(step_ms[label] / step_ms["fp32"], median_ms[label] / median_ms["fp32"])
            return math.sqrt(time_ratio * saved[label] / max(saved["fp32"], 1.0))

        incumbent = score("candidates") if have_candidates else 1.0
        winners = [label for label in labels if score(label) <= incumbent * (1 - self.config.speed_margin)]
        return min(winners, key=score) if winners else None

    def _adopt(self, winner: str, plan: PrecisionPlan, order: list[str], decisions: dict[str, dict[str, Any]],
               step_ms: dict[str, float], saved: dict[str, float] | None = None,
               ) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """Make the operators of ``plan`` the candidates (no cheap-operator fills: the plan was timed as is)."""
        lowered = {selector for selector, precision in plan.entries if precision is not Precision.FP32}
        what = {"all_low": f"the all-{self._low} plan", "compute": "the plan of compute operators only"}[winner]
        better = {Objective.THROUGHPUT: "faster as a whole", Objective.MEMORY: "leaner as a whole",
                  Objective.BALANCED: "better in time x memory as a whole"}[self.config.objective]
        timing = f"({step_ms[winner]:.3f} vs {step_ms['fp32']:.3f} ms per step in fp32"
        timing += f", {step_ms['candidates']:.3f} ms for the candidates)" if "candidates" in step_ms else ")"
        if saved:
            incumbent = "candidates" if "candidates" in saved else "fp32"
            timing += (f"; {saved[winner] / 2**20:.1f} MiB saved for backward vs {saved[incumbent] / 2**20:.1f} MiB"
                       f" for the {incumbent}")
        for name in order:
            if name in lowered:
                decisions[name].update(decision="candidate", reason=f"lowered as in {what}, {better} {timing}")
            elif decisions.get(name, {}).get("decision") in ("candidate", "fill") and not decisions[name].get("forced"):
                decisions[name].update(decision="fp32", reason=f"left fp32: {what} is {better} {timing}")
        candidates = tuple(n for n in order if n in lowered or decisions[n].get("forced"))
        return candidates, []

    def _reduce_profile(self, trainer: pl.Trainer, results: dict[str, ProfileResult]) -> None:
        """Average per-operator times over ranks so every rank decides on the same numbers."""
        if trainer.world_size <= 1:
            return
        for result in results.values():
            names = sorted(result.operators)
            values = torch.tensor([[result.operators[n].forward_ms, result.operators[n].backward_ms,
                                    result.operators[n].compute_ms] for n in names], dtype=torch.float64)
            reduced = trainer.strategy.reduce(values.to(trainer.strategy.root_device), reduce_op="mean").cpu()
            for name, row in zip(names, reduced.tolist()):
                m = result.operators[name]
                m.forward_ms, m.backward_ms, m.compute_ms = row

    def _select(self, modules: dict[str, torch.nn.Module], lowerable: list[str],
                results: dict[str, ProfileResult]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        config = self.config
        fp32, low = results["fp32"].operators, results["low"].operators
        decisions: dict[str, dict[str, Any]] = {}
        fillable: set[str] = set()
        include = PrecisionPlan.from_dict({s: "bf16" for s in config.include})
        exclude = PrecisionPlan.from_dict({s: "bf16" for s in config.exclude})
        for name, module in modules.items():
            kind = classify(module)
            entry: dict[str, Any] = {"type": type(module).__name__, "kind": kind.value,
                                     "params": sum(p.numel() for p in module.parameters())}
            a, b = fp32.get(name), low.get(name)
            if a is not None:
                entry["fp32"] = a.to_dict()
            if b is not None:
                entry["low"] = b.to_dict()
            entry["gain_ms"] = 0.0
            if name not in lowerable:
                entry.update(decision="fp32", reason="shape-only" if kind is OperatorKind.SHAPE
                             else f"no {self._low} kernel on this device")
            elif exclude._match(name, type(module)) is not None:
                entry.update(decision="fp32", reason="excluded by CoMPSearch(exclude=...)", excluded=True)
            elif include._match(name, type(module)) is not None:
                entry.update(decision="candidate", reason="included by CoMPSearch(include=...)", forced=True,
                             gain_ms=(a.total_ms - b.total_ms) if a is not None and b is not None else 0.0)
            elif a is None or b is None:
                entry.update(decision="fp32", reason="not run in the training step")
            elif kind in _HEAVY_KINDS:
                entry.update(self._judge_operator(a.total_ms, b.total_ms, a.saved_bytes, b.saved_bytes))
            else:
                cheap_ok = b.compute_ms <= a.compute_ms * (1 + config.speed_margin) + config.min_gain_ms
                entry.update(decision="fill" if cheap_ok else "fp32",
                             reason="lowered only between lowered operators" if cheap_ok
                             else f"slower in {self._low} ({b.compute_ms:.4f} vs {a.compute_ms:.4f} ms)")
                if cheap_ok:
                    fillable.add(name)
            decisions[name] = entry
        runs = _cheap_runs(results["fp32"].order, decisions, fillable, modules)
        return decisions, runs

    def _judge_operator(self, t32: float, tlow: float, m32: int, mlow: int) -> dict[str, Any]:
        config = self.config
        time_ratio = tlow / t32 if t32 > 0 else float("inf")
        mem_ratio = mlow / m32 if m32 > 0 else 1.0
        gain = t32 - tlow
        if config.objective is Objective.THROUGHPUT:
            ok = gain >= max(config.speed_margin * t32, config.min_gain_ms)
            why = f"time x{time_ratio:.2f} ({t32:.4f} -> {tlow:.4f} ms)"
        elif config.objective is Objective.MEMORY:
            ok = mem_ratio <= 1 - config.speed_margin and time_ratio <= config.max_memory_slowdown
            why = f"saved bytes x{mem_ratio:.2f}, time x{time_ratio:.2f}"
            gain = float(m32 - mlow)
        else:
            score = math.sqrt(max(time_ratio, 0.0) * mem_ratio)
            ok = score <= 1 - config.speed_margin
            why = f"time x{time_ratio:.2f}, saved bytes x{mem_ratio:.2f}, balanced x{score:.2f}"
            gain = 1.0 - score
        return {"decision": "candidate" if ok else "fp32", "reason": ("pays: " if ok else "does not pay: ") + why,
                "gain_ms": float(gain), "time_ratio": time_ratio, "memory_ratio": mem_ratio}

    def _plan_pays(self, step_ms: dict[str, float], median_ms: dict[str, float]) -> bool:
        if self.config.objective is Objective.MEMORY:
            return True  # per-operator memory checks already passed; whole-step time is reported, not required
        return self._faster(step_ms, median_ms, "candidates", "fp32")

    def _faster(self, step_ms: dict[str, float], median_ms: dict[str, float], a: str, b: str) -> bool:
        """Whether configuration ``a`` beats ``b`` by the margin in both the fastest and the median round.

        Noise on a shared machine can fake a win in one statistic; it rarely fakes it in both.
        """
        keep = 1 - self.config.speed_margin
        return step_ms[a] <= step_ms[b] * keep and median_ms[a] <= median_ms[b] * keep

    # ------------------------------------------------------------------------------------------------ record
    def _build_record(self) -> dict[str, Any]:
        state = self._state
        trials = []
        rejected_seconds = 0.0
        for index, trial in enumerate(state["trials"]):
            plan = PrecisionPlan.from_dict(trial["plan"])
            kept = index == state.get("kept_trial")
            if not kept and trial["seconds"] is not None:
                rejected_seconds += float(trial["seconds"])
            trials.append({
                "label": trial["label"],
                "low_operators": [s for s, p in plan.entries if p is not Precision.FP32],
                "metric": trial.get("metric"),
                "reference": state["trials"][0].get("metric") if state["trials"] else None,
                "verdict": trial["verdict"],
                "reason": trial["reason"],
                "epochs": self.config.trial_epochs,
                "batches": trial.get("batches"),  # None: whole epochs
                "seconds": trial["seconds"],
                "median_step_ms": trial.get("median_step_ms"),
                "skipped_steps": trial.get("skipped_steps", 0),
                "kept": kept,
            })
        profile = state["profile"] or {}
        search_seconds = float(state["profiling_seconds"]) + rejected_seconds
        warmup_seconds = self._warmup_overhead_seconds()
        fit_seconds = float(state["fit_seconds"])
        chosen = state["chosen"]
        return {
            "version": _STATE_VERSION,
            "monitor": self.config.monitor,
            "mode": self.config.mode,
            "tolerance": self.config.tolerance,
            "tolerance_mode": self.config.tolerance_mode,
            "objective": self.config.objective.value,
            "low_precision": state["low_precision"],
            "search_start_epoch": state["search_start_epoch"],
            "chosen_plan": chosen,
            "chosen_trial": state["chosen_label"],
            "finish_reason": state.get("finish_reason"),
            "lowered_operators": [] if chosen is None else [s for s, p in chosen["entries"].items() if p != "fp32"],
            "num_operators": len(profile.get("operators", {})),
            "operators": profile.get("operators", {}),
            "step_ms": profile.get("step_ms", {}),
            "step_saved_bytes": profile.get("step_saved_bytes", {}),
            "memory": profile.get("memory", {}),
            "trials": trials,
            "extension_epochs": state["extension_epochs"],
            "cost": {
                "profiling_seconds": float(state["profiling_seconds"]),
                "rejected_trial_seconds": rejected_seconds,
                "search_seconds": search_seconds,
                "fit_seconds": fit_seconds or None,
                "share_of_fit": (search_seconds / fit_seconds) if fit_seconds else None,
                # The FP32 warm-up epochs ran slower than the chosen plan would have; users pay that too.
                "warmup_batches": int(state.get("warmup_batches") or 0),
                "warmup_overhead_seconds": warmup_seconds,
                "total_seconds": search_seconds + (warmup_seconds or 0.0),
                "total_share_of_fit": ((search_seconds + (warmup_seconds or 0.0)) / fit_seconds)
                if fit_seconds else None,
            },
        }

    def _warmup_overhead_seconds(self) -> float | None:
        """Estimated time the FP32 warm-up batches lost against the chosen plan (``None`` until one is chosen).

        Warm-up batches x (median FP32 reference batch time - median batch time of the kept trial), both measured
        in real training; zero when the plan stays FP32.
        """
        state = self._state
        if state["chosen"] is None:
            return None
        batches = int(state.get("warmup_batches") or 0)
        trials = state["trials"]
        if not batches or not trials or PrecisionPlan.from_dict(state["chosen"]).is_all_fp32:
            return 0.0
        same = [t for t in trials[1:] if t["label"] == state["chosen_label"]]
        reference = trials[0].get("median_step_ms")
        chosen = same[-1].get("median_step_ms") if same else None
        if reference is None or chosen is None:
            return None
        return batches * max(0.0, float(reference) - float(chosen)) / 1e3

    def _publish(self, trainer: pl.Trainer, final: bool) -> None:
        record = self._build_record()
        # Trainer.log_dir is a collective (it broadcasts from rank 0): every rank must ask for it.
        directory = Path(self.config.record_dir or trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "comp_search.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
            if record["chosen_plan"] is not None:
                PrecisionPlan.from_dict(record["chosen_plan"]).save(directory / "comp_plan.json")
        if final:
            return
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    "comp/lowered_operators": float(len(record["lowered_operators"])),
                    "comp/trials": float(len(record["trials"])),
                    "comp/search_seconds": float(record["cost"]["search_seconds"]),
                },
                step=trainer.global_step,
            )
            logger.log_hyperparams({"comp_plan": record["chosen_plan"]["entries"] if record["chosen_plan"] else {}})
        if self.config.verbose:
            rank_zero_info(format_record(record))

    # --------------------------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        state = dict(self._state)
        if self._early_stopping.active:  # Lightning saves only the states of callbacks in trainer.callbacks
            state["paused_callbacks"] = self._early_stopping.states()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise SearchConfigError(
                f"Cannot resume a CoMPSearch state of version {state_dict.get('version')!r}; this version reads"
                f" {_STATE_VERSION}."
            )
        state = self._fresh_state()
        state.update(state_dict)
        self._paused_states = dict(state.pop("paused_callbacks", None) or {})
        self._state = state


def _is_early_stopping(callback: Callback) -> bool:
    return isinstance(callback, EarlyStopping)


def _no_epoch_follows(trainer: pl.Trainer) -> bool:
    """Whether training ends with the current epoch: a stop was requested, or max_steps or max_epochs is reached."""
    max_epochs = trainer.fit_loop.max_epochs
    return (trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
            or (max_epochs is not None and 0 <= max_epochs <= trainer.current_epoch + 1))


def _activate(plugin: CoMPPrecision, plan: PrecisionPlan) -> Any:
    """Put ``plan`` into effect and return the context of a calibrated training step (for ``StepTimer``)."""
    plugin._set_search_plan(plan)
    return plugin.executor.step(StepKind.TRAIN)


def _reduce_mean(trainer: pl.Trainer, value: float) -> float:
    if trainer.world_size <= 1:
        return float(value)
    tensor = torch.tensor(float(value), dtype=torch.float64, device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(tensor, reduce_op="mean"))


def _cheap_runs(order: list[str], decisions: dict[str, dict[str, Any]], fillable: set[str],
                modules: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    """Maximal runs of fillable cheap operators between two candidate operators, in execution order."""
    runs = []
    before: str | None = None
    pending: list[str] = []
    for name in order:
        decision = decisions.get(name, {}).get("decision")
        if decision == "candidate":
            if before is not None and pending:
                runs.append({"before": before, "after": name, "operators": list(pending)})
            before, pending = name, []
        elif name in fillable:
            pending.append(name)
        elif classify(modules[name]) is OperatorKind.SHAPE:
            continue
        else:
            before, pending = None, []
    return runs


class _TrainingStepRunner:
    """Runs the user's ``training_step`` plus backward on one batch, without logging, stepping or gradient sync."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.batch = batch
        self.batch_idx = batch_idx

    def __call__(self) -> None:
        module = self.pl_module
        module.log = _ignore  # type: ignore[method-assign]
        module.log_dict = _ignore  # type: ignore[method-assign]
        try:
            output = module.training_step(self.batch, self.batch_idx)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if module.automatic_optimization:
                if not isinstance(loss, torch.Tensor):
                    raise SearchConfigError(
                        "CoMPSearch profiles the training step, but training_step returned"
                        f" {type(output).__name__} instead of a loss tensor (or a dict with 'loss')."
                    )
                loss.backward()
        finally:
            del module.log
            del module.log_dict
            for param in module.parameters():
                param.grad = None


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None

