"""``CoMPSearch``: the Lightning callback of the search. It holds the Lightning hooks and delegates every step.

The search runs inside the user's ``trainer.fit`` and never changes the model's code:

1. **Warm-up.** The first ``warmup_epochs`` train in FP32 as usual (early metrics are too noisy to judge by).
2. **Batch stage** (:mod:`~lightning_comp.search.stages.batch_stage`, decisions in
   :mod:`~lightning_comp.search.decisions`): which operators are worth a trial, measured on one batch.
3. **Epoch stage** (:mod:`~lightning_comp.search.stages.trials`): FP32 reference and candidate trials from one
   snapshot, judged on the monitored validation metric; unsafe operators isolated by adaptive group testing.
4. **Rewind and keep** (:mod:`~lightning_comp.search.rewind.loop`): rejected trials are rewound bit-exactly and given
   back through ``max_epochs``; ``EarlyStopping`` is paused meanwhile (:mod:`lightning_comp.search.rewind.pause`).

The decision record (:mod:`~lightning_comp.search.record.build`) is kept in the callback state, written as JSON next to
the logs, logged to the Trainer's loggers and printed on rank 0. Under DDP every rank takes every decision from the
same numbers (:mod:`~lightning_comp.search.ranks`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from typing_extensions import override

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.devices.device_classes import device_class, model_device
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.checks import (
    check_compiled,
    check_low_precision,
    check_monitor,
    check_optimization,
    check_selectors,
    check_trainer,
)
from lightning_comp.search.compiled import EagerWhileSearching
from lightning_comp.search.config import MeasurementConfig, SearchConfig
from lightning_comp.search.record.build import build_record, publish
from lightning_comp.search.record.progress import SearchProgress
from lightning_comp.search.rewind.checkpoints import CheckpointHold
from lightning_comp.search.rewind.loop import LoopBudget
from lightning_comp.search.rewind.model_state import gather_to_rank_zero, own_part, sharded_run
from lightning_comp.search.rewind.pause import CallbackPause
from lightning_comp.search.rewind.snapshot import TrainingSnapshot
from lightning_comp.search.stages.batch_stage import BatchStage
from lightning_comp.search.stages.trials import (
    TrialDriver,
    warn_ended_before_the_search,
    warn_stopped_inside_the_search,
)
from lightning_comp.search.state import Phase, SearchState

__all__ = ["CoMPSearch"]

_TIMING_SKIP_BATCHES = 2


class CoMPSearch(Callback):
    """Search a per-operator precision plan for the model being trained, then train with it.

    Use with the plugin: ``Trainer(plugins=[CoMPPrecision()], callbacks=[CoMPSearch()])``.

    Every argument is a field of :class:`~lightning_comp.SearchConfig` of the same name, which documents it and holds
    its default (an argument left ``None`` keeps it); they say what you want. How the search measures is one nested
    argument, ``measurement``: a preset's name, a :class:`~lightning_comp.search.MeasurementConfig`, or a mapping of
    its fields. So every setting has one spelling, in Python, in LightningCLI's ``init_args`` and in the Hydra app::

        CoMPSearch(monitor="val_acc", mode="max")
        CoMPSearch(objective="memory", precisions={"saved": "fp8", "master": "off"}, max_slowdown_vs_fastest=1.3)
        CoMPSearch(objective="memory", low_precision="off", memory_budget=0.6)  # memory alone, compute left FP32
        CoMPSearch(include=["blocks.*.mlp"], include_dimensions={"state": ["blocks.0.*"]})
        CoMPSearch(measurement="thorough")
        CoMPSearch(measurement={"profile_steps": 8, "timing": "cpu"})
        CoMPSearch(**dataclasses.asdict(config))  # from a SearchConfig

    Args:
        monitor: the validation metric that judges convergence.
        mode: ``"min"`` or ``"max"``.
        tolerance: how much worse than the FP32 reference a candidate may end.
        tolerance_mode: ``"relative"`` or ``"absolute"``.
        objective: ``"throughput"``, ``"memory"`` or ``"balanced"``.
        low_precision: ``"auto"``, ``"bf16"`` or ``"fp16"`` (the compute dimension), or ``"off"`` (compute stays
            FP32; only the saved and state dimensions are searched, with ``objective="memory"`` or ``"balanced"``).
            ``"auto"`` where no 16-bit precision is native searches as ``"off"`` for those objectives, and nothing
            for ``"throughput"``.
        precisions: ``{dimension: choice}`` for ``saved``, ``state`` and ``master``: ``"auto"``, ``"off"`` or a
            value of that dimension.
        include: plan selectors of operators to trial in low precision whatever the batch stage measures.
        include_dimensions: ``{dimension: [selectors]}``: the same for the saved, state and master dimensions.
        exclude: plan selectors of operators never to lower.
        warmup_epochs: FP32 epochs before the search starts.
        trial_epochs: epochs each convergence trial trains.
        trial_batches: batches (or a fraction of an epoch) each trial trains; ``None``: whole epochs.
        max_trials: most candidate trials.
        max_slowdown_vs_fastest: the largest step-time slowdown the memory and balanced objectives accept against
            the fastest fixed policy the batch stage measures (FP32, AMP's plan, the compute-only plan, one global
            autocast region); ``None``: 1.15 for memory, 1.05 for balanced.
        memory_budget: (``objective="memory"``) the step peak to reach: a float is a fraction of AMP's step peak
            (of the FP32 step with ``low_precision="off"``), an int the bytes the process's peak must fit in (CUDA's
            reserved peak, a CPU's live heap); the cheapest bytes per millisecond are taken until it is met.
        measurement: ``"quick"``, ``"default"`` or ``"thorough"``, a ``MeasurementConfig``, or a mapping of its
            fields (over ``"default"``, or over the preset its ``preset`` key names).
        record_dir: where the decision record and the chosen plan are written.
        snapshot_device: where the search keeps its snapshots (``None``: where the tensors are).
        verbose: print the decision table on rank 0.

    A rewind restores, bit for bit: parameters and buffers (non-persistent ones too), every optimizer, LR scheduler
    and the loss scaler, the RNGs, the training dataloaders' own generators (so every trial sees the reference's
    batches), and the state of every stateful callback (``WorkerScaledLR``, weight averaging/EMA, any callback with
    a ``state_dict``) except ``ModelCheckpoint`` (held meanwhile, see below) and ``EarlyStopping`` (paused during
    the search).

    Note:
        ``EarlyStopping`` callbacks are paused from the search's first trial until the model holds its final state
        (the kept trial, or the rewound snapshot): they neither count the trials' validations against their patience
        nor stop the fit on a rejected trial's NaN. Their state travels in the search's checkpoint state meanwhile.

    Note:
        ``ModelCheckpoint`` writes no top-k file over the same span (:mod:`lightning_comp.search.rewind.checkpoints`):
        no trial the search may rewind can become ``best_model_path`` or one of ``best_k_models``. Its
        ``last.ckpt`` goes on being written (``save_last=True``; ``"link"`` writes a file meanwhile): that is what a
        run killed inside the search resumes from, so give the Trainer ``ModelCheckpoint(save_last=True)`` to resume
        there (without it, a resume starts the search again from its last checkpoint before it). When the search
        keeps the trial it has just validated, that validation is scored at once; after a rewind, scoring resumes
        with the next validation. Checkpoints written inside the search (``last.ckpt``, or the user's own
        ``trainer.save_checkpoint``) carry the search's snapshots (model, optimizers, callbacks: up to two, the
        search's start and the FP32 reference's end), so they are up to about 3x an ordinary checkpoint; no
        checkpoint written before or after the search holds one.

    Raises:
        SearchConfigError: on an invalid argument (the message names it and the valid values).
    """

    def __init__(
        self,
        monitor: str | None = None,
        mode: str | None = None,
        *,
        tolerance: float | None = None,
        tolerance_mode: str | None = None,
        objective: str | None = None,
        low_precision: str | None = None,
        fp8: str | None = None,
        include_fp8: Sequence[str] | None = None,
        precisions: Mapping[str, str] | None = None,
        include: Sequence[str] | None = None,
        include_dimensions: Mapping[str, Sequence[str]] | None = None,
        exclude: Sequence[str] | None = None,
        warmup_epochs: int | None = None,
        trial_epochs: int | None = None,
        trial_batches: int | float | None = None,
        max_trials: int | None = None,
        max_slowdown_vs_fastest: float | None = None,
        memory_budget: float | int | None = None,
        measurement: str | Mapping[str, Any] | MeasurementConfig | None = None,
        record_dir: str | None = None,
        snapshot_device: str | None = None,
        verbose: bool | None = None,
    ) -> None:
        given = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        given = {name: value for name, value in given.items() if value is not None}
        self.config = SearchConfig.of(given)  # validates every setting, naming a bad one
        self._plugin: CoMPPrecision | None = None
        self._budget = LoopBudget()
        self._batch_started: float | None = None
        self._fit_started: float | None = None
        self._monitor_checked = False
        # EarlyStopping must not judge trials that are rewound (nor stop the fit on a rejected trial's NaN)
        self._early_stopping = CallbackPause(_is_early_stopping)
        # nor may ModelCheckpoint make a trial that may be rewound its "best" (search/rewind/checkpoints.py)
        self._checkpoints = CheckpointHold()
        self._paused_states: dict[str, dict[str, Any]] = {}  # their states, from a checkpoint written during a pause
        self._state = SearchState()
        self._trials: TrialDriver | None = None
        self._eager = EagerWhileSearching()  # a compiled model measures and trials eagerly (search/compiled.py)
        self._trainer: pl.Trainer | None = None  # (set up: what state_dict asks whether the run is sharded)
        self._deferred = False  # a resumed fit's beginning waits for its checkpoint (FSDP, ModelParallel)

    # -------------------------------------------------------------------------------------------- public state
    @property
    def state_key(self) -> str:
        """Constant, so a checkpoint resumes the search whatever arguments the callback is built with."""
        return "CoMPSearch"

    @property
    def phase(self) -> Phase:
        """``"pending"`` (warm-up), ``"measuring"`` (the batch stage is due), ``"searching"`` (trials) or ``"done"``
        (a :class:`Phase`, equal to those strings)."""
        return self._state.phase

    @property
    def state(self) -> SearchState:
        """Where the search stands: phase, trials (:class:`TrialRecord`), extensions (for inspection; read only)."""
        return self._state

    @property
    def chosen_plan(self) -> PrecisionPlan | None:
        """The plan the search chose, once it is done."""
        chosen = self._state.chosen
        return None if chosen is None else PrecisionPlan.from_dict(chosen)

    @property
    def record(self) -> dict[str, Any] | None:
        """The decision record (JSON-able) once the search is done, else ``None``."""
        if self._state.phase is not Phase.DONE:
            return None
        return build_record(self._state, self.config)

    # --------------------------------------------------------------------------------------------- setup hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._plugin = check_trainer(trainer, self.config)
            self._trainer = trainer
            self._plugin.expect_plan()
            check_optimization(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = time.perf_counter()
        # FSDP and ModelParallel strategies restore a checkpoint after on_fit_start (whose path is not known yet
        # there): the search begins once a checkpoint's state is back (at the end of load_state_dict), or at
        # on_train_start where none was restored
        self._deferred = trainer.strategy.restore_checkpoint_after_setup
        if not self._deferred:
            self._begin(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._deferred:
            self._deferred = False
            self._begin(trainer, pl_module)

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Decide or read back what the search searches, check the set-up, and put the fit's plan in force."""
        assert self._plugin is not None
        device = device_class(model_device(pl_module))  # Lightning has placed the model by now
        starting = self._state.phase is Phase.PENDING
        if starting:  # a search under way keeps the precisions it searches (the state's, read back on resume)
            self._state.low_precision = self.config.resolve_low_precision(device)
            # fp8 entries train eagerly only (a compiled model's plan has none)
            self._state.fp8_precision = (None if self._plugin.compiled
                                         else self.config.resolve_fp8(device, self._state.low_precision))
        check_low_precision(self.config, self._state.low_precision, device, self._plugin, starting=starting,
                            where=model_device(pl_module))
        self._trials = TrialDriver(self.config, self._state, self._plugin, self._budget, self._early_stopping,
                                   self._checkpoints, self._publish, self._capture)
        self._budget.remember(trainer)
        self._trials.extend(trainer)
        check_selectors(self.config, pl_module)
        check_compiled(self.config, self._plugin)
        self._trials.begin_fit(trainer, pl_module)
        if self._state.in_search:  # resumed inside the search
            self._early_stopping.pause(trainer, self._paused_states)
            self._checkpoints.hold(trainer)

    # -------------------------------------------------------------------------------------------- epoch hooks
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state, trials = self._state, self._driver
        if state.phase is Phase.DONE:
            trials.apply_pending_restore(trainer, pl_module)
            return
        if state.phase is Phase.PENDING:
            if trainer.current_epoch >= self.config.warmup_epochs:
                trials.begin_search(trainer, pl_module)
            return
        current = state.current_trial
        if current is not None and trials.due(current, trainer.current_epoch):
            trials.close(trainer, pl_module)  # resumed from a checkpoint written before the verdict
            if state.phase is Phase.DONE:
                trials.apply_pending_restore(trainer, pl_module)
                return
            current = None
        if current is None:
            trials.start_next(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._follow_phase()  # with on_validation_start: before every forward of the fit
        if not self._state.searching:
            return
        if self._state.phase is Phase.MEASURING:
            self._batch_stage(trainer, pl_module, batch, batch_idx)
            if self._state.phase is not Phase.SEARCHING:
                self._follow_phase()
                return
        current = self._state.current_trial
        if current is not None and batch_idx == 0:
            number = len(self._state.trials)
            SearchProgress(trainer).trial(trainer, number, 1 + self.config.max_trials, current.label)
        if current is not None and current.batches:
            self._budget.validate_after(trainer, current.batches)
        _synchronize(pl_module)
        self._batch_started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        current = self._state.current_trial
        if current is None or not self._state.searching:
            return
        if self._batch_started is not None and batch_idx >= _TIMING_SKIP_BATCHES:
            _synchronize(pl_module)
            current.batch_ms.append((time.perf_counter() - self._batch_started) * 1e3)
        self._batch_started = None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            current.nonfinite_loss = True

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow_phase()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._monitor_checked:  # fail on the sanity check already, before any epoch is spent
            check_monitor(self.config, trainer)
            self._monitor_checked = True
        if trainer.sanity_checking or not self._state.searching:
            return
        current = self._state.current_trial
        if current is None:
            return
        if current.batches and lightning.batches_done_this_epoch(trainer) != current.batches:
            return  # a validation of the user's own schedule, not the one that ends this trial
        check_monitor(self.config, trainer)
        current.metrics[str(trainer.current_epoch)] = float(trainer.callback_metrics[self.config.monitor])
        if current.batches:
            self._driver.close_trial_of_batches(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._budget.restore_epoch_length(trainer)  # a rejected trial of batches cut this epoch short
        if self._state.searching and self._state.current_trial is not None:
            self._driver.end_of_epoch(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state.phase is Phase.DONE:  # training stopped before the epoch start that would apply a rewind
            self._driver.apply_pending_restore(trainer, pl_module)
        elif self._state.searching:
            warn_stopped_inside_the_search(self._state)
        elif self._state.phase is Phase.PENDING:
            warn_ended_before_the_search(trainer, self.config.warmup_epochs)
        self._early_stopping.resume(trainer)
        self._checkpoints.release(trainer)
        self._eager.release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._early_stopping.resume(trainer)  # hand the Trainer back with its callbacks
        self._checkpoints.release(trainer)
        self._eager.release()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit_started is not None:
            self._state.fit_seconds = float(self._state.fit_seconds) + time.perf_counter() - self._fit_started
            self._fit_started = None
        if self._state.phase is Phase.DONE:
            self._publish(trainer, True)

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def _driver(self) -> TrialDriver:
        assert self._trials is not None, "CoMPSearch hooks ran before on_fit_start"
        return self._trials

    def _follow_phase(self) -> None:
        """Compiled models run eagerly from the batch stage to the decision (:mod:`lightning_comp.search.compiled`)."""
        self._eager.follow(self._state.phase, self._plugin is not None and self._plugin.compiled)

    def _scaler(self) -> Any:
        return None if self._plugin is None else self._plugin.scaler

    def _capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """A snapshot of the run for rewinds (every stateful callback but this one, checkpoints and early stopping)."""
        def rewound(callback: Callback) -> bool:
            return callback is not self and not isinstance(callback, (ModelCheckpoint, EarlyStopping))

        return TrainingSnapshot.capture(trainer, pl_module, self._scaler(), callbacks=rewound,
                                        device=self.config.snapshot_device).to_state()

    def _publish(self, trainer: pl.Trainer, final: bool) -> None:
        publish(trainer, self._state, self.config, final)

    def _batch_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        state = self._state
        assert self._plugin is not None and state.low_precision is not None
        started = time.perf_counter()
        snapshot = state.snapshot
        assert snapshot is not None

        def restore() -> None:
            TrainingSnapshot.from_state(snapshot).restore(trainer, pl_module, self._scaler(), rng=False)

        stage = BatchStage(self.config, state.low_precision, self._plugin, SearchProgress(trainer),
                           fp8=state.fp8_precision)
        result = stage.run(trainer, pl_module, batch, batch_idx, restore)
        self._driver.after_batch_stage(trainer, result, time.perf_counter() - started)

    # --------------------------------------------------------------------------------------------- checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        state = self._state.to_dict()
        if self._early_stopping.active:  # Lightning saves only the states of callbacks in trainer.callbacks
            state["paused_callbacks"] = self._early_stopping.states()
        if self._trainer is not None and sharded_run(self._trainer):
            # each rank's snapshots hold its own shards, and only rank 0's callback state reaches a sharded
            # checkpoint: every rank's go there, each rank takes its own back on resume
            for key in ("snapshot", "reference_end"):
                state[key] = {"per_rank": gather_to_rank_zero(state[key])}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the search from a checkpoint's state.

        Raises:
            SearchConfigError: on another state version, or unknown keys (named).
        """
        values = dict(state_dict)
        self._paused_states = dict(values.pop("paused_callbacks", None) or {})
        for key in ("snapshot", "reference_end"):  # written sharded: this rank's own
            values[key] = own_part(values.get(key))
        self._state = SearchState.from_dict(values)
        if self._deferred and self._trainer is not None:  # (FSDP, ModelParallel: read back after on_fit_start)
            self._deferred = False
            self._begin(self._trainer, self._trainer.lightning_module)


def _is_early_stopping(callback: Callback) -> bool:
    return isinstance(callback, EarlyStopping)


def _synchronize(pl_module: pl.LightningModule) -> None:
    if model_device(pl_module).type == "cuda":
        torch.cuda.synchronize()
