"""The epoch stage: convergence trials from one snapshot, their verdicts, and how the search ends.

An FP32 reference trial and candidate trials train for ``trial_epochs`` each (or ``trial_batches`` of one epoch) on
the same batches, and are judged on the monitored validation metric against the reference (``tolerance``; see
:mod:`lightning_comp.search.decisions.trials`). NaN/Inf losses and too many FP16 skipped steps reject a trial. Unsafe
operators are isolated by adaptive group testing (:mod:`lightning_comp.search.decisions.group_search`); a failing
group that mixes dimensions is split by dimension first, and the label of each of its parts' trials says so
(``"compute of 20, split by dimension from a failing compute+saved+state group of 60 (trial 2)"``). Rejected
trials are rewound; the chosen trial's progress is kept.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_comp.adapters import lightning_internals as lightning
from lightning_comp.devices.device_classes import device_class, model_device
from lightning_comp.devices.emulation_speed import why_nothing_pays
from lightning_comp.errors import UsageError
from lightning_comp.operators.discovery import iter_operators
from lightning_comp.plan.plan import PrecisionPlan
from lightning_comp.plugins.comp import CoMPPrecision
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.checks import no_validation_at_trial_end, nothing_to_search
from lightning_comp.search.config import SearchConfig
from lightning_comp.search.decisions.batch_result import BatchStageResult
from lightning_comp.search.decisions.group_search import GroupSearch
from lightning_comp.search.decisions.trial_plans import PlanRole, plan_for
from lightning_comp.search.decisions.trials import TrialVerdict, blind_trials, judge_trial
from lightning_comp.search.ranks import agree
from lightning_comp.search.rewind.checkpoints import CheckpointHold
from lightning_comp.search.rewind.loop import LoopBudget, no_epoch_follows, rewind
from lightning_comp.search.rewind.pause import CallbackPause
from lightning_comp.search.state import Phase, Restore, SearchState, TrialRecord

__all__ = ["TrialDriver", "trial_batches", "warn_ended_before_the_search", "warn_stopped_inside_the_search"]


def trial_batches(config: SearchConfig, epoch_length: int | float, accumulate: int = 1) -> int | None:
    """How many batches a trial trains (``None``: the whole epoch).

    Rounded up to whole optimizer steps under gradient accumulation, so a cut epoch leaves no half-accumulated
    gradient behind.
    """
    wanted = config.trial_batches
    if wanted is None or not isinstance(epoch_length, int):  # inf (an iterable without length) is a float
        return None
    batches = max(1, int(wanted * epoch_length)) if isinstance(wanted, float) else wanted
    batches = math.ceil(batches / accumulate) * accumulate
    return batches if batches < epoch_length else None


class TrialDriver:
    """Starts, closes and judges trials, ends the search, and applies the rewind it leaves pending.

    Args:
        config: the search's settings.
        state: the search's state (shared with the callback, mutated here; it holds the searched precision).
        plugin: the plugin the trials' plans run through.
        budget: the loop budget (epochs and steps given back for rejected trials).
        pause: the EarlyStopping pause, resumed once the model holds its final state.
        checkpoints: the hold on ``ModelCheckpoint``'s top-k saving, released then too.
        publish: writes and logs the decision record.
        capture: takes a snapshot of the run (for the reference trial's end).
    """

    def __init__(self, config: SearchConfig, state: SearchState, plugin: CoMPPrecision, budget: LoopBudget,
                 pause: CallbackPause, checkpoints: CheckpointHold, publish: Callable[[pl.Trainer, bool], None],
                 capture: Callable[[pl.Trainer, pl.LightningModule], dict[str, Any]]) -> None:
        self.config = config
        self.state = state
        self.plugin = plugin
        self.budget = budget
        self.pause = pause
        self.checkpoints = checkpoints
        self.publish = publish
        self.capture = capture

    def extend(self, trainer: pl.Trainer) -> None:
        """Apply the state's extensions to the Trainer's limits."""
        self.budget.extend(trainer, self.state.extension_epochs, self.state.extension_steps)

    def plan(self, group: Sequence[Candidate] | None) -> PrecisionPlan:
        """The plan of a trial of ``group``."""
        if not group:
            return PrecisionPlan()
        low = self.state.low_precision
        assert low is not None
        return plan_for(low, self.state.runs, group, self.state.choices)

    def due(self, trial: TrialRecord, epochs_finished: int) -> bool:
        """Whether ``trial`` has trained its epochs and been validated at the end of its last one."""
        last_epoch = trial.start_epoch + self.config.trial_epochs - 1
        return epochs_finished > last_epoch and str(last_epoch) in trial.metrics

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, label: str,
              group: tuple[Candidate, ...] | None, rewind_first: bool) -> None:
        """Start a trial of ``group`` (``None``: the FP32 reference), rewinding to the snapshot first if asked."""
        state = self.state
        if rewind_first:
            assert state.snapshot is not None and state.search_start_epoch is not None
            started = time.perf_counter()
            rewind(trainer, pl_module, self.plugin, state.snapshot, epoch=state.search_start_epoch)
            state.rewind_seconds.append(time.perf_counter() - started)
        plan = self.plugin.try_plan(PlanRole.TRIAL.mark(self.plan(group), trial=label))
        state.trials.append(TrialRecord(
            label=label, group=group, plan=plan.to_dict(), start_epoch=trainer.current_epoch,
            start_step=trainer.global_step,
            batches=trial_batches(self.config, trainer.num_training_batches, trainer.accumulate_grad_batches),
            skipped_steps_before=self.plugin.skipped_steps, steps_before=self.plugin.optimizer_steps,
            started=time.time(),
        ))
        state.extension_epochs += self.config.trial_epochs  # provisional: given back if this trial is kept
        self.extend(trainer)

    def begin_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At a fit's start: put the plan the search is at back in force (the chosen one, or the running trial's),
        or end at once a search that cannot find anything here."""
        state = self.state
        current = state.current_trial
        if state.phase is Phase.DONE and state.chosen is not None:
            self.plugin.try_plan(PrecisionPlan.from_dict(state.chosen), chosen=True)
        elif state.searching and current is not None:
            self.plugin.try_plan(PrecisionPlan.from_dict(current.plan))
        elif state.phase is Phase.PENDING and state.low_precision is None:
            device = model_device(pl_module)
            state.num_operators = len(list(iter_operators(pl_module)))
            self.finish(trainer, PrecisionPlan(), "fp32", reason=agree(trainer, why_nothing_pays(
                device_class(device), device)))
        elif state.phase is Phase.PENDING and state.low_precision is not None:
            why = nothing_to_search(self.config, state.low_precision, pl_module)
            if why is not None:  # finish at once: no profiling, no trials, no extra epochs
                rank_zero_warn(f"CoMPSearch: {why}. Training continues in fp32 without a search.")
                state.num_operators = len(list(iter_operators(pl_module)))
                self.finish(trainer, PrecisionPlan(), "fp32", reason=why)

    def begin_search(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the search at this epoch: snapshot the run, pause EarlyStopping, start the FP32 reference trial."""
        state = self.state
        state.phase = Phase.MEASURING
        state.search_start_epoch = trainer.current_epoch
        state.warmup_batches = lightning.batches_done_in_total(trainer)
        started = time.perf_counter()
        state.snapshot = self.capture(trainer, pl_module)
        state.snapshot_seconds.append(time.perf_counter() - started)
        self.pause.pause(trainer)
        self.checkpoints.hold(trainer)  # no trial that may be rewound can become a "best" checkpoint
        self.start(trainer, pl_module, label="fp32 reference", group=None, rewind_first=False)
        start = trainer.callback_metrics.get(self.config.monitor)
        if trainer.current_epoch >= 1 and isinstance(start, (torch.Tensor, float, int)):
            # where the reference started from, beside its own metrics (an epoch's key: the last warm-up epoch's)
            state.trials[-1].metrics[str(trainer.current_epoch - 1)] = float(start)

    def after_batch_stage(self, trainer: pl.Trainer, result: BatchStageResult, seconds: float) -> None:
        """Take the batch stage's result: the candidates and the group testing over them, or the end of the search
        when nothing is worth a trial (the reference trial's epoch is then plain FP32 training, and kept)."""
        state = self.state
        state.batch = result
        state.num_operators = len(result.decisions)
        state.phase = Phase.SEARCHING
        state.group_search = GroupSearch(result.candidates, result.benefits, self.config.max_trials,
                                         members=result.members)
        state.profiling_seconds = seconds
        if state.group_search.done:
            reference = state.current_trial
            assert reference is not None
            reference.verdict, reference.reason = TrialVerdict.PASS, "no candidate operators: trained in fp32"
            reference.seconds = 0.0
            self.finish(trainer, PrecisionPlan(), "fp32 reference", reason="no operator pays in low precision",
                        kept=True)

    def start_next(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the trial adaptive group testing asks for next.

        Raises:
            UsageError: if the group testing has no trial to run although the search is not finished.
        """
        search = self.state.group_search
        assert search is not None
        group = search.next_group()
        if group is None:  # pragma: no cover - the search finishes when its result is reached
            raise UsageError("CoMPSearch has no trial to run although the search is not finished.")
        number = len(self.state.trials)  # labels are unique: the chosen trial is found by its label
        label = f"confirm safe set (trial {number})" if search.confirming is not None else (
            "all candidates" if group == search.candidates else f"{search.describe(group)} (trial {number})")
        self.start(trainer, pl_module, label=label, group=group, rewind_first=True)

    def close(self, trainer: pl.Trainer, pl_module: pl.LightningModule, validated: bool = False) -> None:
        """Judge the current trial (every rank takes rank 0's verdict) and move the search on.

        Args:
            trainer: the Trainer.
            pl_module: the model.
            validated: the trial's judging validation has just run (not: a resume from a checkpoint written before
                the verdict): if the trial is kept, ``ModelCheckpoint`` scores that validation at once.
        """
        state = self.state
        trial = state.current_trial
        assert trial is not None
        last_epoch = str(trial.start_epoch + self.config.trial_epochs - 1)
        trial.metric = trial.metrics[last_epoch]
        # the batch stage runs inside the reference trial's first batch and is counted apart
        trial.seconds = time.time() - trial.started - (state.profiling_seconds if trial.is_reference else 0.0)
        trial.steps = trainer.global_step - trial.start_step
        trial.skipped_steps = self.plugin.skipped_steps - trial.skipped_steps_before
        state.extension_steps += trial.steps  # provisional, like the epochs: given back if this trial is kept
        self.extend(trainer)  # before Lightning checks max_steps after this batch
        trial.median_step_ms = statistics.median(trial.batch_ms) if trial.batch_ms else None
        reference = state.trials[0].metric if state.trials and not trial.is_reference else None
        trial.verdict, trial.reason = agree(trainer, judge_trial(
            self.config, trial.metric, nonfinite_loss=trial.nonfinite_loss, skipped_steps=trial.skipped_steps,
            steps=self.plugin.optimizer_steps - trial.steps_before, reference=reference))
        if trial.is_reference:
            blind = blind_trials(self.config, trial.metrics.get(str(trial.start_epoch - 1)), trial.metric)
            if blind is not None:
                rank_zero_warn(f"CoMPSearch: {blind}.")
            if not trial.batches:  # a reference of batches is never continued: its epoch was cut short
                started = time.perf_counter()
                state.reference_end = self.capture(trainer, pl_module)
                state.snapshot_seconds.append(time.perf_counter() - started)
            return
        search = state.group_search
        assert search is not None and trial.group is not None
        search.report(trial.group, trial.verdict is TrialVerdict.PASS)
        if not search.done:
            return
        result = tuple(search.result or ())
        if not result:
            self.finish(trainer, PrecisionPlan(), "fp32 reference", reason="no candidate converged",
                        restore=Restore.SNAPSHOT if state.trials[0].batches else Restore.REFERENCE_END)
        elif trial.verdict is TrialVerdict.PASS and trial.group == result:
            self.finish(trainer, self.plan(result), trial.label, reason="converged", kept=True, validated=validated)
        else:  # the latest passing trial of exactly that group
            label = next((t.label for t in reversed(state.trials)
                          if t.group == result and t.verdict is TrialVerdict.PASS), "")
            self.finish(trainer, self.plan(result), label, reason="best passing group", restore=Restore.SNAPSHOT)

    def end_of_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the current trial if its last epoch ends here (and it was validated), else check it will be.

        Raises:
            SearchConfigError: when the trial's last epoch ended without the validation that judges it.
        """
        current = self.state.current_trial
        assert current is not None
        if self.due(current, trainer.current_epoch + 1):
            self.close(trainer, pl_module, validated=True)  # may extend max_epochs/max_steps: ask what follows after
            if no_epoch_follows(trainer):
                # No epoch follows whose start would apply a pending rewind (the last trial was rejected and the
                # run ends here): apply it now, so the model the fit returns and the last checkpoint are not the
                # rejected trial's.
                self.apply_pending_restore(trainer, pl_module)
            return
        stopping = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        last_epoch = current.start_epoch + self.config.trial_epochs - 1
        if trainer.current_epoch >= last_epoch and str(last_epoch) not in current.metrics and not stopping:
            raise no_validation_at_trial_end(self.config, trainer, last_epoch)

    def close_trial_of_batches(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Judge a trial of ``trial_batches`` batches; end its epoch here unless it is the trial that is kept."""
        state = self.state
        index = len(state.trials) - 1
        self.close(trainer, pl_module, validated=True)
        self.budget.restore_validation(trainer)
        if state.phase is Phase.DONE and state.kept_trial == index:
            return  # the chosen trial trains on to the end of its epoch: its progress is kept whole
        self.budget.end_epoch_after_this_batch(trainer)
        if state.phase is Phase.DONE and no_epoch_follows(trainer):
            self.apply_pending_restore(trainer, pl_module)  # no epoch start follows to apply it

    def finish(self, trainer: pl.Trainer, plan: PrecisionPlan, label: str, reason: str, kept: bool = False,
               restore: Restore | None = None, validated: bool = False) -> None:
        """End the search with ``plan``.

        Args:
            trainer: the Trainer.
            plan: the chosen plan.
            label: the label of the trial whose plan it is.
            reason: why the search ends so.
            kept: the trial now ending trained with ``plan``: keep its progress (its epochs are not extra).
            restore: continue from the end of the FP32 reference trial (its epochs are kept), or rewind to the
                search's start; applied at the next epoch start.
            validated: the kept trial's judging validation has just run (``ModelCheckpoint`` scores it at once).
        """
        state = self.state
        if kept or restore is Restore.REFERENCE_END:
            state.extension_epochs -= self.config.trial_epochs
            state.extension_steps -= int(state.trials[-1 if kept else 0].steps or 0)
        state.kept_trial = len(state.trials) - 1 if kept else 0 if restore is Restore.REFERENCE_END else None
        state.pending_restore = restore
        if restore is not Restore.SNAPSHOT:
            state.snapshot = None
        if restore is not Restore.REFERENCE_END:
            state.reference_end = None
        chosen = PlanRole.CHOSEN.mark(
            plan, made_by="CoMPSearch", trial=label, reason=reason, monitor=self.config.monitor,
            tolerance=self.config.tolerance, tolerance_mode=self.config.tolerance_mode.value,
        )
        state.chosen = self.plugin.try_plan(chosen, chosen=True).to_dict()
        state.chosen_label = label
        state.finish_reason = reason
        state.phase = Phase.DONE
        self.extend(trainer)
        if restore is None:  # the model holds its final state now; otherwise once the rewind is applied
            self.pause.resume(trainer)
            self.checkpoints.release(trainer, score=kept and validated)
        self.publish(trainer, False)

    def apply_pending_restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply the rewind :meth:`finish` left pending, then put the chosen plan back."""
        state = self.state
        restore = state.pending_restore
        if restore is None:
            return
        snapshot = state.snapshot if restore is Restore.SNAPSHOT else state.reference_end
        if snapshot is not None:
            chosen = self.plugin.plan
            started = time.perf_counter()
            rewind(trainer, pl_module, self.plugin, snapshot)
            state.rewind_seconds.append(time.perf_counter() - started)
            self.plugin.try_plan(chosen, chosen=True)  # a fresh loss scaler if the chosen plan has fp16
        state.pending_restore = None
        state.snapshot = None
        state.reference_end = None
        self.pause.resume(trainer)  # the model holds its final state: EarlyStopping judges from here on
        self.checkpoints.release(trainer)  # ModelCheckpoint scores from the next validation on


def warn_stopped_inside_the_search(state: SearchState) -> None:
    """Warn that a fit ended while a trial ran: the model holds a trial's state, which the search may reject."""
    last = state.trials[-1].label if state.trials else None
    rank_zero_warn(
        f"CoMPSearch: training stopped during the search (trainer.should_stop, max_time or max_steps), in or"
        f" after trial {last!r}. The model holds the state and plan of that trial, which the search may have"
        " rejected. Resume from a checkpoint written during the search (e.g. last.ckpt) to finish it."
    )


def warn_ended_before_the_search(trainer: pl.Trainer, warmup_epochs: int) -> None:
    """Warn that a fit ended before the search began: nothing was searched and the model trained on its given plan."""
    rank_zero_warn(
        f"CoMPSearch did not run: the fit ended after {trainer.current_epoch} epoch(s) (global step"
        f" {trainer.global_step}), before the search starts (after warmup_epochs={warmup_epochs} epoch(s) of"
        " training), so no plan was searched and the model trained under the plugin's own plan (all FP32 if it was"
        " given none). Train longer (max_epochs > warmup_epochs), or set CoMPSearch(warmup_epochs=0)."
    )
